// The dataset editor's frame (web/kiln_datasets.js): its styles, a wide window over the whole page (a plain
// fixed overlay, the same in every ComfyUI frontend: the frontend's own dialog service wants a Vue component and
// its bottom panel is short), and the zoom that shows one image large. Keys pressed in the window stay in it, so
// ComfyUI's shortcuts (Delete, Ctrl+Z, r, ...) never act on the graph behind it; Esc closes the zoom, then the window.
import { zoomStep } from "./kiln_datasets_core.js";

const STYLE_ID = "kiln-datasets-style";
// z-index 1000: above the canvas and the side bars, below ComfyUI's toasts (10000) and PrimeVue's dialogs (1100+),
// so the frontend's own messages still show over the editor.
const CSS = `
.kiln-datasets [hidden], .kds-overlay[hidden] { display: none !important; }
.kds-overlay { position: fixed; inset: 0; z-index: 1000; background: rgba(0, 0, 0, .6); display: flex;
  align-items: center; justify-content: center; }
.kiln-datasets { display: flex; flex-direction: column; gap: 8px; padding: 8px; font-size: 13px; color: var(--fg-color, #ddd);
  box-sizing: border-box; }
.kiln-datasets.kds-wide { width: min(1680px, 96vw); height: 92vh; background: var(--comfy-menu-bg, #202020);
  border: 1px solid var(--border-color, #444); border-radius: 8px; box-shadow: 0 12px 48px rgba(0, 0, 0, .6); padding: 10px 14px; }
.kiln-datasets .kds-head { display: flex; gap: 10px; align-items: center; flex-wrap: wrap; }
.kiln-datasets .kds-head h2 { font-size: 16px; margin: 0 8px 0 0; }
.kiln-datasets .kds-head .kds-close { margin-left: auto; font-size: 16px; padding: 2px 10px; }
.kiln-datasets .kds-row { display: flex; gap: 6px; align-items: center; flex-wrap: wrap; }
.kiln-datasets .kds-field { display: flex; flex-direction: column; gap: 2px; font-size: 12px; opacity: .95; }
.kiln-datasets .kds-field > span { opacity: .8; }
.kiln-datasets .kds-inline { display: flex; gap: 6px; align-items: center; }
.kiln-datasets input, .kiln-datasets select, .kiln-datasets textarea, .kiln-datasets button { font: inherit; color: inherit;
  background: var(--comfy-input-bg, #222); border: 1px solid var(--border-color, #444); border-radius: 4px; padding: 3px 6px; }
.kiln-datasets button { cursor: pointer; }
.kiln-datasets form { display: flex; flex-wrap: wrap; gap: 8px; align-items: end; padding: 6px;
  border: 1px solid var(--border-color, #444); border-radius: 6px; }
.kiln-datasets .kds-main { flex: 1; min-height: 0; display: grid; grid-template-columns: minmax(260px, 320px) 1fr; gap: 12px; }
.kiln-datasets .kds-tools { overflow-y: auto; display: flex; flex-direction: column; gap: 10px; padding-right: 4px; }
.kiln-datasets .kds-tools fieldset { border: 1px solid var(--border-color, #444); border-radius: 6px; margin: 0; padding: 6px 8px;
  display: flex; flex-direction: column; gap: 6px; }
.kiln-datasets .kds-tools legend { padding: 0 4px; font-weight: 600; }
.kiln-datasets .kds-pane { overflow-y: auto; min-height: 0; }
.kiln-datasets .kds-drop { border: 2px dashed var(--border-color, #555); border-radius: 6px; padding: 14px; text-align: center;
  cursor: pointer; }
.kds-wide.kds-over .kds-drop { border-color: #4a9; background: rgba(68, 170, 153, .1); }
.kiln-datasets .kds-status { min-height: 1.2em; opacity: .85; white-space: pre-wrap; }
.kiln-datasets .kds-status.kds-error { color: #f77; }
.kiln-datasets .kds-hint { font-size: 12px; opacity: .7; }
.kiln-datasets .kds-gallery { display: grid; grid-template-columns: repeat(auto-fill, minmax(230px, 1fr)); gap: 10px; }
.kiln-datasets .kds-card { border: 1px solid var(--border-color, #444); border-radius: 6px; padding: 6px; display: flex;
  flex-direction: column; gap: 4px; }
.kiln-datasets .kds-card[data-severity=skipped], .kiln-datasets .kds-card[data-severity=fatal] { border-color: #d55; }
.kiln-datasets .kds-card[data-severity=warning] { border-color: #db4; }
.kiln-datasets .kds-thumb { padding: 0; border: 0; background: #111; border-radius: 4px; cursor: zoom-in; }
.kiln-datasets .kds-thumb img { display: block; width: 100%; height: 170px; object-fit: contain; }
.kiln-datasets .kds-name { font-weight: 600; word-break: break-all; }
.kiln-datasets ul { margin: 0; padding-left: 16px; font-size: 12px; }
.kiln-datasets li[data-severity=skipped], .kiln-datasets li[data-severity=fatal] { color: #f77; }
.kiln-datasets li[data-severity=warning] { color: #db4; }
.kiln-datasets .kds-verdict { font-size: 12px; opacity: .9; word-break: break-word; }
.kiln-datasets textarea { width: 100%; box-sizing: border-box; min-height: 64px; resize: vertical; }
.kiln-datasets .kds-card[data-state=dirty] textarea, .kiln-datasets .kds-card[data-state=error] textarea { border-color: #e90; }
.kiln-datasets .kds-state { font-size: 12px; color: #e90; flex: 1; }
.kiln-datasets .kds-card[data-state=error] .kds-state { color: #f77; }
.kiln-datasets .kds-zoom { position: fixed; inset: 0; z-index: 1; background: rgba(0, 0, 0, .85); display: flex;
  flex-direction: column; align-items: center; justify-content: center; gap: 8px; cursor: zoom-out; }
.kiln-datasets .kds-zoom img { width: 92vw; height: 84vh; object-fit: contain; }
.kiln-datasets .kds-zoom .kds-row { cursor: default; }
.kiln-datasets.kds-launcher .kds-list { list-style: none; padding: 0; display: flex; flex-direction: column; gap: 4px; }
.kiln-datasets.kds-launcher .kds-list button { width: 100%; text-align: left; }
@media (max-width: 900px) { .kiln-datasets .kds-main { grid-template-columns: 1fr; overflow-y: auto; } }
`;

export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === "kiln") node.dataset.kiln = value;
    else if (key in node && key !== "list") node[key] = value;
    else node.setAttribute(key, value);
  }
  node.append(...children.filter((child) => child != null));
  return node;
}

/** A control with its visible label: <label><span>text</span>control</label>. */
export const field = (text, control, className = "kds-field") =>
  el("label", { className }, el("span", { textContent: text }), control);

export function addStyle() {
  if (!document.getElementById(STYLE_ID)) document.head.append(el("style", { id: STYLE_ID, textContent: CSS }));
}

/** One image large: click, Esc or ✕ closes it; ← and → step through the gallery. */
export class Zoom {
  constructor() {
    this.image = el("img", { alt: "" });
    this.caption = el("span", { kiln: "zoom-name" });
    this.close = el("button", { type: "button", textContent: "✕", "aria-label": "close the enlarged image" });
    this.element = el("div", { className: "kds-zoom", kiln: "zoom", hidden: true, role: "dialog",
      "aria-label": "enlarged image" }, this.image, el("div", { className: "kds-row" }, this.caption, this.close));
    this.element.addEventListener("click", () => this.hide());
    this.items = [];
    this.index = -1;
  }

  get open() { return !this.element.hidden; }

  /** items: [{ src, name }]; shows items[index]. */
  show(items, index) {
    this.items = items;
    this.index = index;
    this.image.src = items[index].src;
    this.image.alt = items[index].name;
    this.caption.textContent = `${items[index].name} — ${index + 1} of ${items.length} (← → for the others, Esc closes)`;
    this.element.hidden = false;
    this.close.focus();
  }

  step(delta) { if (this.items.length) this.show(this.items, zoomStep(this.index, delta, this.items.length)); }

  hide() {
    this.element.hidden = true;
    this.image.removeAttribute("src");
    this.returnFocus?.focus?.();
  }
}

/** The wide window: `content` inside a fixed overlay. `mayClose()` (async → boolean) is asked before it closes;
 * `closed()` is told after. */
export class WideView {
  constructor(content, zoom, mayClose, closed = () => {}) {
    this.zoom = zoom;
    this.mayClose = mayClose;
    this.closed = closed;
    this.element = el("div", { className: "kds-overlay", kiln: "overlay", hidden: true }, content);
    this.element.addEventListener("keydown", (event) => this.key(event));
    // Keys, pastes and drops stay in the editor: ComfyUI would act on the graph (or load a dropped PNG as a workflow).
    for (const type of ["keyup", "keypress", "paste", "copy", "cut"]) this.element.addEventListener(type, (e) => e.stopPropagation());
    for (const type of ["dragover", "drop"]) {
      this.element.addEventListener(type, (event) => { event.preventDefault(); event.stopPropagation(); });
    }
  }

  get open() { return !this.element.hidden; }

  show() {
    if (!this.element.isConnected) document.body.append(this.element);
    this.returnFocus = document.activeElement;
    this.element.hidden = false;
  }

  async close() {
    if (!(await this.mayClose())) return false;
    this.zoom.hide();
    this.element.hidden = true;
    this.returnFocus?.focus?.();
    this.closed();
    return true;
  }

  key(event) {
    event.stopPropagation();
    if (this.zoom.open && (event.key === "ArrowLeft" || event.key === "ArrowRight")) {
      event.preventDefault();
      this.zoom.step(event.key === "ArrowLeft" ? -1 : 1);
    } else if (event.key === "Escape") {
      event.preventDefault();
      if (this.zoom.open) this.zoom.hide();
      else this.close();
    }
  }
}
