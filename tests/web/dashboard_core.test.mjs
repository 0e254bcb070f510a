// Unit tests of the dashboard's logic (web/kiln_dashboard_core.js) with node's own test runner:
//   node --test tests/web/
// No npm packages, no browser: the module under test has no DOM or ComfyUI imports.
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  RunStore, bucketBars, chartGeometry, eta, figures, formatBytes, formatDuration, formatLoss, formatRate, quantile,
  saveButtonState, smooth, statusText, ticks, viewQuery,
} from "../../web/kiln_dashboard_core.js";

const close = (actual, expected, tolerance = 1e-12) =>
  assert.ok(Math.abs(actual - expected) <= tolerance, `${actual} != ${expected}`);

function progress(step, extra = {}) {
  return { run_id: "r1", run: "tiny-abc", node: "8", prompt_id: "p", status: "running", step, total: 100,
    started: 1000, lr: 1e-3 * (1 - step / 100), loss: 1 / step, loss_smooth: 1 / step, it_per_s: 2, eta_s: 10,
    peak_memory_bytes: 0, ...extra };
}

test("smooth equals trainer/run/plot.py's smoothed (bias-corrected EMA, factor 0.9)", () => {
  // python -c "from trainer.run.plot import smoothed; print(smoothed([1.0, 2.0, 0.5, 0.8, 1.2]))"
  const expected = [1.0, 1.5263157894736843, 1.1476014760147604, 1.0465251526606576, 1.0840028326536597];
  smooth([1.0, 2.0, 0.5, 0.8, 1.2]).forEach((value, i) => close(value, expected[i]));
});

test("smooth leaves gaps (null, NaN) as gaps and does not let them move the average", () => {
  const withGaps = smooth([1.0, null, 2.0, Number.NaN, 0.5]);
  const without = smooth([1.0, 2.0, 0.5]);
  assert.deepEqual([withGaps[1], withGaps[3]], [null, null]);
  close(withGaps[2], without[1]);
  close(withGaps[4], without[2]);
  assert.deepEqual(smooth([]), []);
});

test("eta: steps left over the rate; unknown without a rate", () => {
  assert.equal(eta(40, 100, 2), 30);
  assert.equal(eta(100, 100, 2), 0);
  assert.equal(eta(120, 100, 2), 0);
  assert.equal(eta(40, 100, 0), null);
  assert.equal(eta(40, 100, null), null);
});

test("figures read as a user expects", () => {
  assert.equal(formatDuration(42.4), "42s");
  assert.equal(formatDuration(185), "3m 05s");
  assert.equal(formatDuration(7440), "2h 04m");
  assert.equal(formatDuration(90000), "1d 1h");
  assert.equal(formatDuration(null), "—");
  assert.equal(formatBytes(0), "—");
  assert.equal(formatBytes(512 * 2 ** 20), "512 MiB");
  assert.equal(formatBytes(12.34 * 2 ** 30), "12.3 GiB");
  assert.equal(formatRate(2.3456), "2.35 it/s");
  assert.equal(formatRate(0.25), "4.00 s/it");
  assert.equal(formatRate(0), "—");
  assert.equal(formatLoss(0.123456), "0.1235");
  assert.equal(formatLoss(null), "—");
});

test("the ETA figure follows the step and speed; finished runs show none", () => {
  const run = { status: "running", step: 40, total: 100, figures: { it_per_s: 2, eta_s: 999, lr: 1e-4 } };
  const byKey = Object.fromEntries(figures(run).map((f) => [f.key, f.value]));
  assert.equal(byKey.eta, "30s");
  assert.equal(byKey.lr, "1.0e-4");
  assert.equal(byKey.rate, "2.00 it/s");
  const done = Object.fromEntries(figures({ ...run, status: "stopped" }).map((f) => [f.key, f.value]));
  assert.equal(done.eta, "—");
});

test("progress events build a run; a run first seen mid-way asks for its history", () => {
  const store = new RunStore();
  let changes = 0;
  store.subscribe(() => { changes += 1; });
  const run = store.applyProgress(progress(1));
  assert.equal(run.hasDetail, true);
  store.applyProgress(progress(2));
  store.applyProgress(progress(2)); // the same step twice (snapshot + event): counted once
  assert.deepEqual(run.lrSteps, [1, 2]);
  assert.deepEqual(run.steps, [1, 2]);
  assert.equal(run.step, 2);
  assert.equal(changes, 3);
  const late = store.applyProgress(progress(50, { run_id: "r2" }));
  assert.equal(late.hasDetail, false);
  assert.equal(store.applyProgress({ step: 3 }), null); // an event without a run id is ignored
});

test("a step without a loss reading adds a learning rate but keeps the last loss figure", () => {
  const store = new RunStore();
  store.applyProgress(progress(1));
  const run = store.applyProgress(progress(2, { loss: null, loss_smooth: null }));
  assert.deepEqual(run.steps, [1]);
  assert.deepEqual(run.lrSteps, [1, 2]);
  assert.equal(run.figures.loss, 1);
});

test("a snapshot (GET /kiln/runs/{id}) is merged with the steps the page saw after it", () => {
  const store = new RunStore();
  store.applyProgress(progress(5, { run_id: "r1" }));
  store.applyProgress(progress(6, { run_id: "r1" }));
  const run = store.applySnapshot({
    id: "r1", name: "tiny-abc", node: "8", status: "running", step: 5, total: 100, started: 1000,
    history: { step: [1, 2, 3, 4, 5], loss: [1, 0.5, null, 0.25, 0.2], lr_step: [1, 2, 3, 4, 5], lr: [1, 1, 1, 1, 1] },
    figures: { loss: 0.2 }, buckets: { "64x64": 2, "80x64": 2 },
    samples: [{ step: 5, image: { filename: "r1-step000005.jpg", subfolder: "kiln", type: "temp" } }], saved: [],
  });
  assert.deepEqual(run.steps, [1, 2, 3, 4, 5, 6]);
  assert.deepEqual(run.loss, [1, 0.5, null, 0.25, 0.2, 1 / 6]);
  assert.deepEqual(run.lrSteps, [1, 2, 3, 4, 5, 6]);
  assert.equal(run.step, 6); // the snapshot is older than the newest event
  assert.equal(run.hasDetail, true);
  assert.deepEqual(run.buckets, { "64x64": 2, "80x64": 2 });
  assert.equal(run.samples.length, 1);
});

test("the memory plan arrives with a run's summary (kiln.run) and stays until another replaces it", () => {
  const store = new RunStore();
  store.applySummary({ id: "r1", name: "a", status: "running", step: 0, total: 10, rev: 1 });
  assert.deepEqual(store.get("r1").plan, []);
  store.applySummary({ id: "r1", status: "running", step: 0, rev: 2, plan: ["memory plan: 4 of 34 blocks streamed"] });
  assert.deepEqual(store.get("r1").plan, ["memory plan: 4 of 34 blocks streamed"]);
  store.applySummary({ id: "r1", status: "running", step: 1, rev: 3 });
  assert.deepEqual(store.get("r1").plan, ["memory plan: 4 of 34 blocks streamed"]);
});

test("samples are kept once each, newest twelve", () => {
  const store = new RunStore();
  for (let step = 1; step <= 14; step += 1) {
    const sample = { run_id: "r1", step, image: { filename: `r1-step${step}.jpg`, subfolder: "kiln", type: "temp" } };
    store.applySample(sample);
    store.applySample(sample);
  }
  const run = store.get("r1");
  assert.equal(run.samples.length, 12);
  assert.equal(run.samples.at(-1).step, 14);
});

test("kiln.run summaries set the status and clear pending requests once the run ends", () => {
  const store = new RunStore();
  const run = store.applyProgress(progress(1));
  run.stopRequested = true;
  store.applySummary({ id: "r1", status: "stopped", message: "stopped at step 1", step: 1,
    saved: [{ step: 1, name: "kiln/tiny-abc-step000001.safetensors" }] });
  assert.equal(run.status, "stopped");
  assert.equal(run.stopRequested, false);
  assert.equal(run.saved.length, 1);
});

test("the sidebar shows the running run; a node shows its own newest run", () => {
  const store = new RunStore();
  store.applySummary({ id: "old", name: "a", node: "8", prompt_id: "p1", status: "finished", started: 1 });
  store.applySummary({ id: "live", name: "b", node: "3", prompt_id: "p2", status: "running", started: 2 });
  store.applySummary({ id: "newer", name: "c", node: "8", prompt_id: "p3", status: "stopped", started: 3 });
  assert.equal(store.current().id, "live");
  const mine = new Set(["p1", "p2", "p3"]);
  assert.equal(store.forWorkflow(mine, 8).id, "newer");
  assert.equal(store.forWorkflow(mine, "99"), null);
  assert.equal(new RunStore().current(), null);
});

test("a node shows only the runs its own workflow tab queued: the same node id in another tab stays idle", () => {
  const store = new RunStore();
  store.applySummary({ id: "theirs", node: "8", prompt_id: "other-tab", status: "running", started: 5 });
  store.applySummary({ id: "mine", node: "8", prompt_id: "this-tab", status: "finished", started: 1 });
  store.applyProgress({ run_id: "elsewhere", node: "8", prompt_id: "api", step: 1, total: 9, lr: 1e-4, started: 9 });
  assert.equal(store.forWorkflow(new Set(["this-tab"]), "8").id, "mine"); // older, but this tab's
  assert.equal(store.forWorkflow(new Set(), "8"), null); // a tab that queued nothing: idle
  assert.equal(store.forWorkflow(new Set(["this-tab"]), "9"), null); // this tab's prompt, another node
  assert.equal(store.current().id, "elsewhere"); // the sidebar still lists every run
});

test("chart: paths inside the box, x across the steps seen, a spike clipped to the top", () => {
  const loss = Array.from({ length: 50 }, (_, i) => 1 - i / 100);
  loss[10] = 1000; // one spike
  const run = { steps: loss.map((_, i) => i + 1), loss, lrSteps: loss.map((_, i) => i + 1),
    lr: loss.map(() => 1e-4), total: 100, step: 50 };
  const g = chartGeometry(run, 400, 200);
  assert.equal(g.empty, false);
  for (const d of [g.raw, g.smooth, g.lr]) {
    assert.match(d, /^M/);
    const numbers = d.match(/-?\d+(\.\d+)?/g).map(Number);
    for (let i = 0; i < numbers.length; i += 2) {
      assert.ok(numbers[i] >= g.pad.left - 1e-6 && numbers[i] <= 400 - g.pad.right + 1e-6, `x ${numbers[i]}`);
      assert.ok(numbers[i + 1] >= g.pad.top - 1e-6 && numbers[i + 1] <= 200 - g.pad.bottom + 1e-6, `y ${numbers[i + 1]}`);
    }
  }
  assert.ok(g.smooth.startsWith(`M${g.pad.left.toFixed(1)},`), "the first step at the left edge");
  assert.ok(g.smooth.includes(`L${(400 - g.pad.right).toFixed(1)},`), "the newest step at the right edge");
  assert.ok(g.yTicks.every((t) => Number(t.label) < 1000), "the spike does not set the scale");
  assert.equal(g.lrMax, 1e-4);
});

test("chart: a gap breaks the line; an empty run says so", () => {
  const run = { steps: [1, 2, 3, 4], loss: [1, null, 0.5, 0.4], lrSteps: [], lr: [], total: 4, step: 4 };
  const g = chartGeometry(run, 300, 150);
  assert.equal((g.raw.match(/M/g) ?? []).length, 2);
  const empty = chartGeometry({ steps: [], loss: [], lrSteps: [], lr: [], total: 10, step: 0 }, 300, 150);
  assert.equal(empty.empty, true);
  assert.equal(empty.raw, "");
  assert.equal(empty.lrMax, null);
});

test("ticks are round numbers inside the range", () => {
  assert.deepEqual(ticks(0, 100, 4), [0, 25, 50, 75, 100]);
  assert.deepEqual(ticks(0.13, 0.61, 4), [0.2, 0.4, 0.6]);
  assert.deepEqual(ticks(1, 1), [1]);
  close(quantile([1, 2, 3, 4, 5], 0.5), 3);
  assert.equal(quantile([], 0.5), null);
});

test("buckets: most entries first, bars relative to the largest", () => {
  const bars = bucketBars({ "64x64": 2, "80x64": 6, "48x96": 2, empty: 0 });
  assert.deepEqual(bars.map((b) => b.key), ["80x64", "48x96", "64x64"]);
  assert.equal(bars[0].fraction, 1);
  close(bars[1].fraction, 1 / 3);
  close(bars[0].share, 0.6);
  assert.deepEqual(bucketBars(undefined), []);
});

test("sample URLs are ComfyUI /view queries with every part encoded", () => {
  assert.equal(viewQuery({ filename: "a b&c.jpg", subfolder: "kiln", type: "temp" }),
    "/view?filename=a+b%26c.jpg&subfolder=kiln&type=temp");
});

test("held-out loss: progress events and snapshots build its own series, the chart draws it on the loss scale", () => {
  const store = new RunStore();
  store.applyProgress(progress(1));
  store.applyProgress(progress(2, { holdout_loss: 0.9 }));
  let run = store.applyProgress(progress(3, { holdout_loss: null }));
  assert.deepEqual([run.holdoutSteps, run.holdout], [[2], [0.9]]);
  assert.equal(run.figures.holdout_loss, 0.9);
  assert.equal(figures(run).find((f) => f.key === "holdout").value, formatLoss(0.9));
  assert.equal(figures(store.applyProgress(progress(1, { run_id: "other" }))).some((f) => f.key === "holdout"), false);
  run = store.applySnapshot({ id: "r1", status: "running", step: 1, total: 100,
    history: { step: [1], loss: [1], lr_step: [1], lr: [1e-3], holdout_step: [1], holdout: [3] } });
  assert.deepEqual([run.holdoutSteps, run.holdout], [[1, 2], [3, 0.9]]);     // the page's newer point kept
  const g = chartGeometry(run, 400, 200);
  assert.match(g.holdout, /^M[\d.]+,[\d.]+L/);
  const ys = g.holdout.match(/-?\d+(\.\d+)?/g).map(Number).filter((_, i) => i % 2 === 1);
  assert.ok(ys.every((y) => y >= g.pad.top - 1e-6 && y <= 200 - g.pad.bottom + 1e-6), "inside the box");
  assert.ok(g.yTicks.some((t) => Number(t.label) >= 2), "the held-out values set the scale too");
});

test("pause: pausing while asked and stepping, paused while the loop waits, and clear when the run ends", () => {
  const store = new RunStore();
  const run = store.applyProgress(progress(1));
  assert.equal(statusText(run), "training");
  store.applySummary({ id: "r1", status: "running", pause_requested: true });
  assert.equal(run.pauseRequested, true);
  assert.equal(statusText(run), "pausing…");
  store.applySummary({ id: "r1", status: "running", pause_requested: true, paused: true });   // the loop waits
  assert.equal(statusText(run), "paused");
  store.applySummary({ id: "r1", status: "running", pause_requested: false });              // Resume pressed
  assert.equal(statusText(run), "resuming…");
  store.applySummary({ id: "r1", status: "running", paused: false });
  assert.equal(statusText(run), "training");
  store.applySummary({ id: "r1", status: "running", pause_requested: true, paused: true });
  store.applySummary({ id: "r1", status: "stopped" });
  assert.equal(run.pauseRequested, false);
  assert.equal(run.paused, false);
  assert.equal(statusText(run), "stopped");
  assert.equal(statusText(null), "idle");
});

test("Save now: disabled with the reason for a run the server cannot save, enabled for a running one", () => {
  const store = new RunStore();
  const run = store.applyProgress(progress(1));
  assert.deepEqual(saveButtonState(run).disabled, false);
  store.applySummary({ id: "r1", status: "running", save_requested: true });
  assert.equal(saveButtonState(run).disabled, true);
  store.applySummary({ id: "r1", status: "running", save_requested: false, can_save: false });   // a torchrun run
  const state = saveButtonState(run);
  assert.equal(state.disabled, true);
  assert.match(state.title, /several GPUs.*torchrun child/);
  store.applySummary({ id: "r1", status: "finished", can_save: true });
  assert.equal(saveButtonState(run).disabled, true);
  assert.equal(saveButtonState(null).disabled, true);
});

test("Save now answered after the save: the late HTTP answer does not bring back 'saving'", () => {
  // CI found it on a slow machine (ComfyUI 0.33): the training thread saved and its kiln.run event (rev 5)
  // reached the page before POST .../save's answer (rev 4, save_requested true); the page then showed
  // "saving at the next step…" and kept Save now disabled until the run ended.
  const store = new RunStore();
  const run = store.applyProgress(progress(1));
  store.applySummary({ id: "r1", status: "running", rev: 5, save_requested: false, step: 3,
    saved: [{ step: 3, name: "kiln/r1-step000003.safetensors" }] });
  store.applySummary({ id: "r1", status: "running", rev: 4, save_requested: true, step: 2 });
  assert.equal(run.saveRequested, false);
  assert.equal(saveButtonState(run).disabled, false);
  assert.equal(run.saved.length, 1);
  assert.equal(run.step, 3);
  store.applySummary({ id: "r1", status: "running", rev: 6, stop_requested: true });   // a newer one applies
  assert.equal(run.stopRequested, true);
  store.applySummary({ id: "r1", status: "finished", rev: 7 });
  assert.equal(run.status, "finished");
});

test("the sample grid: the newest one is kept, an older event never replaces it, snapshots carry it", () => {
  const store = new RunStore();
  const image = (step) => ({ filename: `r1-grid-step${step}.jpg`, subfolder: "kiln", type: "temp" });
  store.applyGrid({ run_id: "r1", step: 4, image: image(4) });
  let run = store.applyGrid({ run_id: "r1", step: 2, image: image(2) });
  assert.deepEqual(run.grid, { step: 4, image: image(4) });
  assert.equal(run.samples.length, 0); // a grid is not a sample
  run = store.applySnapshot({ id: "r1", status: "running", step: 6, total: 10, grid: { step: 6, image: image(6) } });
  assert.deepEqual(run.grid, { step: 6, image: image(6) });
});

test("a torchrun run's memory figure shows each GPU's peak in rank order; one process its one peak", () => {
  const store = new RunStore();
  let run = store.applyProgress(progress(1, { peak_memory_bytes: 2 ** 30 }));
  assert.deepEqual(figures(run).find((f) => f.key === "memory"),
    { key: "memory", label: "peak memory", value: formatBytes(2 ** 30), hint: "peak accelerator memory (CPU: none)" });
  run = store.applyProgress(progress(2, { peak_memory_bytes: 2 ** 30, peak_memory_per_gpu: [2 ** 30, 3 * 2 ** 30] }));
  const memory = figures(run).find((f) => f.key === "memory");
  assert.equal(memory.label, "peak memory, 2 GPUs");
  assert.equal(memory.value, `${formatBytes(2 ** 30)} · ${formatBytes(3 * 2 ** 30)}`);
});
