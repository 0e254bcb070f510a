// End-to-end driver for what Kiln draws on its nodes: headless Chromium (playwright-core) against a running
// ComfyUI with the pack loaded. Run by tests/nodes/test_node_ui_e2e.py, which starts the server:
//
//   node tests/web/e2e_node_ui.mjs --url http://127.0.0.1:PORT --workflow prompt.json --out DIR
//        [--chromium /usr/bin/chromium] [--timeout-s 300]
//
// It loads the API-format workflow (a short training with samples, then Save LoRA) into a tab, reads the idle
// Train LoRA node, queues the workflow, waits for Save LoRA's report and reads each node's report box, the
// dashboard (header, buttons, grid) and the saved workflow; then opens a second tab with the same workflow
// (same node ids), reads it, goes back to the first, and reloads the page. It prints one JSON line with what it
// saw; the pytest side asserts on it. Screenshots of each stage go to --out.
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
    "timeout-s": { type: "string", default: "300" },
  },
});
const timeout = Number(options["timeout-s"]) * 1000;
const REPORTING = ["4", "8", "9"]; // Load Dataset, Train LoRA, Save LoRA
const FIRST = "kiln_node_ui";
const SECOND = "kiln_node_ui_second";
// Nodes in rows that fit one screenshot: the models, then the data nodes, Train LoRA, Save LoRA.
const LAYOUT = { 1: [-1200, 0], 2: [-1200, 130], 3: [-1200, 260], 10: [-840, 0], 11: [-840, 260], 12: [-840, 520],
  4: [-350, 0], 7: [-350, 640], 5: [0, 0], 6: [0, 130], 8: [320, 0], 9: [760, 0] };

fs.mkdirSync(options.out, { recursive: true });
const workflow = JSON.parse(fs.readFileSync(options.workflow, "utf-8"));
const report = { console: [], pageErrors: [], steps: [] };
const note = (text) => {
  report.steps.push(text);
  process.stderr.write(`[e2e] ${text}\n`);
};

const { context, page } = await openPage({ out: options.out, executablePath: options.chromium, report,
  viewport: { width: 1600, height: 1000 }, deviceScaleFactor: 1, consoleTypes: ["error", "warning"],
  withStacks: true });

async function until(what, fn, arg) {
  note(`waiting: ${what}`);
  await page.waitForFunction(fn, arg, { timeout, polling: 250 });
}

async function appReady() {
  await until("the ComfyUI app with Kiln's extensions", () => {
    const app = window.comfyAPI?.app?.app;
    // an active workflow: the start-up graph (restored tabs, or the default one) is loaded and will not replace ours
    return app?.canvas && ["kiln.dashboard", "kiln.reports", "kiln.queue"].every((name) =>
      (app.extensions ?? []).some((e) => e.name === name)) && window.LiteGraph?.registered_node_types?.KilnTrainLoRA &&
      app.extensionManager?.workflow?.activeWorkflow && document.querySelector(".kiln-dashboard-tab-button");
  });
  await page.keyboard.press("Escape"); // a first-run dialog, if any
}

async function loadTab(name) {
  note(`loading the workflow as ${name}`);
  await page.evaluate(async ([prompt, file]) => window.comfyAPI.app.app.loadApiJson(prompt, `${file}.json`),
    [workflow, name]);
  // 1.41 names the new tab a moment after the nodes are made: wait until it is the active one
  await until(`${name} is the active tab`, (file) =>
    window.comfyAPI.app.app.extensionManager.workflow.activeWorkflow?.path?.endsWith(`/${file}.json`), name);
  await arrange();
}

async function arrange() {
  await page.evaluate((layout) => {
    const app = window.comfyAPI.app.app;
    for (const [id, pos] of Object.entries(layout)) {
      const node = app.graph.getNodeById(Number(id));
      if (node) node.pos = pos;
    }
    const options = app.graph.getNodeById(7); // Training Options: 54 widgets, not what this test looks at
    if (options && !options.flags?.collapsed) options.collapse();
    const canvas = app.canvas;
    canvas.ds.scale = 0.8;
    canvas.ds.offset[0] = 450; // Load Dataset (x = -350) at the left edge, beside the sidebar; Save LoRA in view
    canvas.ds.offset[1] = 60;
    canvas.setDirty(true, true);
  }, LAYOUT);
  await page.waitForTimeout(400); // let the canvas and the DOM widgets follow (screenshots only)
}

async function shot(name) {
  await page.screenshot({ path: path.join(options.out, `${name}.png`) });
}

// Everything the assertions need from the canvas, read in one task of the page.
const readNodes = (ids) => {
  const app = window.comfyAPI.app.app;
  const inside = (inner, outer) => inner.top >= outer.top - 1 && inner.bottom <= outer.bottom + 1 &&
    inner.left >= outer.left - 1 && inner.right <= outer.right + 1 && inner.height > 0;
  const nodes = {};
  for (const id of ids) {
    const node = app.graph.getNodeById(Number(id));
    const box = node?.widgets?.find((w) => w.name === "kiln_report")?.element;
    nodes[id] = node && {
      type: node.comfyClass, size: [...node.size], widgets: node.widgets.map((w) => w.name),
      previews: (node.imgs?.length ?? 0) + node.widgets.filter((w) => w.name.startsWith("$$")).length,
      report: box ? { text: box.value, readOnly: box.readOnly, tag: box.tagName, height: box.offsetHeight,
        scrolls: box.scrollHeight > box.clientHeight, font: getComputedStyle(box).fontFamily } : null,
    };
  }
  const view = document.querySelector(".kiln-dash:not(.kd-panel)");
  let dashboard = null;
  if (view) {
    const area = view.getBoundingClientRect();
    const buttons = {};
    for (const [name, sel] of [["stop", ".kd-stop"], ["save", ".kd-save"], ["pause", ".kd-pause"]]) {
      const button = view.querySelector(sel);
      const rect = button.getBoundingClientRect();
      const hit = document.elementFromPoint(rect.left + rect.width / 2, rect.top + rect.height / 2);
      buttons[name] = { inside: inside(rect, area), onTop: button === hit || button.contains(hit) };
    }
    const grid = view.querySelector("[data-kiln=grid] img");
    const body = view.querySelector(".kd-body");
    dashboard = { status: view.dataset.status, run: view.dataset.run, height: view.offsetHeight,
      buttons, grid: grid ? { width: grid.naturalWidth, height: grid.getBoundingClientRect().height } : null,
      bodyScrolls: body.scrollHeight > body.clientHeight, topInside: inside(view.querySelector(".kd-top")
        .getBoundingClientRect(), area) };
  }
  const train = app.graph.getNodeById(8);
  const saved = app.graph.serialize().nodes.filter((n) => ids.includes(String(n.id)))
    .map((n) => [String(n.id), n.widgets_values]);
  return { nodes, dashboard, widgetsValues: Object.fromEntries(saved), idleMinHeight: train?.computeSize()[1],
    tab: app.extensionManager.workflow.activeWorkflow?.path };
};

async function read() {
  const state = await page.evaluate(readNodes, REPORTING);
  state.promptInputs = await page.evaluate(async (ids) => {
    const prompt = await window.comfyAPI.app.app.graphToPrompt();
    return Object.fromEntries(ids.map((id) => [id, Object.keys(prompt.output[id].inputs)]));
  }, REPORTING);
  return state;
}

/** The dashboard body scrolled to its end: the header (status, progress, buttons) must stay in view. */
async function scrolledToEnd() {
  await page.evaluate(() => {
    const body = document.querySelector(".kiln-dash:not(.kd-panel) .kd-body");
    body.scrollTop = body.scrollHeight;
  });
  return page.evaluate(readNodes, REPORTING);
}

const reportsDrawn = (ids) => ids.every((id) => {
  const node = window.comfyAPI.app.app.graph.getNodeById(Number(id));
  return node?.widgets?.find((w) => w.name === "kiln_report")?.element.value;
});

try {
  await page.goto(options.url, { waitUntil: "domcontentloaded" });
  await appReady();
  await loadTab(FIRST);
  await until("the idle dashboard", () =>
    document.querySelector(".kiln-dash:not(.kd-panel)")?.dataset.status === "idle");
  report.idle = await read();
  await shot("node_ui_idle");

  note("queueing the workflow");
  await page.evaluate(() => window.comfyAPI.app.app.queuePrompt(0, 1));
  await until("the reports of Load Dataset, Train LoRA and Save LoRA", reportsDrawn, REPORTING);
  await until("the sample grid on the finished run's dashboard", () => {
    const view = document.querySelector(".kiln-dash:not(.kd-panel)");
    const grid = view?.querySelector("[data-kiln=grid] img");
    return view?.dataset.status === "finished" && grid?.complete && grid.naturalWidth > 0;
  });
  await arrange();
  report.ran = await read();
  await shot("node_ui_reports");
  report.scrolled = await scrolledToEnd();
  await shot("node_ui_scrolled");

  note("a second tab with the same workflow (the same node ids)");
  await page.evaluate(() => window.comfyAPI.app.app.extensionManager.command.execute("Comfy.NewBlankWorkflow"));
  await loadTab(SECOND);
  await until("the second tab's dashboard idle", () =>
    document.querySelector(".kiln-dash:not(.kd-panel)")?.dataset.status === "idle");
  report.second = await read();
  await shot("node_ui_second_tab");

  note("back to the first tab");
  await page.getByText(FIRST, { exact: true }).first().click(); // its tab, as a user switches
  await until("the first tab's run and reports again", (ids) => {
    const view = document.querySelector(".kiln-dash:not(.kd-panel)");
    return view?.dataset.status === "finished" && ids.every((id) => window.comfyAPI.app.app.graph
      .getNodeById(Number(id))?.widgets?.some((w) => w.name === "kiln_report"));
  }, REPORTING);
  await arrange();
  report.back = await read();
  await shot("node_ui_back");

  note("reloading the page");
  await page.reload({ waitUntil: "domcontentloaded" });
  await appReady();
  await until("the first tab restored with its run and reports", ([ids, file]) => {
    const app = window.comfyAPI.app.app;
    const view = document.querySelector(".kiln-dash:not(.kd-panel)");
    return app.extensionManager.workflow.activeWorkflow?.path?.endsWith(`/${file}.json`) &&
      view?.dataset.status === "finished" &&
      ids.every((id) => app.graph.getNodeById(Number(id))?.widgets?.some((w) => w.name === "kiln_report"));
  }, [REPORTING, FIRST]);
  await arrange();
  report.reloaded = await read();
  await shot("node_ui_reloaded");
  report.ok = true;
} catch (error) {
  report.ok = false;
  report.error = String(error.stack ?? error);
  await shot("failure").catch(() => {});
} finally {
  await context.close();
}
process.stdout.write(`${JSON.stringify(report)}\n`);
