// Kiln live dashboard: the logic, as a pure ES module (no DOM, no ComfyUI imports), so that
// `node --test tests/web/` checks it. kiln_dashboard_view.js draws what this computes;
// kiln_dashboard.js wires it to ComfyUI's events and to the pack's /kiln/runs routes.
//
// Runs arrive three ways and are merged by run id:
//   kiln.progress (every step)   figures of the step, a loss reading on logged steps
//   kiln.sample / kiln.run       a validation sample; a status change (started, saved, stopped, ...)
//   kiln.grid                    the run's sample grid (prompts × steps), newest
//   GET /kiln/runs/{id}          the whole run so far (after a page reload, or from a second tab)

export const SMOOTHING = 0.9; // as trainer/run/plot.py's smoothed(): bias-corrected EMA

const finite = (value) => typeof value === "number" && Number.isFinite(value);

/** Bias-corrected exponential moving average at every point; gaps (null, NaN) stay gaps. */
export function smooth(values, factor = SMOOTHING) {
  let average = 0;
  let weight = 0;
  return values.map((value) => {
    if (!finite(value)) return null;
    average = factor * average + (1 - factor) * value;
    weight = factor * weight + (1 - factor);
    return average / weight;
  });
}

/** Seconds left at `itPerS` steps per second; null while the rate is unknown. */
export function eta(step, total, itPerS) {
  if (!finite(itPerS) || itPerS <= 0 || !finite(step) || !finite(total)) return null;
  return Math.max(0, total - step) / itPerS;
}

export function formatDuration(seconds) {
  if (!finite(seconds) || seconds < 0) return "—";
  const s = Math.round(seconds);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${String(s % 60).padStart(2, "0")}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export function formatBytes(bytes) {
  if (!finite(bytes) || bytes <= 0) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value >= 100 || unit === 0 ? Math.round(value) : value.toFixed(1)} ${units[unit]}`;
}

/** Steps per second, as it/s when fast and s/it when slower than one step a second. */
export function formatRate(itPerS) {
  if (!finite(itPerS) || itPerS <= 0) return "—";
  return itPerS >= 1 ? `${itPerS.toFixed(2)} it/s` : `${(1 / itPerS).toFixed(2)} s/it`;
}

export function formatLoss(value) {
  return finite(value) ? value.toPrecision(4) : "—";
}

export function formatLr(value) {
  return finite(value) ? value.toExponential(1) : "—";
}

export function formatCount(value) {
  return finite(value) ? Math.round(value).toLocaleString("en-US") : "—";
}

/** The query part of ComfyUI's /view URL for a sample ({filename, subfolder, type}). */
export function viewQuery(image) {
  const params = new URLSearchParams({ filename: image.filename, subfolder: image.subfolder ?? "", type: image.type ?? "temp" });
  return `/view?${params.toString()}`;
}

/** Buckets as bars, most entries first: [{key, count, fraction}] where fraction is of the largest. */
export function bucketBars(buckets) {
  const entries = Object.entries(buckets ?? {}).filter(([, count]) => finite(count) && count > 0);
  const largest = Math.max(1, ...entries.map(([, count]) => count));
  const total = entries.reduce((sum, [, count]) => sum + count, 0);
  return entries
    .sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]))
    .map(([key, count]) => ({ key, count, fraction: count / largest, share: count / total }));
}

/** The value below which `q` of the sorted values lie (linear interpolation). */
export function quantile(values, q) {
  const sorted = values.filter(finite).sort((a, b) => a - b);
  if (!sorted.length) return null;
  const at = (sorted.length - 1) * q;
  const low = Math.floor(at);
  const high = Math.min(sorted.length - 1, low + 1);
  return sorted[low] + (sorted[high] - sorted[low]) * (at - low);
}

/** Round numbers for an axis from lo to hi, about `count` of them. */
export function ticks(lo, hi, count = 4) {
  if (!finite(lo) || !finite(hi) || hi <= lo) return finite(lo) ? [lo] : [];
  const raw = (hi - lo) / count;
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * magnitude).find((s) => s >= raw);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

function path(points) {
  let d = "";
  let pen = false;
  for (const point of points) {
    if (point === null) {
      pen = false;
      continue;
    }
    d += `${pen ? "L" : "M"}${point[0].toFixed(1)},${point[1].toFixed(1)}`;
    pen = true;
  }
  return d;
}

/**
 * The loss chart of a run in a box of width × height pixels: SVG path strings for the raw loss, the
 * smoothed loss, the held-out loss (on the loss scale) and the learning rate (on its own scale, 0 at the
 * bottom), and the axis ticks.
 * The loss scale ends at the 98th percentile of the raw loss (or the smoothed maximum, if higher),
 * so one spike cannot flatten the curve; points above it are drawn at the top edge.
 */
export function chartGeometry(run, width, height, pad = { left: 44, right: 10, top: 8, bottom: 20 }) {
  const steps = run?.steps ?? [];
  const loss = run?.loss ?? [];
  const smoothed = smooth(loss);
  const right = width - pad.right;
  const bottom = height - pad.bottom;
  // x spans the steps seen so far (the progress bar shows the way to the total)
  const seen = [steps[0], steps.at(-1), run?.lrSteps?.[0], run?.lrSteps?.at(-1)].filter(finite);
  const first = seen.length ? Math.min(...seen) : 0;
  const last = Math.max(first + 1, ...seen);
  const x = (step) => pad.left + ((right - pad.left) * (step - first)) / (last - first);
  const held = run?.holdout ?? [];
  const values = loss.filter(finite);
  const heldValues = held.filter(finite);
  const empty = values.length === 0;
  let lo = empty ? 0 : Math.min(...values);
  let hi = empty ? 1 : Math.max(quantile(values, 0.98), ...smoothed.filter(finite), ...heldValues);
  if (!empty) lo = Math.min(lo, ...heldValues);
  if (hi - lo < 1e-12) {
    lo -= 0.5 * (Math.abs(lo) || 1);
    hi += 0.5 * (Math.abs(hi) || 1);
  }
  const margin = (hi - lo) * 0.05;
  lo -= margin;
  hi += margin;
  const y = (value) => bottom - ((bottom - pad.top) * (Math.min(value, hi) - lo)) / (hi - lo);
  const points = (series) => series.map((value, i) => (finite(value) ? [x(steps[i]), y(value)] : null));
  const lrValues = (run?.lr ?? []).filter(finite);
  const lrMax = Math.max(0, ...lrValues) || 1;
  const lrPoints = (run?.lr ?? []).map((value, i) =>
    finite(value) ? [x(run.lrSteps[i]), bottom - ((bottom - pad.top) * value) / lrMax] : null);
  return {
    width, height, pad, empty,
    raw: path(points(loss)),
    smooth: path(points(smoothed)),
    lr: path(lrPoints),
    holdout: path(held.map((value, i) => (finite(value) ? [x(run.holdoutSteps[i]), y(value)] : null))),
    lrMax: lrValues.length ? lrMax : null,
    yTicks: empty ? [] : ticks(lo, hi, 4).map((v) => ({ y: y(v), label: Number(v.toPrecision(3)).toString() })),
    xTicks: ticks(first, last, 4).filter((s) => Number.isInteger(s)).map((s) => ({ x: x(s), label: formatCount(s) })),
  };
}

function emptyRun(id) {
  return {
    id, name: "", node: null, promptId: null, status: "running", message: "", step: 0, total: 0, started: 0,
    updated: 0, figures: {}, steps: [], loss: [], lrSteps: [], lr: [], samples: [], buckets: {}, saved: [], plan: [],
    stopRequested: false, saveRequested: false, hasDetail: false,
    pauseRequested: false, holdoutSteps: [], holdout: [], grid: null,
    paused: false, canSave: true, rev: null,
  };
}

function applySummaryFields(run, summary) {
  // A summary older than one applied (an action's HTTP answer that arrives after the kiln.run event of what
  // the run did next) would bring back a flag the run already cleared: only its step counts.
  if (finite(summary.step)) run.step = Math.max(run.step, summary.step);
  if (finite(summary.rev)) {
    if (finite(run.rev) && summary.rev < run.rev) return;
    run.rev = summary.rev;
  }
  const fields = { name: "name", node: "node", prompt_id: "promptId", status: "status", message: "message",
    total: "total", started: "started", updated: "updated", stop_requested: "stopRequested",
    save_requested: "saveRequested", arch: "arch", start_step: "startStep", pause_requested: "pauseRequested",
    paused: "paused", can_save: "canSave", plan: "plan" };
  for (const [key, name] of Object.entries(fields)) if (summary[key] !== undefined) run[name] = summary[key];
  if (Array.isArray(summary.saved)) run.saved = summary.saved;
}

/** Every run this page knows, merged from events and snapshots; views subscribe to changes. */
export class RunStore {
  constructor() {
    this.runs = new Map();
    this.listeners = new Set();
  }

  subscribe(listener) {
    this.listeners.add(listener);
    return () => this.listeners.delete(listener);
  }

  changed(run) {
    for (const listener of this.listeners) listener(run);
  }

  ensure(id) {
    if (!this.runs.has(id)) this.runs.set(id, emptyRun(id));
    return this.runs.get(id);
  }

  get(id) {
    return this.runs.get(id) ?? null;
  }

  /** A kiln.progress payload. Returns the run; run.hasDetail is false for one first seen mid-way. */
  applyProgress(p) {
    const id = p.run_id;
    if (!id) return null; // an older pack's event: nothing to merge it with
    const isNew = !this.runs.has(id);
    const run = this.ensure(id);
    applySummaryFields(run, { name: p.run, node: p.node, prompt_id: p.prompt_id, status: p.status, total: p.total,
      started: p.started, step: p.step });
    run.hasDetail ||= isNew && p.step <= 1; // seen from its first step: nothing was missed
    if (!(p.step <= (run.lrSteps.at(-1) ?? -Infinity))) {
      run.lrSteps.push(p.step);
      run.lr.push(p.lr);
      if (p.loss !== null && p.loss !== undefined) {
        run.steps.push(p.step);
        run.loss.push(finite(p.loss) ? p.loss : null);
      }
      if (finite(p.holdout_loss)) {
        run.holdoutSteps.push(p.step);
        run.holdout.push(p.holdout_loss);
      }
    }
    const keep = run.figures.loss;
    run.figures = { lr: p.lr, loss: p.loss ?? keep, loss_smooth: p.loss_smooth ?? run.figures.loss_smooth,
      it_per_s: p.it_per_s, eta_s: p.eta_s, peak_memory_bytes: p.peak_memory_bytes,
      peak_memory_per_gpu: p.peak_memory_per_gpu ?? [], holdout_loss: run.holdout.at(-1) ?? null };
    run.updated = Date.now() / 1000;
    this.changed(run);
    return run;
  }

  applySample(s) {
    if (!s.run_id) return null;
    const run = this.ensure(s.run_id);
    if (!run.samples.some((known) => known.image.filename === s.image.filename)) {
      run.samples = [...run.samples, { step: s.step, image: s.image }].slice(-12);
    }
    this.changed(run);
    return run;
  }

  /** A kiln.grid event: the run's sample grid (prompts × steps), rewritten at each sampling step. */
  applyGrid(g) {
    if (!g.run_id) return null;
    const run = this.ensure(g.run_id);
    if (!(run.grid && run.grid.step > g.step)) run.grid = { step: g.step, image: g.image };
    this.changed(run);
    return run;
  }

  /** A kiln.run event or an entry of GET /kiln/runs. */
  applySummary(summary) {
    const run = this.ensure(summary.id);
    applySummaryFields(run, summary);
    if (run.status !== "running") run.stopRequested = run.saveRequested = run.pauseRequested = run.paused = false;
    this.changed(run);
    return run;
  }

  /** GET /kiln/runs/{id}: its history, then the steps this page saw after the snapshot was taken. */
  applySnapshot(detail) {
    const run = this.ensure(detail.id);
    applySummaryFields(run, detail);
    const h = detail.history ?? { step: [], loss: [], lr_step: [], lr: [] };
    const lastLoss = h.step.at(-1) ?? -Infinity;
    const lastLr = h.lr_step.at(-1) ?? -Infinity;
    const laterLoss = run.steps.map((s, i) => [s, run.loss[i]]).filter(([s]) => s > lastLoss);
    const laterLr = run.lrSteps.map((s, i) => [s, run.lr[i]]).filter(([s]) => s > lastLr);
    run.steps = [...h.step, ...laterLoss.map(([s]) => s)];
    run.loss = [...h.loss, ...laterLoss.map(([, v]) => v)];
    run.lrSteps = [...h.lr_step, ...laterLr.map(([s]) => s)];
    run.lr = [...h.lr, ...laterLr.map(([, v]) => v)];
    const lastHeld = h.holdout_step?.at(-1) ?? -Infinity;
    const laterHeld = run.holdoutSteps.map((s, i) => [s, run.holdout[i]]).filter(([s]) => s > lastHeld);
    run.holdoutSteps = [...(h.holdout_step ?? []), ...laterHeld.map(([s]) => s)];
    run.holdout = [...(h.holdout ?? []), ...laterHeld.map(([, v]) => v)];
    if (detail.grid && !(run.grid && run.grid.step > detail.grid.step)) run.grid = detail.grid;
    if (!laterLr.length && detail.figures) run.figures = { ...detail.figures };
    run.buckets = detail.buckets ?? run.buckets;
    const known = new Set((detail.samples ?? []).map((s) => s.image.filename));
    run.samples = [...(detail.samples ?? []), ...run.samples.filter((s) => !known.has(s.image.filename))].slice(-12);
    run.hasDetail = true;
    this.changed(run);
    return run;
  }

  list() {
    return [...this.runs.values()].sort((a, b) => (b.started || 0) - (a.started || 0));
  }

  /** What the sidebar shows unless the user picked a run: the newest running run, else the newest. */
  current() {
    const runs = this.list();
    return runs.find((run) => run.status === "running") ?? runs[0] ?? null;
  }

  /** The newest run of a Train LoRA node (its id in the prompt) among the prompts its workflow tab queued. */
  forWorkflow(promptIds, nodeId) {
    return this.list().find((run) => run.node !== null && String(run.node) === String(nodeId) &&
      promptIds.has(run.promptId)) ?? null;
  }
}

/** Peak memory: the one device's, or under torchrun each GPU's in rank order (the ranks' vote carries them). */
export function memoryFigure(f) {
  const perGpu = (f.peak_memory_per_gpu ?? []).filter(finite);
  if (perGpu.length > 1) {
    return { key: "memory", label: `peak memory, ${perGpu.length} GPUs`, value: perGpu.map(formatBytes).join(" · "),
      hint: "each GPU's peak accelerator memory, GPU 0 first (rank order; a step behind the step shown)" };
  }
  return { key: "memory", label: "peak memory", value: formatBytes(f.peak_memory_bytes), hint: "peak accelerator memory (CPU: none)" };
}

/** The figures a view prints for a run: label, value text, and a hint (title). */
export function figures(run) {
  const f = run?.figures ?? {};
  const left = eta(run?.step, run?.total, f.it_per_s) ?? f.eta_s;
  return [
    { key: "loss", label: "loss", value: formatLoss(f.loss), hint: "loss of the newest logged step" },
    { key: "smooth", label: "smoothed", value: formatLoss(f.loss_smooth), hint: "bias-corrected EMA of the loss (0.9)" },
    { key: "lr", label: "learning rate", value: formatLr(f.lr), hint: "learning rate of the newest step" },
    { key: "rate", label: "speed", value: formatRate(f.it_per_s), hint: "optimizer steps per second since the start" },
    { key: "eta", label: run?.status === "running" ? "ETA" : "left", value: run?.status === "running" ? formatDuration(left) : "—",
      hint: "time to the last step at the current speed" },
    memoryFigure(f),
    ...(run?.holdout?.length ? [{ key: "holdout", label: "held-out loss", value: formatLoss(run.holdout.at(-1)),
      hint: "loss on the images kept out of training, at fixed noise (lower is better; compares between steps)" }] : []),
  ];
}

/** The status a view prints: a running run whose loop waits reads "paused" (the server relays it, also from a
 * torchrun child); asked to pause but still stepping, "pausing…"; asked to go on but still waiting, "resuming…". */
export function statusText(run) {
  if (!run) return "idle";
  if (run.status === "running" && (run.paused || run.pauseRequested)) {
    if (run.paused) return run.pauseRequested ? "paused" : "resuming…";
    return "pausing…";
  }
  return STATUS_TEXT[run.status] ?? run.status;
}

/** Save now as a view shows it: disabled, with the reason as its tooltip, where the server cannot save the run
 * (a torchrun child run: its weights are in the child) and while a save is on its way. */
export function saveButtonState(run) {
  const running = run?.status === "running";
  if (run && run.canSave === false) {
    return { disabled: true, title: "Save now is not available for a run on several GPUs: its weights are in the " +
      "torchrun child process. Its checkpoints' LoRAs (checkpoint_loras) or Stop give you a LoRA" };
  }
  return { disabled: !running || Boolean(run?.saveRequested),
    title: "Write a LoRA of the current weights to models/loras/kiln/ without stopping" };
}

export const STATUS_TEXT = {
  running: "training",
  finished: "finished",
  stopped: "stopped",
  interrupted: "interrupted",
  error: "error",
};
