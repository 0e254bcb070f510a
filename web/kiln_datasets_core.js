// The dataset editor's logic without a DOM or ComfyUI (tested by tests/web/datasets_core.test.mjs):
// what the routes of nodes/dataset_editor.py are sent, and how their answers are shown.

export const TYPES = ["character", "style", "concept"];
export const BULK_OPS = {
  prefix: { label: "add prefix", fields: ["text"] },
  suffix: { label: "add suffix", fields: ["text"] },
  replace: { label: "find and replace", fields: ["find", "replace"] },
};
const SEVERITY_ORDER = ["fatal", "skipped", "warning", "note"];

export const datasetPath = (name, action = "") =>
  `/kiln/datasets/${encodeURIComponent(name)}${action ? `/${action}` : ""}`;

/** "512, 768 1024" → [512, 768, 1024]; an Error naming the bad entry otherwise. Empty → null (512). */
export function parseResolutions(text) {
  const parts = String(text ?? "").split(/[\s,]+/).filter(Boolean);
  if (!parts.length) return null;
  return parts.map((part) => {
    if (!/^\d+$/.test(part)) throw new Error(`resolution ${JSON.stringify(part)} is not a whole number of pixels`);
    return Number(part);
  });
}

/** The body of POST /kiln/datasets from the form's fields. */
export function createBody({ name, type, trigger_word, resolutions }) {
  return { name: String(name ?? "").trim(), type: type ?? "", trigger_word: String(trigger_word ?? "").trim(),
    resolutions: parseResolutions(resolutions) };
}

/** The body of POST .../bulk: the op's own fields only. */
export function bulkBody(op, values, paths) {
  if (!BULK_OPS[op]) throw new Error(`unknown bulk edit ${op}`);
  const body = { op, paths: [...paths] };
  for (const field of BULK_OPS[op].fields) body[field] = values[field] ?? "";
  return body;
}

/** ComfyUI's /view arguments for an image of a dataset under input/. */
export function viewQuery(dataset, path, version = "") {
  const slash = path.lastIndexOf("/");
  const subfolder = slash < 0 ? dataset : `${dataset}/${path.slice(0, slash)}`;
  const params = new URLSearchParams({ filename: path.slice(slash + 1), subfolder, type: "input" });
  if (version) params.set("v", version);
  return `/view?${params}`;
}

/** What a card shows: an image itself, a clip its first frame (the thumbnail the server made, when it could). */
export function shownFile(image) {
  return image.thumbnail || image.path;
}

/** A card's label: the path, the size, and a clip's length ("a.mp4 96×64 · 24 frames, 1.5 s"). */
export function cardLabel(image) {
  const size = image.width ? ` ${image.width}×${image.height}` : "";
  const seconds = image.seconds ? `, ${image.seconds} s` : "";
  return `${image.path}${size}` + (image.frames ? ` · ${image.frames} frames${seconds}` : "");
}

/** The worst severity among problems ("" when none): the card's badge colour. */
export function worst(problems) {
  const found = new Set((problems ?? []).map((p) => p.severity));
  return SEVERITY_ORDER.find((s) => found.has(s)) ?? "";
}

/** One line per problem, worst first: "skipped: 32×32 px: a side is under 64 px — fix: ...". */
export function problemLines(problems) {
  return [...(problems ?? [])]
    .sort((a, b) => SEVERITY_ORDER.indexOf(a.severity) - SEVERITY_ORDER.indexOf(b.severity))
    .map((p) => `${p.severity}: ${p.message} — fix: ${p.fix}`);
}

/** "3 images, 1 skipped, 2 with warnings" for the dataset's header. */
export function summary(dataset) {
  const images = dataset?.images ?? [];
  const skipped = images.filter((image) => !image.usable).length;
  const warned = images.filter((image) => image.usable && worst(image.problems) === "warning").length;
  const parts = [`${images.length} image${images.length === 1 ? "" : "s"}`];
  if (skipped) parts.push(`${skipped} skipped`);
  if (warned) parts.push(`${warned} with warnings`);
  if (dataset?.trash) parts.push(`${dataset.trash} in .trash`);
  return parts.join(", ");
}

/** The answer of an upload as one status line. */
export function uploadMessage({ added = [], refused = [] }) {
  const lines = [];
  if (added.length) lines.push(`added ${added.map((a) => a.path).join(", ")}`);
  for (const r of refused) lines.push(`refused ${r.error}`);
  return lines.join("; ");
}

/** The selection after the gallery reloads: only paths that still exist. */
export function keepSelected(selected, images) {
  const present = new Set((images ?? []).map((image) => image.path));
  return new Set([...selected].filter((path) => present.has(path)));
}

/** The caption prompt the editor queues on ComfyUI's own queue (POST /prompt, API format): Kiln Caption Images
 * restricted to the selection (`only`), with Load CLIP in front for the comfyui_clip engine, and ComfyUI's
 * Preview Any on its report (a prompt runs only what leads to an output node). */
export function captionPrompt({ dataset, engine, model, clip, clipType, style, triggerWord, overwrite, paths, where,
  maxTokens = 256 }) {
  const only = [...(paths ?? [])];
  if (!only.length) throw new Error("select the images to caption first (or tick 'select all')");
  const inputs = { folder: dataset, engine, style: style || "short", prompt: "", trigger_word: String(triggerWord ?? "").trim(),
    overwrite: Boolean(overwrite), max_tokens: Number(maxTokens) || 256, seed: 0, only: only.join("\n") };
  const prompt = { 2: { class_type: "KilnCaptionImages", inputs }, 3: { class_type: "PreviewAny", inputs: { source: ["2", 1] } } };
  if (engine === "comfyui_clip") {
    if (!clip) throw new Error("no text encoder in models/text_encoders/: put a vision-language one there (e.g. Qwen2.5-VL 7B), or use transformers");
    prompt[1] = { class_type: "CLIPLoader", inputs: { clip_name: clip, type: clipType || "qwen_image" } };
    inputs.clip = ["1", 0];
  } else if (engine === "transformers") {
    if (!model) throw new Error(`no captioner in models/LLM/: ${where || "put a transformers model folder there"}`);
    inputs.model = model;
  } else {
    throw new Error(`unknown captioning engine ${engine}`);
  }
  return prompt;
}

/** POST /prompt's refusal as one line: its message and each node's errors. */
export function promptError(body) {
  const lines = [body?.error?.message ?? body?.error ?? "the prompt was refused"];
  for (const node of Object.values(body?.node_errors ?? {})) {
    for (const e of node.errors ?? []) lines.push(`${node.class_type}: ${e.message}${e.details ? ` (${e.details})` : ""}`);
  }
  return lines.join("; ");
}

/** A verdict (GET .../verdicts) as its card shows it: the line without the leading path. */
export function verdictText(verdict) {
  const line = verdict?.line ?? "";
  return line.startsWith(`${verdict.path} `) ? line.slice(verdict.path.length + 1) : line;
}

/** Does a card need the user's attention: a problem from the scan, or a verdict that is not ok? */
export function hasProblems(image, verdict) {
  return (image?.problems ?? []).length > 0 || (verdict != null && !verdict.ok);
}

/** Caption Images' report as the editor's status: "3 captions written, ..." (without the folder's path) and
 * the files not captioned with why; the sample captions are left out (the gallery shows them). */
export function captionSummary(report) {
  const lines = String(report ?? "").split("\n");
  const first = lines.find((line) => /\d+ captions? written/.test(line)) ?? lines[0];
  const head = first.match(/(\d+ captions? written.*)$/)?.[1] ?? first;
  const problems = lines.findIndex((line) => /file\(s\) not captioned/.test(line));
  return [head, ...(problems < 0 ? [] : lines.slice(problems).map((line) => line.trim()))].join("\n");
}

/** The problems a card lists, each once, worst first: the scan's, then the quality pass's own. A verdict repeats
 * the scan's warnings under the same codes, so a code the scan already lists is not listed again. */
export function cardProblems(image, verdict) {
  const scan = image?.problems ?? [];
  const seen = new Set(scan.map((p) => p.code));
  const quality = [];
  (verdict?.problems ?? []).forEach((code, i) => {
    if (seen.has(code)) return;
    seen.add(code);
    quality.push({ code, severity: "warning", message: verdict.messages?.[i] ?? code, fix: verdict.fixes?.[i] ?? "" });
  });
  return [...scan, ...quality].sort((a, b) => SEVERITY_ORDER.indexOf(a.severity) - SEVERITY_ORDER.indexOf(b.severity));
}

/** A verdict's size and buckets for its card ("96x80 [64: 64x48 crop 0x5] ok"): its problems are in the card's list,
 * so only "ok" and the near-duplicate note ("... the one to keep") are added. */
export function verdictHead(verdict) {
  const [width, height] = verdict?.size ?? [];
  const buckets = verdict?.buckets?.length ? ` [${verdict.buckets.join(", ")}]` : "";
  const size = width ? `${width}x${height}${buckets}` : buckets.trim();
  return [size, verdict?.ok ? "ok" : ""].filter(Boolean).join(" ") + (verdict?.note ? ` — ${verdict.note}` : "");
}

/** What a key pressed in a caption does: Enter saves, Shift+Enter (or Enter while an IME composes) is a newline. */
export function captionKey({ key, shiftKey = false, isComposing = false, altKey = false, ctrlKey = false, metaKey = false }) {
  return key === "Enter" && !shiftKey && !isComposing && !altKey && !ctrlKey && !metaKey ? "save" : null;
}

/** The question asked before unsaved captions (path → text) are dropped, or null when there are none. */
export function unsavedQuestion(drafts, action) {
  const paths = [...(drafts?.keys?.() ?? [])];
  if (!paths.length) return null;
  const shown = paths.slice(0, 3).join(", ") + (paths.length > 3 ? ` and ${paths.length - 3} more` : "");
  const what = paths.length === 1 ? `The caption of ${shown} is not saved` : `${paths.length} captions are not saved (${shown})`;
  return `${what}. Discard ${paths.length === 1 ? "it" : "them"} and ${action}?\n\n` +
    "OK discards; Cancel keeps you here to save (Enter, or leave the field).";
}

/** The image shown after `index` when the zoom steps by `delta` (arrow keys), wrapping around. */
export const zoomStep = (index, delta, count) => (count ? (((index + delta) % count) + count) % count : -1);
