// End-to-end driver for the Kiln dashboard: headless Chromium (playwright-core) against a running
// ComfyUI with the pack loaded. Run by tests/nodes/test_dashboard_e2e.py, which starts the server:
//
//   node tests/web/e2e_dashboard.mjs --url http://127.0.0.1:PORT --workflow prompt.json --out DIR
//        [--chromium /usr/bin/chromium] [--min-points 4] [--timeout-s 300]
//
// It loads the API-format workflow into the canvas, opens the Kiln sidebar tab, queues the workflow the
// way the Queue button does (app.queuePrompt), waits until the Train LoRA node's dashboard shows a
// loss curve, the figures and a sample thumbnail, takes a screenshot, checks the header's buttons once the
// sample grid is there (also with the dashboard's body scrolled to its end) and that ComfyUI drew no preview
// image of its own on the node, presses Save now and then Stop, queues again (the run resumes) and presses
// Stop & save there. It prints one JSON line with what it saw; the pytest side asserts on it. Nothing here
// reaches the internet: Chromium runs with networking extras off.
import fs from "node:fs";
import path from "node:path";
import { parseArgs } from "node:util";
import { openPage } from "./browser.mjs";


const { values: options } = parseArgs({
  options: {
    url: { type: "string" },
    workflow: { type: "string" },
    out: { type: "string" },
    chromium: { type: "string", default: "/usr/bin/chromium" },
    "min-points": { type: "string", default: "4" },
    "timeout-s": { type: "string", default: "300" },
  },
});
const minPoints = Number(options["min-points"]);
const timeout = Number(options["timeout-s"]) * 1000;
const TRAIN_NODE = "8";
const NODE_VIEW = ".kiln-dash:not(.kd-panel)";
const PANEL_VIEW = ".kiln-dash.kd-panel";

fs.mkdirSync(options.out, { recursive: true });
const workflow = JSON.parse(fs.readFileSync(options.workflow, "utf-8"));
const report = { console: [], pageErrors: [], failedRequests: [], steps: [] };
const note = (text) => {
  report.steps.push(text);
  process.stderr.write(`[e2e] ${text}\n`);
};

const { context, page } = await openPage({ out: options.out, executablePath: options.chromium, report,
  viewport: { width: 1600, height: 1000 }, deviceScaleFactor: 1, consoleTypes: ["error", "warning"], withStacks: true });
page.on("requestfailed", (request) => report.failedRequests.push({ url: request.url(), error: request.failure()?.errorText }));

async function until(what, fn, arg) {
  note(`waiting: ${what}`);
  await page.waitForFunction(fn, arg, { timeout, polling: 250 });
}

// A view's state, read in one task of the page. The newest sample replaces the thumbnail as it
// arrives, so a state read later than the wait for a loaded thumbnail can catch the next one loading.
const readView = (sel) => {
  const view = document.querySelector(sel);
  if (!view) return null;
  const image = view.querySelector("[data-kiln=samples] img");
  return {
    run: view.dataset.run, status: view.dataset.status,
    points: Number(view.querySelector("[data-kiln=chart]")?.dataset.points ?? 0),
    smoothPath: view.querySelector("[data-kiln=smooth]")?.getAttribute("d") ?? "",
    steps: view.querySelector(".kd-steps")?.textContent ?? "",
    figures: Object.fromEntries([...view.querySelectorAll("[data-kiln=figures] .kd-figure")]
      .map((cell) => [cell.dataset.kiln, cell.querySelector("b").textContent])),
    buckets: view.querySelector("[data-kiln=buckets]")?.textContent ?? "",
    plan: view.querySelector("[data-kiln=plan]")?.textContent ?? "",
    sample: image ? { src: image.getAttribute("src"), width: image.naturalWidth, complete: image.complete } : null,
    note: view.querySelector(".kd-note")?.textContent ?? "",
  };
};

// The node view's header: each button inside the dashboard and the topmost element at its centre (nothing covers
// or clips it); the grid as the node shows it.
const readHeader = (sel) => {
  const view = document.querySelector(sel);
  const area = view.getBoundingClientRect();
  const buttons = {};
  for (const button of view.querySelectorAll(".kd-actions button")) {
    const rect = button.getBoundingClientRect();
    const hit = document.elementFromPoint(rect.left + rect.width / 2, rect.top + rect.height / 2);
    const inside = rect.height > 0 && rect.top >= area.top - 1 && rect.bottom <= area.bottom + 1;
    buttons[button.textContent] = { inside,
      onTop: button === hit || button.contains(hit), enabled: !button.disabled };
  }
  const body = view.querySelector(".kd-body");
  return { status: view.dataset.status, buttons, bodyScrolls: body.scrollHeight > body.clientHeight,
    gridHeight: view.querySelector("[data-kiln=grid] img")?.getBoundingClientRect().height ?? 0 };
};

async function viewState(selector) {
  return page.evaluate(readView, selector);
}

/** The view's state at a moment its thumbnail is loaded (waited for, then read in the same task). */
async function loadedViewState(selector) {
  const handle = await page.waitForFunction(([sel, source]) => {
    const state = (0, eval)(source)(sel);
    return state?.sample && state.sample.complete && state.sample.width > 0 ? state : false;
  }, [selector, readView.toString()], { timeout, polling: 100 });
  return handle.jsonValue();
}

const ready = ([sel, min]) => {
  const view = document.querySelector(sel);
  const image = view?.querySelector("[data-kiln=samples] img");
  return view && Number(view.querySelector("[data-kiln=chart]")?.dataset.points ?? 0) >= min &&
    image && image.complete && image.naturalWidth > 0;
};

try {
  await page.goto(options.url, { waitUntil: "domcontentloaded" });
  // The sidebar button exists once the extensions' setup ran, which is after the node definitions.
  await until("the ComfyUI app with the Kiln extension and nodes", () => {
    const app = window.comfyAPI?.app?.app;
    return app?.canvas && (app.extensions ?? []).some((e) => e.name === "kiln.dashboard") &&
      window.LiteGraph?.registered_node_types?.KilnTrainLoRA && document.querySelector(".kiln-dashboard-tab-button");
  });
  await page.keyboard.press("Escape"); // a first-run dialog, if any

  note("loading the workflow");
  await page.evaluate(async (prompt) => {
    const app = window.comfyAPI.app.app;
    await app.loadApiJson(prompt, "kiln_dashboard_e2e.json");
  }, workflow);
  await page.waitForSelector(NODE_VIEW, { state: "attached", timeout });

  note("opening the Kiln sidebar tab");
  await page.evaluate(() => {
    const manager = window.comfyAPI.app.app.extensionManager;
    return manager.command.execute("Workspace.ToggleSidebarTab.kiln-dashboard");
  });
  await page.waitForSelector(PANEL_VIEW, { timeout });

  // Arrange the canvas so the Train LoRA node and its dashboard are in view.
  await page.evaluate((id) => {
    const app = window.comfyAPI.app.app;
    const node = app.graph.getNodeById(Number(id));
    const canvas = app.canvas;
    canvas.ds.scale = 0.9;
    const box = canvas.canvas.getBoundingClientRect();
    canvas.ds.offset[0] = (box.width * 0.64) / canvas.ds.scale - node.pos[0] - node.size[0] / 2;
    canvas.ds.offset[1] = 40 / canvas.ds.scale - node.pos[1] + 30;
    canvas.setDirty(true, true);
  }, TRAIN_NODE);

  await page.screenshot({ path: path.join(options.out, "dashboard_idle.png") });
  // The dashboard widget is no value: the saved workflow and the queued prompt stay as they were.
  report.serialized = await page.evaluate(async (id) => {
    const app = window.comfyAPI.app.app;
    const node = app.graph.getNodeById(Number(id));
    const saved = app.graph.serialize().nodes.find((n) => String(n.id) === id);
    const prompt = await app.graphToPrompt();
    return { widgets: node.widgets.map((w) => w.name), widgetsValues: saved.widgets_values,
      promptInputs: Object.keys(prompt.output[id].inputs) };
  }, TRAIN_NODE);
  // The largest number of preview images ComfyUI itself put on the node while it trained (its validation samples
  // go out as progress previews: ComfyUI would draw them under the dashboard, which shows them already).
  await page.evaluate((id) => {
    const node = window.comfyAPI.app.app.graph.getNodeById(Number(id));
    window.kilnComfyPreviews = 0;
    window.kilnPreviewWatch = setInterval(() => {
      const drawn = (node.imgs?.length ?? 0) + node.widgets.filter((w) => w.name.startsWith("$$")).length;
      window.kilnComfyPreviews = Math.max(window.kilnComfyPreviews, drawn);
    }, 100);
  }, TRAIN_NODE);
  note("queueing the workflow");
  await page.evaluate(() => window.comfyAPI.app.app.queuePrompt(0, 1));
  await until(`a curve of ${minPoints}+ points and a sample on the node`, ready, [NODE_VIEW, minPoints]);
  await until("the same in the sidebar", ready, [PANEL_VIEW, minPoints]);
  await page.waitForTimeout(500); // let the last frame paint (screenshot only; nothing is asserted on timing)
  report.running = { node: await loadedViewState(NODE_VIEW), panel: await loadedViewState(PANEL_VIEW) };
  await page.screenshot({ path: path.join(options.out, "dashboard.png") });
  note("screenshot taken");

  await until("the sample grid on the node", (sel) => {
    const grid = document.querySelector(sel)?.querySelector("[data-kiln=grid] img");
    return grid?.complete && grid.naturalWidth > 0;
  }, NODE_VIEW);
  report.header = { grid: await page.evaluate(readHeader, NODE_VIEW) };
  await page.evaluate((sel) => {
    const body = document.querySelector(sel).querySelector(".kd-body");
    body.scrollTop = body.scrollHeight;
  }, NODE_VIEW);
  report.header.scrolled = await page.evaluate(readHeader, NODE_VIEW);
  await page.screenshot({ path: path.join(options.out, "dashboard_scrolled.png") });

  note("Save now");
  await page.click(`${NODE_VIEW} .kd-save`);
  await until("the saved LoRA's name", (sel) => document.querySelector(sel)?.querySelector(".kd-note")
    ?.textContent.includes("saved kiln/"), NODE_VIEW);
  report.saved = await viewState(NODE_VIEW);

  note("Stop (sidebar)");
  await page.click(`${PANEL_VIEW} .kd-stop`);
  await until("the run stopped", (sels) => sels.every((sel) => document.querySelector(sel)?.dataset.status === "stopped"),
    [NODE_VIEW, PANEL_VIEW]);
  report.stopped = { node: await viewState(NODE_VIEW), panel: await viewState(PANEL_VIEW) };
  report.comfyPreviews = await page.evaluate(() => {
    clearInterval(window.kilnPreviewWatch);
    return window.kilnComfyPreviews;
  });
  // The run as the server had it when it stopped (the resumed execution continues the same entry).
  report.stopped.run = await page.evaluate(async (id) => (await fetch(`/kiln/runs/${id}`)).json(),
    report.stopped.node.run);
  await page.screenshot({ path: path.join(options.out, "dashboard_stopped.png") });

  note("queueing again: the stopped run resumes");
  const first = report.stopped.node.run;
  await page.evaluate(() => window.comfyAPI.app.app.queuePrompt(0, 1));
  await until("the same run training again on the node", (args) => {
    const view = document.querySelector(args[0]);
    return view?.dataset.run === args[1] && view.dataset.status === "running";
  }, [NODE_VIEW, first]);
  report.resumed = await viewState(NODE_VIEW);
  note("Stop & save (node)");
  await page.click(`${NODE_VIEW} .kd-stopsave`);
  await until("the resumed run stopped", (sel) => document.querySelector(sel)?.dataset.status === "stopped", NODE_VIEW);
  report.resumedStopped = await viewState(NODE_VIEW);
  report.ok = true;
} catch (error) {
  report.ok = false;
  report.error = String(error.stack ?? error);
  await page.screenshot({ path: path.join(options.out, "failure.png") }).catch(() => {});
} finally {
  await context.close();
}
process.stdout.write(`${JSON.stringify(report)}\n`);
