// One image of the dataset editor's gallery (web/kiln_datasets.js): its thumbnail (click to enlarge), a label with
// the select box, its verdict's size and buckets, its problems (the scan's and the quality pass's, each once), and
// its caption. A caption saves on Enter or when the field loses focus (Shift+Enter is a new line); until then the
// card says "unsaved" and the editor keeps the text as a draft (editor.edit / editor.saveCaption), so a reload of
// the gallery never drops it.
import { api } from "../../scripts/api.js";
import { cardLabel, captionKey, cardProblems, problemLines, shownFile, verdictHead, viewQuery, worst } from "./kiln_datasets_core.js";
import { el } from "./kiln_datasets_view.js";

const STATE_TEXT = { clean: "", dirty: "● unsaved (Enter or leave the field to save)", saving: "saving…", error: "not saved: " };

export class Card {
  /** editor: { dataset, selected, drafts, version, select(path, on), edit(path, text), saveCaption(path), zoomTo(path) }. */
  constructor(editor, image) {
    const path = image.path;
    this.editor = editor;
    this.check = el("input", { type: "checkbox", className: "kds-select", checked: editor.selected.has(path) });
    this.check.addEventListener("change", () => editor.select(path, this.check.checked));
    const shown = viewQuery(editor.dataset.name, shownFile(image), editor.version);
    this.thumb = el("img", { src: api.apiURL(shown), alt: path, loading: "lazy" });
    const zoom = el("button", { type: "button", className: "kds-thumb", "aria-label": `enlarge ${path}`,
      title: "Click to enlarge (Esc closes)" }, this.thumb);
    zoom.addEventListener("click", () => editor.zoomTo(path, zoom));
    this.name = el("span", { className: "kds-name" });
    this.problems = el("ul", { className: "kds-problems" });
    this.verdict = el("div", { className: "kds-verdict", hidden: true });
    this.caption = el("textarea", { className: "kds-caption", "aria-label": `caption of ${path}`,
      placeholder: "caption — Enter saves, Shift+Enter for a new line" });
    this.caption.addEventListener("input", () => this.show(editor.edit(path, this.caption.value) ? "dirty" : "clean"));
    this.caption.addEventListener("keydown", (event) => {
      if (captionKey(event) !== "save") return;
      event.preventDefault();
      editor.saveCaption(path);
    });
    // Why blur saves: a user who clicks away from a caption expects it kept (ai-toolkit's dataset page does too).
    this.caption.addEventListener("blur", () => { if (!editor.rendering) editor.saveCaption(path); });
    this.state = el("span", { className: "kds-state", kiln: "caption-state", "aria-live": "polite" });
    this.save = el("button", { className: "kds-save", type: "button", textContent: "Save", hidden: true,
      "aria-label": `save the caption of ${path}` });
    this.save.addEventListener("click", () => editor.saveCaption(path));
    this.element = el("div", { className: "kds-card", "data-path": path }, zoom,
      el("label", { className: "kds-row" }, this.check, this.name), this.verdict, this.problems, this.caption,
      el("div", { className: "kds-row" }, this.state, this.save));
    this.update(image, null);
  }

  /** Show the image's scan and verdict; its caption too unless a draft of it is unsaved. */
  update(image, verdict) {
    this.image = image;
    const problems = cardProblems(image, verdict);
    this.element.dataset.severity = worst(problems);
    this.name.textContent = cardLabel(image);
    this.problems.replaceChildren(...problems.map((p) =>
      el("li", { textContent: problemLines([p])[0], "data-severity": p.severity, "data-code": p.code })));
    this.problems.hidden = !problems.length;
    this.verdict.hidden = !verdict;
    if (verdict) {
      this.verdict.textContent = verdictHead(verdict);
      this.verdict.dataset.ok = String(verdict.ok);
      this.verdict.dataset.codes = verdict.problems.join(" ");
    }
    const draft = this.editor.drafts.get(image.path);
    if (this.caption.value !== (draft ?? image.caption)) this.caption.value = draft ?? image.caption;
    const state = this.element.dataset.state;
    if (state === "saving") return;
    if (draft === undefined) this.show("clean");
    else if (state !== "error") this.show("dirty");       // a refused save keeps saying why until it is typed again
  }

  /** clean | dirty | saving | error (with the server's reason). */
  show(state, reason = "") {
    this.element.dataset.state = state;
    this.state.textContent = STATE_TEXT[state] + reason;
    this.save.hidden = state !== "dirty" && state !== "error";
  }
}
