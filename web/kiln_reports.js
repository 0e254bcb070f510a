// Kiln nodes' reports on the nodes: a ComfyUI frontend extension. Load Dataset's check and bucket plan, the
// encode summaries, Train LoRA's summary, Save LoRA's "saved …safetensors", Convert LoRA's report come back as
// ui.PreviewText (the executed message's `text`), which ComfyUI's frontends (1.41, 1.49) draw only on their
// own Preview Any and Save Text nodes. Here each Kiln node gets a read-only box with its newest report
// (monospace, wrapping, scrolling when long, selectable), as Preview Any shows text.
//
// The box is a DOM widget that is never serialized (saved workflows are positional; it is added after the
// node's own widgets). A report is drawn only on the node of the workflow tab that queued the prompt (node ids
// repeat across tabs), and kept per tab for the session: a tab switch or a page reload draws it again.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { Reports, isKilnNodeType, reportHeight, reportText } from "./kiln_reports_core.js";
import { activeWorkflowKey, onQueueChange, queued } from "./kiln_queue.js";

const WIDGET = "kiln_report";
const STORAGE_KEY = "kiln.reports";
const STYLE_ID = "kiln-report-style";
const CHAR_WIDTH = 6.7; // px of one character at the box's 11 px monospace, for wrapping estimates
const CSS = `
.kiln-report { box-sizing: border-box; width: 100%; height: 100%; margin: 0; padding: 5px 7px; resize: none;
  font: 11px/15px ui-monospace, SFMono-Regular, Menlo, Consolas, "Liberation Mono", monospace;
  color: var(--input-text, #ddd); background: var(--comfy-input-bg, #222);
  border: 1px solid var(--border-color, #3a3a3a);
  border-radius: 6px; white-space: pre-wrap; overflow-wrap: anywhere; overflow-y: auto; user-select: text; }
.kiln-report:focus { outline: 1px solid var(--border-color, #555); }
`;

function storage() {
  try {
    return window.sessionStorage;
  } catch {
    return null;
  }
}

const reports = Reports.parse(storage()?.getItem(STORAGE_KEY));
const early = []; // executed messages that came before queuePrompt's answer named their prompt

function save() {
  try {
    storage()?.setItem(STORAGE_KEY, JSON.stringify(reports));
  } catch {
    // full or blocked storage: reports still last as long as the page
  }
}

function installStyle() {
  if (document.getElementById(STYLE_ID)) return;
  const style = document.createElement("style");
  style.id = STYLE_ID;
  style.textContent = CSS;
  document.head.appendChild(style);
}

const graph = () => app.rootGraph ?? app.graph;
const isKiln = (node) => isKilnNodeType(node?.comfyClass ?? node?.type);
const widgetOf = (node) => node.widgets?.find((widget) => widget.name === WIDGET);

function addBox(node) {
  installStyle();
  const box = document.createElement("textarea");
  box.className = "kiln-report";
  box.readOnly = true;
  box.spellcheck = false;
  box.dataset.kiln = "report";
  box.title = "This node's report from its last run (select to copy)";
  const widget = node.addDOMWidget(WIDGET, "kiln-report", box, {
    serialize: false,
    hideOnZoom: false,
    getValue: () => "",
    setValue: () => {},
    getMinHeight: () => slotHeight(widget),
    getMaxHeight: () => slotHeight(widget), // its own height: spare room stays with the node's other widgets
  });
  widget.serialize = false; // not a widget value: keeps widgets_values and the API prompt as they were
  return widget;
}

/** A DOM widget's element is its slot less a margin above and below (both frontends: 10 px each). */
const slotHeight = (widget) => (widget.boxHeight ?? 30) + 2 * (widget.margin ?? 10);

/** The node's box shows `text`. A new box: the node grows to hold it (a node restored with a tab has its room
 * already); a box with a new report: the node grows or shrinks by the difference. */
function show(node, text) {
  const existing = widgetOf(node);
  const widget = existing ?? addBox(node);
  const before = slotHeight(widget);
  widget.element.value = text;
  widget.boxHeight = reportHeight(text, { columns: (node.size[0] - 30) / CHAR_WIDTH });
  const [width, height] = node.computeSize();
  const wanted = existing ? node.size[1] + slotHeight(widget) - before : node.size[1];
  node.setSize([Math.max(node.size[0], width), Math.max(wanted, height)]);
  node.setDirtyCanvas?.(true, true);
}

/** The node without a box (a tab whose prompt left no report on it); the node gives the box's room back. */
function hide(node) {
  const widget = widgetOf(node);
  if (!widget) return;
  node.removeWidget?.(widget);
  node.setSize([node.size[0], Math.max(node.computeSize()[1], node.size[1] - slotHeight(widget))]);
  node.setDirtyCanvas?.(true, true);
}

/** Every Kiln node on the canvas shows the report its tab kept for it, or none. */
function sync() {
  const key = activeWorkflowKey();
  for (const node of graph()?.nodes ?? []) {
    if (!isKiln(node)) continue;
    const text = reports.get(key, node.id);
    if (text === undefined) hide(node);
    else if (widgetOf(node)?.element.value !== text) show(node, text);
  }
}

let syncing = false;
function scheduleSync() {
  if (syncing) return;
  syncing = true;
  requestAnimationFrame(() => {
    syncing = false;
    sync();
  });
}

function place(detail, text) {
  const key = queued.workflowOf(detail.prompt_id);
  const nodeId = String(detail.display_node ?? detail.node);
  reports.set(key, nodeId, text);
  save();
  if (key !== activeWorkflowKey()) return; // the node of this id on the canvas belongs to another tab
  const node = graph()?.getNodeById(nodeId); // ids inside subgraphs ("5:3") find none: their reports are kept only
  if (isKiln(node)) show(node, text);
}

function onExecuted({ detail }) {
  const text = reportText(detail?.output);
  if (text === null || typeof detail.prompt_id !== "string") return;
  if (queued.has(detail.prompt_id)) {
    place(detail, text);
    return;
  }
  // a prompt this page has not queued (yet: a fast node can report before the queue's answer arrives)
  early.push([detail, text]);
  early.splice(0, Math.max(0, early.length - 64));
}

onQueueChange((event) => {
  if (event.type === "queued") {
    for (const [detail, text] of early.filter(([d]) => d.prompt_id === event.promptId)) place(detail, text);
    early.splice(0, early.length, ...early.filter(([d]) => d.prompt_id !== event.promptId));
    return;
  }
  if (event.type === "renamed") reports.rename(event.from, event.to);
  if (event.type === "closed") reports.forget(event.key);
  save();
  scheduleSync();
});

app.registerExtension({
  name: "kiln.reports",
  setup() {
    api.addEventListener("executed", onExecuted);
  },
  nodeCreated(node) {
    if (isKiln(node)) scheduleSync(); // a tab's nodes are made anew on every switch to it, and on reload
  },
});
