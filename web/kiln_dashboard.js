// Kiln live dashboard: a ComfyUI frontend extension. It shows a training run while it runs, on each
// Kiln Train LoRA node (a DOM widget) and in a "Kiln" sidebar tab: loss (raw and smoothed), learning
// rate, step of total, speed, ETA, peak memory, the newest validation samples, the bucket
// distribution, and the buttons Stop (checkpoint, then the node returns and the nodes after it are skipped),
// Stop & save (the same, and its LoRA goes on to Save LoRA) and Save now (a LoRA of the current weights into
// models/loras/kiln/, training goes on; also while paused).
//
// Fed by the kiln.progress / kiln.sample / kiln.run events of nodes/live.py; after a page reload, or
// in a second tab, it asks the pack's read-only routes (GET /kiln/runs, GET /kiln/runs/{id}).
// The node shows the runs its own workflow tab queued (kiln_queue.js), else one idle line; the sidebar
// lists every run.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { RunStore } from "./kiln_dashboard_core.js";
import { DashboardView } from "./kiln_dashboard_view.js";
import { onQueueChange, promptsOfActiveWorkflow } from "./kiln_queue.js";

const NODE_TYPE = "KilnTrainLoRA";
const RUN_HEIGHT = 500; // the dashboard's room while it shows a run: header, chart, figures, samples (the rest scrolls)
const IDLE_HEIGHT = 48; // idle: one line (the widget's slot; its element is 2 × 10 px smaller)
const store = new RunStore();
const fetching = new Set();
let sidebarView = null;

async function getJson(path) {
  const response = await api.fetchApi(path, { cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

async function loadRun(id) {
  if (fetching.has(id)) return;
  fetching.add(id);
  try {
    store.applySnapshot(await getJson(`/kiln/runs/${encodeURIComponent(id)}`));
  } catch (error) {
    console.warn("[Kiln] could not load run", id, error);
  } finally {
    fetching.delete(id);
  }
}

/** Every run the server remembers: summaries, then the whole history of the newest few. */
async function loadRuns() {
  try {
    const { runs } = await getJson("/kiln/runs");
    for (const summary of runs) store.applySummary(summary);
    await Promise.all(runs.slice(0, 4).map((run) => loadRun(run.id)));
  } catch (error) {
    console.warn("[Kiln] could not list training runs", error);
  }
}

async function post(run, action) {
  const response = await api.fetchApi(`/kiln/runs/${encodeURIComponent(run.id)}/${action}`, { method: "POST" });
  const answer = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(answer.error ?? `HTTP ${response.status}`);
  if (answer.run) store.applySummary(answer.run);
  return { stop: "stopping after this step…", stop_save: "stopping after this step, then saving…",
    save: run.paused ? "saving now…" : "saving at the next step…", pause: "paused after this step (memory kept)…",
    resume: "resumed" }[action];
}

const actions = {
  stop: (run) => post(run, "stop"),
  stop_save: (run) => post(run, "stop_save"),
  save: (run) => post(run, "save"),
  pause: (run) => post(run, "pause"),
  resume: (run) => post(run, "resume"),
  imageUrl: (query) => api.apiURL(query),
};

function toast(severity, detail) {
  try {
    app.extensionManager?.toast?.add?.({ severity, summary: "Kiln", detail, life: 5000 });
  } catch {
    // an older frontend without toasts: the dashboard's note says the same
  }
}

function listen() {
  api.addEventListener("kiln.progress", ({ detail }) => {
    const run = store.applyProgress(detail);
    if (run && !run.hasDetail) loadRun(run.id);
  });
  api.addEventListener("kiln.sample", ({ detail }) => store.applySample(detail));
  api.addEventListener("kiln.grid", ({ detail }) => store.applyGrid(detail));
  api.addEventListener("kiln.run", ({ detail }) => {
    const before = store.get(detail.id);
    const savedBefore = before?.saved?.length ?? 0;
    const run = store.applySummary(detail);
    if ((run.saved?.length ?? 0) > savedBefore) toast("success", `saved ${run.saved.at(-1).name}`);
    if (!before) loadRun(run.id);
  });
  api.addEventListener("reconnected", () => loadRuns());
  onQueueChange(() => store.changed(null)); // a prompt queued here, or another tab on the canvas: views pick anew
}

/** The node fits the dashboard: grown to hold a run it shows, shrunk to its widgets and one line when idle. */
function fitNode(node, showing) {
  const [width, height] = node.computeSize();
  node.setSize([Math.max(node.size[0], width, 400), showing ? Math.max(node.size[1], height) : height]);
  node.setDirtyCanvas?.(true, true);
}

/** ComfyUI draws a node's progress previews (the validation samples Train LoRA sends with its progress bar)
 * under its widgets; the dashboard shows them already. The canvas draws them from the node's
 * onDrawBackground, Vue nodes skip a node with hideOutputImages (both frontends). */
function keepComfyPreviewsOff(node) {
  node.hideOutputImages = true;
  node.onDrawBackground = function () {};
}

function addNodeDashboard(node) {
  const view = new DashboardView(store, {
    pick: () => store.forWorkflow(promptsOfActiveWorkflow(), node.id),
    actions,
    idleText: "Kiln dashboard: queue the workflow to watch this node train",
    onShape: (showing) => fitNode(node, showing),
  });
  const widget = node.addDOMWidget("kiln_dashboard", "kiln-dashboard", view.element, {
    serialize: false,
    hideOnZoom: false,
    getValue: () => "",
    setValue: () => {},
    getMinHeight: () => (view.showing ? RUN_HEIGHT : IDLE_HEIGHT),
    getMaxHeight: () => (view.showing ? undefined : IDLE_HEIGHT),
  });
  widget.serialize = false; // not a widget value: keeps widgets_values and the API prompt as they were
  keepComfyPreviewsOff(node);
  const removed = node.onRemoved;
  node.onRemoved = function () {
    view.dispose();
    return removed?.apply(this, arguments);
  };
}

app.registerExtension({
  name: "kiln.dashboard",
  async setup() {
    listen();
    app.extensionManager?.registerSidebarTab?.({
      id: "kiln-dashboard",
      icon: "pi pi-chart-line",
      title: "Kiln",
      tooltip: "Kiln training dashboard",
      type: "custom",
      render: (container) => {
        sidebarView?.dispose();
        sidebarView = new DashboardView(store, {
          pick: () => store.current(),
          actions,
          panel: true,
          idleText: "No training run yet. Queue a workflow with Kiln Train LoRA to see it here.",
        });
        container.replaceChildren(sidebarView.element);
      },
      destroy: () => {
        sidebarView?.dispose();
        sidebarView = null;
      },
    });
    await loadRuns();
  },
  nodeCreated(node) {
    if (node.comfyClass === NODE_TYPE) addNodeDashboard(node);
  },
});
