// Kiln live dashboard: a ComfyUI frontend extension. It shows a training run while it runs, on each
// Kiln Train LoRA node (a DOM widget) and in a "Kiln" sidebar tab: loss (raw and smoothed), learning
// rate, step of total, speed, ETA, peak memory, the newest validation samples, the bucket
// distribution, and the buttons Stop (checkpoint, then the node returns and the nodes after it are skipped),
// Stop & save (the same, and its LoRA goes on to Save LoRA) and Save now (a LoRA of the current weights into
// models/loras/kiln/, training goes on; also while paused).
//
// Fed by the kiln.progress / kiln.sample / kiln.run events of nodes/live.py; after a page reload, or
// in a second tab, it asks the pack's read-only routes (GET /kiln/runs, GET /kiln/runs/{id}).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { RunStore } from "./kiln_dashboard_core.js";
import { DashboardView } from "./kiln_dashboard_view.js";

const NODE_TYPE = "KilnTrainLoRA";
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
}

function addNodeDashboard(node) {
  const view = new DashboardView(store, {
    pick: () => store.forNode(node.id),
    actions,
    idleText: "Queue the workflow: loss, samples, buckets and Stop / Save now appear here while this node trains.",
  });
  const widget = node.addDOMWidget("kiln_dashboard", "kiln-dashboard", view.element, {
    serialize: false,
    hideOnZoom: false,
    getValue: () => "",
    setValue: () => {},
    getMinHeight: () => 540,
  });
  widget.serialize = false; // not a widget value: keeps widgets_values and the API prompt as they were
  const removed = node.onRemoved;
  node.onRemoved = function () {
    view.dispose();
    return removed?.apply(this, arguments);
  };
  requestAnimationFrame(() => {
    const [width, height] = node.computeSize();
    node.setSize([Math.max(node.size[0], width, 400), Math.max(node.size[1], height)]);
    node.setDirtyCanvas?.(true, true);
  });
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
