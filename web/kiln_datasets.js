// Kiln dataset editor: a "Kiln datasets" sidebar tab beside the dashboard. Lists the datasets under
// ComfyUI's input/, creates one (name, type, trigger word, resolutions → dataset.json), takes images by
// drag and drop (or a file chooser), shows each image with its caption and the problems the dataset
// scan finds in it, edits captions one by one or in bulk (prefix, suffix, find and replace) and moves
// images to the dataset's .trash/ folder. Every change goes through the /kiln/datasets routes of
// nodes/dataset_editor.py; the logic without a DOM is kiln_datasets_core.js. Each card also shows the quality
// pass's verdict (GET .../verdicts, loaded after the gallery), with a filter for the images with problems;
// "Caption selected" (kiln_datasets_caption.js) queues Kiln Caption Images on ComfyUI's queue.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { CaptionRow } from "./kiln_datasets_caption.js";
import {
  BULK_OPS, TYPES, bulkBody, createBody, datasetPath, hasProblems, keepSelected, problemLines, summary, uploadMessage,
  verdictText, viewQuery, worst,
} from "./kiln_datasets_core.js";

const STYLE_ID = "kiln-datasets-style";
const CSS = `
.kiln-datasets [hidden] { display: none !important; }
.kiln-datasets { display: flex; flex-direction: column; gap: 8px; padding: 8px; font-size: 13px; color: var(--fg-color, #ddd); }
.kiln-datasets .kds-row { display: flex; gap: 6px; align-items: center; flex-wrap: wrap; }
.kiln-datasets input, .kiln-datasets select, .kiln-datasets textarea, .kiln-datasets button { font: inherit; color: inherit;
  background: var(--comfy-input-bg, #222); border: 1px solid var(--border-color, #444); border-radius: 4px; padding: 3px 6px; }
.kiln-datasets button { cursor: pointer; }
.kiln-datasets form { display: grid; grid-template-columns: auto 1fr; gap: 4px 8px; padding: 6px; border: 1px solid var(--border-color, #444); border-radius: 6px; }
.kiln-datasets .kds-drop { border: 2px dashed var(--border-color, #555); border-radius: 6px; padding: 14px; text-align: center; cursor: pointer; }
.kiln-datasets .kds-drop.kds-over { border-color: #4a9; background: rgba(68, 170, 153, .1); }
.kiln-datasets .kds-status { min-height: 1.2em; opacity: .85; white-space: pre-wrap; }
.kiln-datasets .kds-status.kds-error { color: #f77; }
.kiln-datasets .kds-gallery { display: grid; grid-template-columns: repeat(auto-fill, minmax(170px, 1fr)); gap: 8px; }
.kiln-datasets .kds-card { border: 1px solid var(--border-color, #444); border-radius: 6px; padding: 6px; display: flex; flex-direction: column; gap: 4px; }
.kiln-datasets .kds-card[data-severity=skipped], .kiln-datasets .kds-card[data-severity=fatal] { border-color: #d55; }
.kiln-datasets .kds-card[data-severity=warning] { border-color: #db4; }
.kiln-datasets .kds-card img { width: 100%; height: 120px; object-fit: contain; background: #111; border-radius: 4px; }
.kiln-datasets .kds-name { font-weight: 600; word-break: break-all; }
.kiln-datasets ul { margin: 0; padding-left: 16px; font-size: 12px; }
.kiln-datasets li[data-severity=skipped], .kiln-datasets li[data-severity=fatal] { color: #f77; }
.kiln-datasets li[data-severity=warning] { color: #db4; }
.kiln-datasets .kds-verdict { font-size: 12px; opacity: .9; word-break: break-word; }
.kiln-datasets .kds-verdict[data-ok=false] { color: #db4; }
.kiln-datasets textarea { width: 100%; box-sizing: border-box; min-height: 48px; resize: vertical; }
`;

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === "kiln") node.dataset.kiln = value;
    else if (key in node && key !== "list") node[key] = value;
    else node.setAttribute(key, value);
  }
  node.append(...children.filter((child) => child != null));
  return node;
}

async function call(path, options = {}) {
  const response = await api.fetchApi(path, { cache: "no-store", ...options });
  const body = await response.json().catch(() => ({}));
  if (!response.ok && !(body.added?.length)) throw new Error(body.error || uploadMessage(body) || `HTTP ${response.status}`);
  return body;
}

const postJson = (path, body) => call(path, { method: "POST", headers: { "Content-Type": "application/json" },
  body: JSON.stringify(body) });

class DatasetEditor {
  constructor() {
    if (!document.getElementById(STYLE_ID)) document.head.append(el("style", { id: STYLE_ID, textContent: CSS }));
    this.dataset = null;
    this.verdicts = new Map();         // path → the quality pass's verdict, once loaded
    this.problemsOnly = false;
    this.captionRow = null;            // made once GET /kiln/captioners answers
    this.selected = new Set();
    this.version = String(Date.now());
    this.pick = el("select", { kiln: "pick", title: "Datasets in ComfyUI's input/" });
    this.pick.addEventListener("change", () => this.open(this.pick.value));
    const newButton = el("button", { kiln: "new", textContent: "New dataset…", type: "button" });
    newButton.addEventListener("click", () => { this.form.hidden = !this.form.hidden; });
    this.form = this.createForm();
    this.status = el("div", { className: "kds-status", kiln: "status" });
    this.body = el("div", { kiln: "body", hidden: true });
    this.element = el("div", { className: "kiln-datasets" },
      el("div", { className: "kds-row" }, el("b", { textContent: "Dataset" }), this.pick, newButton), this.form,
      this.status, this.body);
  }

  createForm() {
    const field = (name, input) => [el("label", { textContent: name }), input];
    const type = el("select", { name: "type" }, el("option", { value: "", textContent: "(not set)" }),
      ...TYPES.map((t) => el("option", { value: t, textContent: t })));
    const form = el("form", { kiln: "create-form", hidden: true },
      ...field("name", el("input", { name: "name", placeholder: "my_character", required: true })),
      ...field("type", type),
      ...field("trigger word", el("input", { name: "trigger_word", placeholder: "ohwx" })),
      ...field("resolutions", el("input", { name: "resolutions", placeholder: "512, 768, 1024" })),
      el("span"), el("button", { kiln: "create", textContent: "Create", type: "submit" }));
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.run(async () => {
        const body = createBody(Object.fromEntries(new FormData(form)));
        await postJson("/kiln/datasets", body);
        form.reset();
        form.hidden = true;
        await this.refresh(body.name);
        return `created ${body.name} (dataset.json written); drop images below`;
      });
    });
    return form;
  }

  /** Run an action, showing its outcome (or its error) in the status line. */
  async run(action) {
    this.say("working…");
    try {
      this.say((await action()) ?? "");
    } catch (error) {
      this.say(error.message ?? String(error), true);
    }
  }

  say(text, error = false) {
    this.status.textContent = text;
    this.status.classList.toggle("kds-error", error);
  }

  async refresh(name = this.dataset?.name) {
    const { datasets } = await call("/kiln/datasets");
    this.pick.replaceChildren(el("option", { value: "", textContent: datasets.length ? "choose…" : "none yet" }),
      ...datasets.map((d) => el("option", { value: d.name, textContent: `${d.name} (${d.detail})` })));
    if (name && datasets.some((d) => d.name === name)) await this.open(name);
  }

  async open(name) {
    this.pick.value = name;
    if (!name) {
      this.dataset = null;
      this.body.hidden = true;
      return;
    }
    this.dataset = await call(datasetPath(name));
    this.selected = keepSelected(this.selected, this.dataset.images);
    this.version = String(Date.now());
    this.verdicts = new Map();
    this.render();
    this.loadVerdicts(name);
    this.loadCaptioners();
  }

  /** The quality pass (it decodes new images: seconds on a large dataset), shown on the cards when it answers. */
  async loadVerdicts(name) {
    this.noteVerdicts("checking quality…");
    try {
      const { verdicts } = await call(datasetPath(name, "verdicts"));
      if (this.dataset?.name !== name) return;
      this.verdicts = new Map(verdicts.map((v) => [v.path, v]));
      this.noteVerdicts(`quality: ${verdicts.filter((v) => !v.ok).length} of ${verdicts.length} usable image(s) with problems`);
      this.showVerdicts();
    } catch (error) {
      this.noteVerdicts(`quality check failed: ${error.message}`);
    }
  }

  noteVerdicts(text) {
    this.verdictNote = text;
    const note = this.body.querySelector("[data-kiln=verdicts-status]");
    if (note) note.textContent = text;
  }

  showVerdicts() {
    for (const card of this.body.querySelectorAll(".kds-card")) {
      const verdict = this.verdicts.get(card.dataset.path);
      const line = card.querySelector(".kds-verdict");
      line.hidden = !verdict;
      if (verdict) {
        line.textContent = verdictText(verdict);
        line.title = [...verdict.messages, verdict.note].filter(Boolean).join("\n");
        line.dataset.ok = String(verdict.ok);
        line.dataset.codes = verdict.problems.join(" ");
      }
      const image = this.dataset.images.find((i) => i.path === card.dataset.path);
      card.hidden = this.problemsOnly && !hasProblems(image, verdict);
    }
  }

  async loadCaptioners() {
    if (this.captionRow) {
      this.captionRow.trigger.value = this.dataset?.meta?.trigger_word ?? "";
      return;
    }
    try {
      const choices = await call("/kiln/captioners");
      this.captionRow ??= new CaptionRow(this, choices);
      if (this.dataset) this.render();
    } catch (error) {
      this.say(`captioning is not available: ${error.message}`, true);
    }
  }

  async reload(message) {
    await this.refresh(this.dataset.name);    // the list's counts change too
    return message;
  }

  async upload(files) {
    if (!files.length || !this.dataset) return;
    const form = new FormData();
    for (const file of files) form.append("image", file, file.name);
    await this.run(async () => this.reload(uploadMessage(await call(datasetPath(this.dataset.name, "upload"),
      { method: "POST", body: form }))));
  }

  render() {
    const d = this.dataset;
    const meta = [d.meta.type, d.meta.trigger_word && `trigger “${d.meta.trigger_word}”`,
      d.meta.resolutions && `${d.meta.resolutions.join("/")} px`].filter(Boolean).join(" · ");
    this.body.hidden = false;
    this.body.replaceChildren(...[
      el("div", { kiln: "summary", textContent: `${summary(d)}${meta ? ` — ${meta}` : ""}` }),
      this.dropZone(), this.bulkBar(), this.captionRow?.element, this.filterRow(),
      d.problems.length ? el("ul", { kiln: "problems" }, ...d.problems.map((p) =>
        el("li", { textContent: `${p.file || "dataset"}: ${problemLines([p])[0]}`, "data-severity": p.severity })))
        : null,
      el("div", { className: "kds-gallery", kiln: "gallery" }, ...d.images.map((image) => this.card(image))),
    ].filter(Boolean));
    this.showVerdicts();
  }

  filterRow() {
    const only = el("input", { type: "checkbox", kiln: "problems-only", checked: this.problemsOnly });
    only.addEventListener("change", () => {
      this.problemsOnly = only.checked;
      this.showVerdicts();
    });
    return el("div", { className: "kds-row", kiln: "filter" }, el("label", {}, only, " only images with problems"),
      el("span", { kiln: "verdicts-status", textContent: this.verdictNote ?? "" }));
  }

  dropZone() {
    const input = el("input", { type: "file", multiple: true, accept: "image/*", kiln: "files", hidden: true });
    input.addEventListener("change", () => this.upload([...input.files]));
    const zone = el("div", { className: "kds-drop", kiln: "drop",
      textContent: "Drop images here, or click to choose (PNG, JPEG, WebP, BMP, TIFF)" }, input);
    zone.addEventListener("click", (event) => { if (event.target !== input) input.click(); });
    zone.addEventListener("dragover", (event) => { event.preventDefault(); zone.classList.add("kds-over"); });
    zone.addEventListener("dragleave", () => zone.classList.remove("kds-over"));
    zone.addEventListener("drop", (event) => {
      event.preventDefault();
      zone.classList.remove("kds-over");
      this.upload([...(event.dataTransfer?.files ?? [])]);
    });
    return zone;
  }

  bulkBar() {
    const all = el("input", { type: "checkbox", kiln: "select-all", title: "select every image" });
    all.checked = this.dataset.images.length > 0 && this.selected.size === this.dataset.images.length;
    all.addEventListener("change", () => {
      this.selected = new Set(all.checked ? this.dataset.images.map((image) => image.path) : []);
      this.render();
    });
    const op = el("select", { kiln: "bulk-op" }, ...Object.entries(BULK_OPS).map(([value, { label }]) =>
      el("option", { value, textContent: label })));
    const inputs = { text: el("input", { kiln: "bulk-text", placeholder: "text" }),
      find: el("input", { kiln: "bulk-find", placeholder: "find", hidden: true }),
      replace: el("input", { kiln: "bulk-replace", placeholder: "replace with", hidden: true }) };
    op.addEventListener("change", () => Object.entries(inputs).forEach(([name, input]) => {
      input.hidden = !BULK_OPS[op.value].fields.includes(name);
    }));
    const apply = el("button", { kiln: "bulk-apply", type: "button", textContent: "Apply to selected" });
    apply.addEventListener("click", () => this.run(async () => {
      const values = Object.fromEntries(Object.entries(inputs).map(([name, input]) => [name, input.value]));
      const answer = await postJson(datasetPath(this.dataset.name, "bulk"), bulkBody(op.value, values, this.selected));
      return this.reload(`${Object.keys(answer.changed).length} caption(s) changed, ${answer.unchanged} unchanged`);
    }));
    const trash = el("button", { kiln: "trash", type: "button", textContent: "Move to .trash" });
    trash.addEventListener("click", () => this.run(async () => {
      const answer = await postJson(datasetPath(this.dataset.name, "trash"), { paths: [...this.selected] });
      this.selected.clear();
      return this.reload(`moved to ${this.dataset.name}/.trash/: ${answer.trashed.join(", ")}`);
    }));
    this.count = el("span", { kiln: "selected", textContent: `${this.selected.size} selected` });
    return el("div", { className: "kds-row", kiln: "bulk" }, all, this.count, op, inputs.text, inputs.find, inputs.replace, apply, trash);
  }

  card(image) {
    const check = el("input", { type: "checkbox", className: "kds-select" });
    check.checked = this.selected.has(image.path);
    check.addEventListener("change", () => {
      if (check.checked) this.selected.add(image.path);
      else this.selected.delete(image.path);
      this.count.textContent = `${this.selected.size} selected`;   // no re-render: unsaved captions stay
    });
    const caption = el("textarea", { className: "kds-caption", value: image.caption, placeholder: "caption" });
    const save = el("button", { className: "kds-save", type: "button", textContent: "Save caption" });
    save.addEventListener("click", () => this.run(async () => {
      await postJson(datasetPath(this.dataset.name, "caption"), { path: image.path, caption: caption.value });
      return this.reload(`saved the caption of ${image.path}`);
    }));
    const size = image.width ? ` ${image.width}×${image.height}` : "";
    return el("div", { className: "kds-card", "data-path": image.path, "data-severity": worst(image.problems) },
      el("img", { src: api.apiURL(viewQuery(this.dataset.name, image.path, this.version)), alt: image.path,
        loading: "lazy" }),
      el("div", { className: "kds-row" }, check, el("span", { className: "kds-name", textContent: `${image.path}${size}` })),
      image.problems.length ? el("ul", { className: "kds-problems" }, ...image.problems.map((p) =>
        el("li", { textContent: problemLines([p])[0], "data-severity": p.severity, "data-code": p.code }))) : null,
      el("div", { className: "kds-verdict", hidden: true }), caption, save);
  }
}

let editor = null;

app.registerExtension({
  name: "kiln.datasets",
  async setup() {
    app.extensionManager?.registerSidebarTab?.({
      id: "kiln-datasets",
      icon: "pi pi-images",
      title: "Kiln datasets",
      tooltip: "Kiln dataset editor: images, captions and problems of the datasets in input/",
      type: "custom",
      render: (container) => {
        editor ??= new DatasetEditor();
        container.replaceChildren(editor.element);
        editor.refresh().catch((error) => editor.say(`could not list the datasets: ${error.message}`, true));
      },
      destroy: () => {},
    });
  },
});
