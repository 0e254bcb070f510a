// Kiln live dashboard: one view of a training run, drawn with DOM and SVG (no libraries, nothing
// fetched but the pack's own routes and ComfyUI's /view). Used twice by kiln_dashboard.js: on each
// Kiln Train LoRA node (compact) and in the Kiln sidebar tab (with a run picker).
import { STATUS_TEXT, bucketBars, chartGeometry, figures, formatCount, saveButtonState, statusText,
  viewQuery } from "./kiln_dashboard_core.js";

const SVG = "http://www.w3.org/2000/svg";
const STYLE_ID = "kiln-dashboard-style";

const CSS = `
.kiln-dash { box-sizing: border-box; display: flex; flex-direction: column; gap: 6px; padding: 8px;
  font: 12px/1.35 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg-color, #ddd);
  background: var(--comfy-menu-bg, #202020); border: 1px solid var(--border-color, #3a3a3a); border-radius: 8px;
  overflow: hidden; height: 100%; }
.kiln-dash.kd-panel { border: none; border-radius: 0; height: auto; min-height: 100%; padding: 0 12px 12px; gap: 10px;
  overflow: visible; }
.kiln-dash * { box-sizing: border-box; }
.kd-top { flex: none; display: flex; flex-direction: column; gap: 6px; }
.kd-panel .kd-top { position: sticky; top: 0; z-index: 1; padding-top: 12px; padding-bottom: 4px;
  background: var(--comfy-menu-bg, #202020); }
.kd-body { display: flex; flex-direction: column; gap: 6px; flex: 1 1 auto; min-height: 0; overflow-y: auto; }
.kd-panel .kd-body { gap: 10px; overflow: visible; }
.kiln-dash:not(.kd-panel) .kd-grid img { max-height: 72px; width: auto; }
.kiln-dash.kd-is-idle:not(.kd-panel) { padding: 4px 8px; justify-content: center; }
.kiln-dash.kd-is-idle .kd-title { font-weight: 400; color: var(--descrip-text, #999); }
.kd-body > * { flex: none; }
.kd-head { display: flex; align-items: center; gap: 8px; min-height: 20px; }
.kd-title { font-weight: 600; flex: 1; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.kd-pick { flex: 1; min-width: 0; background: var(--comfy-input-bg, #2a2a2a); color: inherit;
  border: 1px solid var(--border-color, #444); border-radius: 4px; padding: 2px 4px; font: inherit; }
.kd-status { font-size: 11px; padding: 1px 8px; border-radius: 10px; background: #555; color: #fff; white-space: nowrap; }
.kd-status.running { background: #2f7d4a; } .kd-status.stopped, .kd-status.interrupted { background: #9a6b16; }
.kd-status.finished { background: #2d5f9a; } .kd-status.error { background: #a33; }
.kd-progress { display: flex; align-items: center; gap: 8px; }
.kd-bar { flex: 1; height: 6px; border-radius: 3px; background: var(--comfy-input-bg, #333); overflow: hidden; }
.kd-fill { height: 100%; width: 0; background: linear-gradient(90deg, #e0662f, #f3a23a); transition: width .3s; }
.kd-steps { font-variant-numeric: tabular-nums; white-space: nowrap; opacity: .9; }
.kd-chart { width: 100%; height: 140px; display: block; background: var(--comfy-input-bg, #181818); border-radius: 6px; }
.kd-panel .kd-chart { height: 210px; }
.kd-chart text { font-size: 10px; fill: var(--descrip-text, #999); }
.kd-chart .grid { stroke: var(--border-color, #333); stroke-width: 1; opacity: .6; }
.kd-chart .raw { fill: none; stroke: #6fa8dc; stroke-width: 1; opacity: .45; }
.kd-chart .smooth { fill: none; stroke: #5fb3ff; stroke-width: 2; }
.kd-chart .lr { fill: none; stroke: #f0a030; stroke-width: 1.2; stroke-dasharray: 4 3; opacity: .85; }
.kd-chart .holdout { fill: none; stroke: #e05a9a; stroke-width: 2; }
.kd-grid img { max-width: 100%; border-radius: 4px; display: block; }
.kd-legend { display: flex; flex-wrap: wrap; gap: 2px 12px; font-size: 11px; color: var(--descrip-text, #999); }
.kd-legend > span { white-space: nowrap; }
.kd-legend i { display: inline-block; width: 14px; height: 2px; vertical-align: middle; margin-right: 4px; }
.kd-figures { display: grid; grid-template-columns: repeat(3, 1fr); gap: 4px; }
.kd-figure { background: var(--comfy-input-bg, #262626); border-radius: 5px; padding: 3px 6px; min-width: 0; }
.kd-figure b { display: block; font-size: 12.5px; font-weight: 600; font-variant-numeric: tabular-nums;
  white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.kd-figure span { font-size: 10px; color: var(--descrip-text, #999); text-transform: uppercase; letter-spacing: .03em; }
.kd-section { font-size: 10px; text-transform: uppercase; letter-spacing: .05em; color: var(--descrip-text, #999); }
.kd-samples { display: flex; gap: 6px; overflow-x: auto; min-height: 20px; }
.kd-panel .kd-samples { flex-wrap: wrap; overflow-x: visible; }
.kd-sample { flex: none; display: flex; flex-direction: column; align-items: center; font-size: 10px;
  color: var(--descrip-text, #999); text-decoration: none; }
.kd-sample img { width: 64px; height: 64px; object-fit: cover; border-radius: 4px; border: 1px solid var(--border-color, #444);
  image-rendering: auto; background: #111; }
.kd-panel .kd-sample img { width: 88px; height: 88px; }
.kd-sample.newest img { border-color: #e0662f; }
.kd-buckets { display: grid; grid-template-columns: auto 1fr auto; gap: 2px 6px; align-items: center; font-size: 11px; }
.kd-buckets .kd-bbar { height: 6px; border-radius: 3px; background: #7a5cc7; min-width: 2px; }
.kd-buckets span { font-variant-numeric: tabular-nums; }
.kd-plan { font-size: 11px; opacity: 0.85; display: grid; gap: 2px; overflow-wrap: anywhere; }
.kd-actions { display: flex; gap: 6px; align-items: center; flex-wrap: wrap; row-gap: 4px; }
.kd-actions button { font: inherit; padding: 3px 12px; border-radius: 5px; cursor: pointer; color: #fff;
  border: 1px solid transparent; }
.kd-actions button:disabled { opacity: .4; cursor: default; }
.kd-stop { background: #a33; } .kd-stopsave { background: #8a4a2a; }
.kd-save { background: #2d5f9a; } .kd-pause { background: #6a5a2a; }
.kd-status.paused { background: #6a5a2a; }
.kd-note { flex: 1 1 120px; min-width: 0; font-size: 11px; color: var(--descrip-text, #999); overflow-wrap: anywhere; }
.kd-idle { color: var(--descrip-text, #999); font-size: 12px; padding: 6px 0; }
`;

function installStyle(doc) {
  if (doc.getElementById(STYLE_ID)) return;
  const style = doc.createElement("style");
  style.id = STYLE_ID;
  style.textContent = CSS;
  doc.head.appendChild(style);
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function svg(tag, attributes) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, String(value));
  return node;
}

// What each action button sets at once (the server's answer confirms it), and the note it shows.
const FLAGS = { stop: "stopRequested", stop_save: "stopRequested", save: "saveRequested", pause: "pauseRequested",
  resume: "pauseRequested" };
const NOTES = { stop: "stopping after this step…", stop_save: "stopping after this step, then saving…",
  save: "saving at the next step…",
  pause: "paused after this step (memory kept)…", resume: "resuming…" };

/**
 * A dashboard bound to a RunStore. `pick()` chooses the run to show (the node's own, or the
 * sidebar's current one); `actions` = {stop(run), stop_save(run), save(run), pause(run), resume(run),
 * imageUrl(query)}; `onShape(showing)` hears when the view turns from idle (one line) to showing a run, and back.
 * Status, progress and the buttons are a header that never scrolls away; the rest scrolls below it.
 */
export class DashboardView {
  constructor(store, { pick, actions, panel = false, idleText, onShape }) {
    installStyle(document);
    this.store = store;
    this.pick = pick;
    this.actions = actions;
    this.panel = panel;
    this.idleText = idleText;
    this.onShape = onShape;
    this.showing = null; // whether the last render showed a run (null: not rendered yet)
    this.chosen = null; // a run id the user picked in the sidebar
    this.notes = new Map(); // run id → note text ("stopping …", "saved …")
    this.element = el("div", `kiln-dash${panel ? " kd-panel" : ""}`);
    this.element.dataset.kiln = "dashboard";
    this.build();
    this.unsubscribe = store.subscribe(() => this.schedule());
    this.resize = typeof ResizeObserver === "function" ? new ResizeObserver(() => this.schedule()) : null;
    this.resize?.observe(this.chart);
    this.schedule();
  }

  build() {
    const head = el("div", "kd-head");
    this.title = el("span", "kd-title", "Kiln");
    this.picker = el("select", "kd-pick");
    this.picker.title = "Runs this ComfyUI has seen";
    this.picker.addEventListener("change", () => {
      this.chosen = this.picker.value || null;
      this.schedule();
    });
    this.status = el("span", "kd-status", "idle");
    head.append(this.panel ? this.picker : this.title, this.status);
    const progress = el("div", "kd-progress");
    const bar = el("div", "kd-bar");
    this.fill = el("div", "kd-fill");
    bar.append(this.fill);
    this.steps = el("span", "kd-steps", "");
    progress.append(bar, this.steps);
    this.chart = svg("svg", { class: "kd-chart", "data-kiln": "chart" });
    const legend = el("div", "kd-legend");
    for (const [name, colour] of [["loss", "#6fa8dc80"], ["smoothed", "#5fb3ff"], ["held-out", "#e05a9a"],
      ["learning rate", "#f0a030"]]) {
      const item = el("span");
      const swatch = el("i");
      swatch.style.background = colour;
      this.legendText = el("span", "", name); // the last one (learning rate) shows its scale
      item.append(swatch, this.legendText);
      legend.append(item);
    }
    this.figureBox = el("div", "kd-figures");
    this.figureBox.dataset.kiln = "figures";
    this.samples = el("div", "kd-samples");
    this.samples.dataset.kiln = "samples";
    this.grid = el("a", "kd-grid");
    this.grid.dataset.kiln = "grid";
    this.grid.target = "_blank";
    this.grid.rel = "noopener";
    this.buckets = el("div", "kd-buckets");
    this.buckets.dataset.kiln = "buckets";
    this.planSection = el("div", "kd-section", "Memory");
    this.plan = el("div", "kd-plan");
    this.plan.dataset.kiln = "plan";
    const actions = el("div", "kd-actions");
    this.stopButton = el("button", "kd-stop", "Stop");
    this.stopButton.title = "Stop after this step and save a resumable checkpoint; the nodes after Train LoRA " +
      "(Save LoRA) are skipped: the run is not done (queue again to continue)";
    this.stopSaveButton = el("button", "kd-stopsave", "Stop & save");
    this.stopSaveButton.title = "Stop after this step with a resumable checkpoint, and let Save LoRA write the " +
      "LoRA as of that step (queue again to continue; the finished run's save replaces it)";
    this.stopSaveButton.addEventListener("click", () => this.act("stop_save"));
    this.saveButton = el("button", "kd-save", "Save now");
    this.saveButton.title = saveButtonState(null).title;
    this.pauseButton = el("button", "kd-pause", "Pause");
    this.pauseButton.title = "Wait after this step, memory kept (Stop still works); Resume goes on";
    this.pauseButton.addEventListener("click", () => this.act(this.current()?.pauseRequested ? "resume" : "pause"));
    this.note = el("span", "kd-note", "");
    this.stopButton.addEventListener("click", () => this.act("stop"));
    this.saveButton.addEventListener("click", () => this.act("save"));
    actions.append(this.stopButton, this.stopSaveButton, this.saveButton, this.pauseButton, this.note);
    this.idle = el("div", "kd-idle", this.idleText);
    this.body = el("div", "kd-body");
    // on the node the grid is a thumbnail: its full size belongs to the sidebar, where there is room
    this.gridSection = el("div", "kd-section", this.panel ? "Sample grid" : "Sample grid (full size in the Kiln tab)");
    this.progress = progress;
    this.actionBar = actions;
    this.top = el("div", "kd-top");
    this.top.append(head, progress, actions);
    this.body.append(this.chart, legend, this.figureBox, el("div", "kd-section", "Samples"), this.samples,
      this.gridSection, this.grid, el("div", "kd-section", "Buckets"), this.buckets,
      this.planSection, this.plan);
    this.element.append(this.top, this.idle, this.body);
  }

  current() {
    return (this.chosen && this.store.get(this.chosen)) || this.pick();
  }

  async act(action) {
    const run = this.current();
    if (!run || run.status !== "running") return;
    this.notes.set(run.id, NOTES[action]);
    const flag = FLAGS[action];
    const before = run[flag];
    run[flag] = action !== "resume";
    this.schedule();
    try {
      const text = await this.actions[action](run);
      this.notes.set(run.id, text ?? this.notes.get(run.id));
    } catch (error) {
      this.notes.set(run.id, `${action} failed: ${error.message ?? error}`);
      run[flag] = before;
    }
    this.schedule();
  }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    const frame = typeof requestAnimationFrame === "function" ? requestAnimationFrame : (f) => setTimeout(f, 16);
    frame(() => {
      this.pending = false;
      this.render();
    });
  }

  render() {
    const run = this.current();
    if (this.panel) this.renderPicker(run);
    this.renderShape(Boolean(run));
    this.status.textContent = statusText(run);
    const waiting = run?.status === "running" && (run.paused || run.pauseRequested);
    this.status.className = `kd-status ${waiting ? "paused" : run?.status ?? ""}`;
    this.element.dataset.run = run?.id ?? "";
    this.element.dataset.status = run?.status ?? "idle";
    if (!run) {
      this.title.textContent = this.title.title = this.idleText;
      return;
    }
    this.title.textContent = run.name || "Kiln";
    this.title.title = run.name;
    const fraction = run.total ? Math.min(1, run.step / run.total) : 0;
    this.fill.style.width = `${(fraction * 100).toFixed(1)}%`;
    this.steps.textContent = `step ${formatCount(run.step)} / ${formatCount(run.total)}`;
    this.renderChart(run);
    this.renderFigures(run);
    this.renderSamples(run);
    this.renderGrid(run);
    this.renderBuckets(run);
    this.renderPlan(run);
    const running = run.status === "running";
    this.stopButton.disabled = this.stopSaveButton.disabled = !running || run.stopRequested;
    Object.assign(this.saveButton, saveButtonState(run));
    this.pauseButton.disabled = !running || run.stopRequested;
    this.pauseButton.textContent = run.pauseRequested ? "Resume" : "Pause";
    const saved = run.saved?.at(-1) ? `saved ${run.saved.at(-1).name}` : "";
    const busy = running && (run.saveRequested || run.stopRequested || (run.pauseRequested && !run.paused));
    const texts = running ? [busy ? this.notes.get(run.id) : saved] : [run.message, saved];
    this.note.textContent = texts.filter(Boolean).join(" · ");
    this.note.title = this.note.textContent;
  }

  /** Idle: the head line alone (the node reserves no room for a run it has not shown); else all of it. */
  renderShape(showing) {
    this.element.classList.toggle("kd-is-idle", !showing);
    this.idle.style.display = !showing && this.panel ? "" : "none";
    for (const part of [this.progress, this.actionBar, this.body]) part.style.display = showing ? "" : "none";
    if (showing === this.showing) return;
    this.showing = showing;
    this.onShape?.(showing);
  }

  renderPicker(run) {
    const runs = this.store.list();
    const wanted = runs.map((r) => `${r.id}:${r.name}:${r.status}`).join("|");
    if (wanted !== this.pickerKey) {
      this.pickerKey = wanted;
      this.picker.replaceChildren(...runs.map((r) => {
        const option = el("option", "", `${r.name || r.id} — ${STATUS_TEXT[r.status] ?? r.status}`);
        option.value = r.id;
        return option;
      }));
      if (!runs.length) this.picker.append(el("option", "", "no training run yet"));
    }
    if (run) this.picker.value = run.id;
  }

  renderChart(run) {
    const width = Math.max(200, Math.round(this.chart.clientWidth || 320));
    const height = Math.max(100, Math.round(this.chart.clientHeight || 150));
    const g = chartGeometry(run, width, height);
    this.chart.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const parts = [];
    for (const tick of g.yTicks) {
      parts.push(svg("line", { class: "grid", x1: g.pad.left, x2: width - g.pad.right, y1: tick.y, y2: tick.y }));
      const label = svg("text", { x: g.pad.left - 4, y: tick.y + 3, "text-anchor": "end" });
      label.textContent = tick.label;
      parts.push(label);
    }
    for (const tick of g.xTicks) {
      const label = svg("text", { x: tick.x, y: height - 6, "text-anchor": "middle" });
      label.textContent = tick.label;
      parts.push(label);
    }
    parts.push(svg("path", { class: "lr", d: g.lr || "M0,0" }));
    parts.push(svg("path", { class: "raw", d: g.raw || "M0,0", "data-kiln": "raw" }));
    parts.push(svg("path", { class: "smooth", d: g.smooth || "M0,0", "data-kiln": "smooth" }));
    parts.push(svg("path", { class: "holdout", d: g.holdout || "M0,0", "data-kiln": "holdout" }));
    this.legendText.textContent = g.lrMax === null ? "learning rate" : `learning rate (max ${g.lrMax.toExponential(1)})`;
    if (g.empty) {
      const label = svg("text", { x: width / 2, y: height / 2, "text-anchor": "middle" });
      label.textContent = "waiting for the first loss…";
      parts.push(label);
    }
    this.chart.replaceChildren(...parts);
    this.chart.dataset.points = String(run.steps.length);
  }

  renderFigures(run) {
    this.figureBox.replaceChildren(...figures(run).map((figure) => {
      const cell = el("div", "kd-figure");
      cell.title = figure.hint;
      cell.dataset.kiln = figure.key;
      cell.append(el("b", "", figure.value), el("span", "", figure.label));
      return cell;
    }));
  }

  renderSamples(run) {
    const key = run.samples.map((s) => s.image.filename).join("|");
    if (key === this.samplesKey) return;
    this.samplesKey = key;
    const newest = [...run.samples].reverse().slice(0, this.panel ? 6 : 4);
    if (!newest.length) {
      this.samples.replaceChildren(el("span", "kd-idle", "no validation sample yet (connect Kiln Validation Settings)"));
      return;
    }
    this.samples.replaceChildren(...newest.map((sample, index) => {
      const url = this.actions.imageUrl(viewQuery(sample.image));
      const link = el("a", `kd-sample${index === 0 ? " newest" : ""}`);
      link.href = url;
      link.target = "_blank";
      link.rel = "noopener";
      link.title = `validation sample at step ${sample.step}`;
      const image = el("img");
      image.src = url;
      image.alt = `step ${sample.step}`;
      image.loading = "lazy";
      link.append(image, `step ${formatCount(sample.step)}`);
      return link;
    }));
  }

  renderGrid(run) {
    const key = run.grid?.image?.filename ?? "";
    if (key === this.gridKey) return;
    this.gridKey = key;
    this.gridSection.style.display = this.grid.style.display = key ? "" : "none";
    if (!key) return;
    const url = this.actions.imageUrl(viewQuery(run.grid.image));
    const image = el("img");
    image.src = url;
    image.alt = `sample grid at step ${run.grid.step}`;
    this.grid.href = url;
    this.grid.title = `every sample so far, prompts across, steps down (newest: step ${run.grid.step})`;
    this.grid.replaceChildren(image);
  }

  /** The memory plan (what sits on the GPU, what streams, the host RAM it takes) and auto's choices. */
  renderPlan(run) {
    const lines = Array.isArray(run.plan) ? run.plan : [];
    this.planSection.hidden = this.plan.hidden = !lines.length;
    const key = lines.join("\n");
    if (key === this.planKey) return;
    this.planKey = key;
    this.plan.replaceChildren(...lines.map((line) => el("div", "", line)));
  }

  renderBuckets(run) {
    const bars = bucketBars(run.buckets);
    const key = JSON.stringify(bars);
    if (key === this.bucketsKey) return;
    this.bucketsKey = key;
    const cells = [];
    for (const bar of bars.slice(0, this.panel ? 16 : 5)) {
      const fill = el("div", "kd-bbar");
      fill.style.width = `${Math.max(2, bar.fraction * 100).toFixed(1)}%`;
      cells.push(el("span", "", bar.key), fill, el("span", "", `${bar.count} · ${Math.round(bar.share * 100)}%`));
    }
    if (bars.length > (this.panel ? 16 : 5)) cells.push(el("span", "", `+${bars.length - (this.panel ? 16 : 5)} more`));
    this.buckets.replaceChildren(...cells);
  }

  dispose() {
    this.unsubscribe();
    this.resize?.disconnect();
    this.element.remove();
  }
}
