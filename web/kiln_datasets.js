// Kiln dataset editor: a "Kiln datasets" sidebar tab beside the dashboard lists the datasets under ComfyUI's
// input/ and opens the editor in a wide window (kiln_datasets_view.js). The editor creates a dataset (name, type,
// trigger word, resolutions → dataset.json), takes images by drag and drop (or a file chooser), shows each image
// on a card (kiln_datasets_card.js) with its caption and its problems, edits captions one by one (saved on Enter or
// when the field loses focus) or in bulk (prefix, suffix, find and replace) and moves images to the dataset's
// .trash/ folder. Switching dataset or closing with an unsaved caption asks first. Every change goes through the
// /kiln/datasets routes of nodes/dataset_editor.py; the logic without a DOM is kiln_datasets_core.js. The quality
// pass's verdicts (GET .../verdicts) load after the gallery, with a filter for the images with problems;
// "Caption selected" (kiln_datasets_caption.js) queues Kiln Caption Images on ComfyUI's queue.
import { app } from "../../scripts/app.js";
import { CaptionRow } from "./kiln_datasets_caption.js";
import { Card } from "./kiln_datasets_card.js";
import {
  TYPES, createBody, datasetPath, hasProblems, keepSelected, problemLines, summary, unsavedQuestion, uploadMessage,
} from "./kiln_datasets_core.js";
import { bulkBar, call, dropZone, filterRow, postJson } from "./kiln_datasets_tools.js";
import { WideView, Zoom, addStyle, el, field } from "./kiln_datasets_view.js";

class DatasetEditor {
  constructor() {
    addStyle();
    this.dataset = null;
    this.verdicts = new Map();         // path → the quality pass's verdict, once loaded
    this.problemsOnly = false;
    this.captionRow = null;            // made once GET /kiln/captioners answers
    this.selected = new Set();
    this.drafts = new Map();           // path → caption text typed and not saved yet
    this.saving = new Map();           // path → the caption save in flight
    this.cards = new Map();            // path → Card
    this.version = String(Date.now());
    this.pick = el("select", { kiln: "pick" });
    this.pick.addEventListener("change", () => this.switchTo(this.pick.value));
    const newButton = el("button", { kiln: "new", textContent: "New dataset…", type: "button" });
    newButton.addEventListener("click", () => { this.form.hidden = !this.form.hidden; });
    const close = el("button", { className: "kds-close", kiln: "close", type: "button", textContent: "✕",
      "aria-label": "close the dataset editor", title: "Close (Esc)" });
    close.addEventListener("click", () => this.view.close());
    this.form = this.createForm();
    this.status = el("div", { className: "kds-status", kiln: "status", role: "status" });
    this.summary = el("span", { kiln: "summary" });
    this.body = el("div", { className: "kds-main", kiln: "body", hidden: true });
    this.empty = el("div", { className: "kds-hint", kiln: "empty", textContent: "Choose a dataset above, or make one with " +
      "New dataset…: its images, captions and problems show here. Load Dataset reads the same folders in input/." });
    this.zoom = new Zoom();
    this.element = el("div", { className: "kiln-datasets kds-wide", role: "dialog", "aria-modal": "true",
      "aria-labelledby": "kds-title" },
    el("div", { className: "kds-head" }, el("h2", { id: "kds-title", textContent: "Kiln datasets" }),
      field("Dataset", this.pick, "kds-inline"), newButton, this.summary, close),
    this.form, this.status, this.empty, this.body, this.zoom.element);
    this.view = new WideView(this.element, this.zoom, () => this.mayClose(), () => refreshLauncher?.());
    this.element.addEventListener("dragover", () => this.element.classList.add("kds-over"));
    this.element.addEventListener("dragleave", (event) => {
      if (!this.element.contains(event.relatedTarget)) this.element.classList.remove("kds-over");
    });
    this.element.addEventListener("drop", (event) => {
      this.element.classList.remove("kds-over");
      const files = [...(event.dataTransfer?.files ?? [])];
      if (files.length && !this.dataset) this.say("choose or create a dataset first, then drop its images", true);
      else this.upload(files);
    });
  }

  createForm() {
    const type = el("select", { name: "type" }, el("option", { value: "", textContent: "(not set)" }),
      ...TYPES.map((t) => el("option", { value: t, textContent: t })));
    const form = el("form", { kiln: "create-form", hidden: true, "aria-label": "new dataset" },
      field("name", el("input", { name: "name", placeholder: "my_character", required: true })),
      field("type", type),
      field("trigger word", el("input", { name: "trigger_word", placeholder: "ohwx" })),
      field("resolutions", el("input", { name: "resolutions", placeholder: "512, 768, 1024" })),
      el("button", { kiln: "create", textContent: "Create", type: "submit" }));
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.run(async () => {
        const body = createBody(Object.fromEntries(new FormData(form)));
        await postJson("/kiln/datasets", body);
        form.reset();
        form.hidden = true;
        await this.refresh();
        await this.switchTo(body.name);
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

  /** Reread the list of datasets and the open one (keeping unsaved captions), or open `name`. */
  async refresh(name = this.dataset?.name) {
    const { datasets } = await call("/kiln/datasets");
    this.pick.replaceChildren(el("option", { value: "", textContent: datasets.length ? "choose…" : "none yet" }),
      ...datasets.map((d) => el("option", { value: d.name, textContent: `${d.name} (${d.detail})` })));
    this.pick.value = this.dataset?.name ?? "";
    if (name && datasets.some((d) => d.name === name)) await this.open(name, name !== this.dataset?.name);
    return datasets;
  }

  /** Open another dataset, asking first when captions are unsaved (the picker goes back on Cancel). */
  async switchTo(name) {
    await this.settle();
    if (name === (this.dataset?.name ?? "")) return true;
    if (!this.mayDiscard(name ? `open ${name}` : "close this dataset")) {
      this.pick.value = this.dataset?.name ?? "";
      return false;
    }
    this.drafts.clear();
    this.say("");                      // the last message was about the dataset left
    await this.open(name, true).catch((error) => this.say(error.message, true));
    return true;
  }

  async open(name, fresh = false) {
    this.pick.value = name;
    this.empty.hidden = Boolean(name);
    if (!name) {
      this.dataset = null;
      this.body.hidden = true;
      this.summary.textContent = "";
      return;
    }
    const dataset = await call(datasetPath(name));
    const same = !fresh && this.dataset?.name === name &&
      dataset.images.map((i) => i.path).join("\n") === this.dataset.images.map((i) => i.path).join("\n");
    this.dataset = dataset;
    // Another dataset starts with nothing selected: its a.png is not the a.png ticked before (Move to .trash).
    this.selected = fresh ? new Set() : keepSelected(this.selected, dataset.images);
    this.drafts = new Map([...this.drafts].filter(([path]) => dataset.images.some((i) => i.path === path)));
    if (fresh) {
      this.version = String(Date.now());
      this.verdicts = new Map();
      if (this.captionRow) this.captionRow.trigger.value = dataset.meta?.trigger_word ?? "";
    }
    if (same) this.showVerdicts();           // captions or problems changed: the cards are updated in place
    else this.render();
    this.loadVerdicts(name);
    this.loadCaptioners();
  }

  /** The quality pass (it decodes new images: seconds on a large dataset), shown on the cards when it answers. */
  async loadVerdicts(name) {
    const ticket = (this.verdictTicket = (this.verdictTicket ?? 0) + 1);
    this.noteVerdicts("checking quality…");
    try {
      const { verdicts } = await call(datasetPath(name, "verdicts"));
      if (this.dataset?.name !== name || ticket !== this.verdictTicket) return;     // a newer pass was asked for
      this.verdicts = new Map(verdicts.map((v) => [v.path, v]));
      this.noteVerdicts(`quality: ${verdicts.filter((v) => !v.ok).length} of ${verdicts.length} usable image(s) with problems`);
      this.showVerdicts();
    } catch (error) {
      if (ticket === this.verdictTicket) this.noteVerdicts(`quality check failed: ${error.message}`);
    }
  }

  noteVerdicts(text) {
    this.verdictNote = text;
    const note = this.body.querySelector("[data-kiln=verdicts-status]");
    if (note) note.textContent = text;
  }

  showVerdicts() {
    const d = this.dataset;
    const meta = [d.meta.type, d.meta.trigger_word && `trigger “${d.meta.trigger_word}”`,
      d.meta.resolutions && `${d.meta.resolutions.join("/")} px`].filter(Boolean).join(" · ");
    this.summary.textContent = `${summary(d)}${meta ? ` — ${meta}` : ""}`;
    for (const image of d.images) {
      const card = this.cards.get(image.path);
      const verdict = this.verdicts.get(image.path);
      card?.update(image, verdict ?? null);
      if (card) card.element.hidden = this.problemsOnly && !hasProblems(image, verdict);
    }
  }

  loadCaptioners() {
    this.captioners ??= call("/kiln/captioners").then((choices) => {
      this.captionRow = new CaptionRow(this, choices);
      if (this.dataset) this.render();
    }, (error) => this.say(`captioning is not available: ${error.message}`, true));
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

  /** Build the tools and the gallery; the caption being typed keeps its focus and cursor. */
  render() {
    const d = this.dataset;
    const active = document.activeElement?.matches?.(".kds-caption") && document.activeElement;
    const focus = active && { path: active.closest(".kds-card").dataset.path, start: active.selectionStart,
      end: active.selectionEnd };
    this.rendering = true;             // a caption field taken out of the page is not a user leaving it
    this.cards = new Map(d.images.map((image) => [image.path, new Card(this, image)]));
    const problems = d.problems.length ? el("fieldset", {}, el("legend", { textContent: "Other files" }),
      el("ul", { kiln: "problems" }, ...d.problems.map((p) =>
        el("li", { textContent: `${p.file || "dataset"}: ${problemLines([p])[0]}`, "data-severity": p.severity }))))
      : null;
    const tools = el("div", { className: "kds-tools", kiln: "tools" }, dropZone(this), filterRow(this), bulkBar(this),
      this.captionRow?.element, problems);
    const gallery = el("div", { className: "kds-gallery", kiln: "gallery" }, ...[...this.cards.values()].map((c) => c.element));
    this.body.hidden = false;
    this.body.replaceChildren(tools, el("div", { className: "kds-pane" }, gallery));
    this.showVerdicts();
    const again = focus && this.cards.get(focus.path)?.caption;
    if (again) {
      again.focus();
      again.setSelectionRange(focus.start, focus.end);
    }
    this.rendering = false;
  }

  select(path, on) {
    if (on) this.selected.add(path);
    else this.selected.delete(path);
    this.count.textContent = `${this.selected.size} selected`;
  }

  /** A caption typed: a draft while it differs from the saved one. Returns whether it is unsaved. */
  edit(path, text) {
    const saved = this.dataset.images.find((image) => image.path === path)?.caption ?? "";
    if (text === saved) this.drafts.delete(path);
    else this.drafts.set(path, text);
    return this.drafts.has(path);
  }

  /** Save a caption's draft (nothing when it has none); the card shows saving…, then clean or why not. A save
   * asked while one of the same caption is in flight runs after it. */
  saveCaption(path) {
    const before = this.saving.get(path);
    if (before) return before.then(() => this.saveCaption(path));
    const text = this.drafts.get(path);
    const name = this.dataset?.name;
    if (text === undefined || !name) return Promise.resolve();
    const card = this.cards.get(path);
    card?.show("saving");
    const job = postJson(datasetPath(name, "caption"), { path, caption: text }).then((answer) => {
      if (this.dataset?.name !== name) return;
      if (this.drafts.get(path) === text) this.drafts.delete(path);
      const image = this.dataset.images.find((i) => i.path === path);
      if (image) image.caption = answer.caption;
      card?.show(this.drafts.has(path) ? "dirty" : "clean");
      this.say(`saved the caption of ${path}`);
      this.refresh().catch((error) => this.say(error.message, true));     // problems and counts follow the caption
    }, (error) => {
      card?.show("error", error.message);
      this.say(`the caption of ${path} is not saved: ${error.message}`, true);
    }).finally(() => {
      if (this.saving.get(path) === job) this.saving.delete(path);
    });
    this.saving.set(path, job);
    return job;
  }

  settle() { return Promise.allSettled([...this.saving.values()]); }

  mayDiscard(action) {
    const question = unsavedQuestion(this.drafts, action);
    return !question || window.confirm(question);
  }

  async mayClose() {
    await this.settle();
    if (!this.mayDiscard("close the editor")) return false;
    this.drafts.clear();
    if (this.dataset) this.showVerdicts();     // the cards show the saved captions again
    return true;
  }

  zoomTo(path, from) {
    const shown = [...this.cards.values()].filter((card) => !card.element.hidden);
    const items = shown.map((card) => ({ src: card.thumb.src, name: card.name.textContent }));
    this.zoom.returnFocus = from;
    this.zoom.show(items, Math.max(0, shown.findIndex((card) => card.image.path === path)));
  }

  async show(name) {
    this.view.show();
    this.pick.focus();
    await this.refresh().catch((error) => this.say(`could not list the datasets: ${error.message}`, true));
    if (name) await this.switchTo(name);
  }
}

let editor = null;
let refreshLauncher = null;            // the sidebar's list, reread when the editor closes (it may have made a dataset)
const openEditor = (name) => {
  editor ??= new DatasetEditor();
  return editor.show(name);
};

/** The sidebar tab: the datasets, each opening the wide editor on it. */
function launcher(container) {
  addStyle();
  const list = el("ul", { className: "kds-list", kiln: "launcher-list" });
  const open = el("button", { type: "button", kiln: "open-editor", textContent: "Open the dataset editor" });
  open.addEventListener("click", () => openEditor());
  const element = el("div", { className: "kiln-datasets kds-launcher", kiln: "launcher" },
    el("b", { textContent: "Kiln datasets" }),
    el("span", { className: "kds-hint", textContent: "Images, captions and problems of the datasets in ComfyUI's input/." }),
    open, list);
  container.replaceChildren(element);
  refreshLauncher = () => call("/kiln/datasets").then(({ datasets }) => list.replaceChildren(...datasets.map((d) => {
    const button = el("button", { type: "button", textContent: `${d.name} (${d.detail})`, title: `open ${d.name} in the editor` });
    button.addEventListener("click", () => openEditor(d.name));
    return el("li", {}, button);
  })), (error) => list.replaceChildren(el("li", { textContent: `could not list the datasets: ${error.message}` })));
  refreshLauncher();
}

app.registerExtension({
  name: "kiln.datasets",
  commands: [{ id: "Kiln.OpenDatasetEditor", label: "Kiln: open the dataset editor", icon: "pi pi-images",
    function: () => openEditor() }],
  async setup() {
    app.extensionManager?.registerSidebarTab?.({
      id: "kiln-datasets",
      icon: "pi pi-images",
      title: "Kiln datasets",
      tooltip: "Kiln dataset editor: images, captions and problems of the datasets in input/",
      type: "custom",
      render: launcher,
      destroy: () => {},
    });
  },
});
