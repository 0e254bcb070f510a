// The dataset editor's tools column (web/kiln_datasets.js): the drop zone, the "only images with problems"
// filter and the edits of the selected images (prefix, suffix, find and replace, move to .trash); and the calls to
// the /kiln/datasets routes (nodes/dataset_editor.py) every part of the editor makes.
import { api } from "../../scripts/api.js";
import { BULK_OPS, bulkBody, datasetPath, uploadMessage } from "./kiln_datasets_core.js";
import { el, field } from "./kiln_datasets_view.js";

export async function call(path, options = {}) {
  const response = await api.fetchApi(path, { cache: "no-store", ...options });
  const body = await response.json().catch(() => ({}));
  if (!response.ok && !(body.added?.length)) throw new Error(body.error || uploadMessage(body) || `HTTP ${response.status}`);
  return body;
}

export const postJson = (path, body) => call(path, { method: "POST", headers: { "Content-Type": "application/json" },
  body: JSON.stringify(body) });

export function filterRow(editor) {
  const only = el("input", { type: "checkbox", kiln: "problems-only", checked: editor.problemsOnly });
  only.addEventListener("change", () => {
    editor.problemsOnly = only.checked;
    editor.showVerdicts();
  });
  return el("div", { className: "kds-row", kiln: "filter" }, el("label", {}, only, " only images with problems"),
    el("span", { kiln: "verdicts-status", className: "kds-hint", textContent: editor.verdictNote ?? "" }));
}

export function dropZone(editor) {
  const input = el("input", { type: "file", multiple: true, accept: "image/*", kiln: "files", hidden: true,
    "aria-label": "choose images to add" });
  input.addEventListener("change", () => editor.upload([...input.files]));
  const zone = el("div", { className: "kds-drop", kiln: "drop", role: "button", tabIndex: 0,
    textContent: "Drop images here (anywhere in this window), or click to choose (PNG, JPEG, WebP, BMP, TIFF)" }, input);
  zone.addEventListener("click", (event) => { if (event.target !== input) input.click(); });
  zone.addEventListener("keydown", (event) => { if (event.key === "Enter" || event.key === " ") input.click(); });
  return zone;         // a drop anywhere in the editor's window uploads (DatasetEditor), this zone included
}

export function bulkBar(editor) {
  const all = el("input", { type: "checkbox", kiln: "select-all" });
  all.checked = editor.dataset.images.length > 0 && editor.selected.size === editor.dataset.images.length;
  all.addEventListener("change", () => {
    editor.selected = new Set(all.checked ? editor.dataset.images.map((image) => image.path) : []);
    for (const [path, card] of editor.cards) card.check.checked = editor.selected.has(path);
    editor.count.textContent = `${editor.selected.size} selected`;
  });
  const op = el("select", { kiln: "bulk-op" }, ...Object.entries(BULK_OPS).map(([value, { label }]) =>
    el("option", { value, textContent: label })));
  const inputs = { text: el("input", { kiln: "bulk-text" }), find: el("input", { kiln: "bulk-find" }),
    replace: el("input", { kiln: "bulk-replace" }) };
  const fields = { text: field("text", inputs.text), find: field("find", inputs.find),
    replace: field("replace with", inputs.replace) };
  const showFields = () => Object.entries(fields).forEach(([name, f]) => { f.hidden = !BULK_OPS[op.value].fields.includes(name); });
  op.addEventListener("change", showFields);
  showFields();
  const apply = el("button", { kiln: "bulk-apply", type: "button", textContent: "Apply to selected" });
  apply.addEventListener("click", () => editor.run(async () => {
    const values = Object.fromEntries(Object.entries(inputs).map(([name, input]) => [name, input.value]));
    const answer = await postJson(datasetPath(editor.dataset.name, "bulk"), bulkBody(op.value, values, editor.selected));
    return editor.reload(`${Object.keys(answer.changed).length} caption(s) changed, ${answer.unchanged} unchanged`);
  }));
  const trash = el("button", { kiln: "trash", type: "button", textContent: "Move to .trash" });
  trash.addEventListener("click", () => editor.run(async () => {
    const answer = await postJson(datasetPath(editor.dataset.name, "trash"), { paths: [...editor.selected] });
    editor.selected.clear();
    return editor.reload(`moved to ${editor.dataset.name}/.trash/: ${answer.trashed.join(", ")}`);
  }));
  editor.count = el("span", { kiln: "selected", textContent: `${editor.selected.size} selected` });
  return el("fieldset", { kiln: "bulk" }, el("legend", { textContent: "Selected images" }),
    el("div", { className: "kds-row" }, el("label", {}, all, " select all"), editor.count),
    field("edit captions", op), fields.text, fields.find, fields.replace,
    el("div", { className: "kds-row" }, apply, trash),
    el("div", { className: "kds-hint", textContent: "A caption saves on Enter or when you leave it; Shift+Enter for a new line." }));
}
