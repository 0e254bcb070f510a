// Every FLOAT widget of the Kiln nodes in ComfyUI's real frontend (headless Chromium, playwright-core), driven
// with the mouse and keyboard as a user does on the canvas. Run by tests/nodes/test_float_widgets_e2e.py:
//
//   node tests/web/float_widgets.mjs --url http://127.0.0.1:PORT --out DIR --nodes nodes.json [--chromium PATH]
//
// nodes.json: {NodeType: [{name, written}, ...]}. Each node is put on an empty classic canvas (which shows
// every input); for each widget the driver reads the text the canvas draws for its value, clicks the right
// arrow and then the left one, the left and then the right (each pair from the default), and types a value
// into the widget's prompt twice (the text it showed, then `written`, the default as a person writes it, e.g.
// 1e-8), moving the value off the default by an arrow before each. With --vue TYPE it then turns on the Vue
// node mode and reads that node's text before and after its "Show advanced inputs". It prints one JSON line:
// {ok, nodes: {type: {widget: {...values seen}}}, vue: {before, after}, console, pageErrors}; the pytest side
// holds the expectations. Screenshots go to DIR: <type>.png per node, <TYPE>-vue(-advanced).png.
import fs from "node:fs";
import path from "node:path";
import { parseArgs } from "node:util";
import { openPage } from "./browser.mjs";


const { values: options } = parseArgs({
  options: {
    url: { type: "string" },
    out: { type: "string" },
    nodes: { type: "string" },
    vue: { type: "string" },
    chromium: { type: "string", default: "/usr/bin/chromium" },
    "timeout-s": { type: "string", default: "180" },
  },
});
const timeout = Number(options["timeout-s"]) * 1000;
const wanted = JSON.parse(fs.readFileSync(options.nodes, "utf-8"));
fs.mkdirSync(options.out, { recursive: true });
const report = { nodes: {}, console: [], pageErrors: [] };
const VIEW = { width: 1200, height: 900 };
const ARROW_X = 20;             // inside the 40 px each end of a number widget keeps for its arrows
const CLICK_GAP_MS = 350;       // longer than litegraph's double-click window, so two clicks stay two

const { context, page } = await openPage({ out: options.out, executablePath: options.chromium, report,
  viewport: VIEW, deviceScaleFactor: 1 });

// The widget's value and the text the canvas draws for it.
const read = (type, name) => page.evaluate(([type, name]) => {
  const node = window.comfyAPI.app.app.graph.nodes.find((n) => n.type === type);
  const widget = node.widgets.find((w) => w.name === name);
  return { value: widget.value, shown: widget._displayValue };
}, [type, name]);

// Scroll the canvas so the widget's row sits mid-screen at scale 1; the page point of its left arrow, its
// middle and its right arrow.
async function place(type, name) {
  return page.evaluate(([type, name, view, ARROW_X]) => {
    const app = window.comfyAPI.app.app;
    const canvas = app.canvas;
    const node = app.graph.nodes.find((n) => n.type === type);
    const widget = node.widgets.find((w) => w.name === name);
    canvas.ds.scale = 1;
    canvas.ds.offset[0] = view.width / 2 - node.pos[0] - node.size[0] / 2;
    canvas.ds.offset[1] = view.height / 2 - node.pos[1] - widget.y - (widget.computedHeight ?? 20) / 2;
    canvas.setDirty(true, true);
    canvas.draw(true, true);
    const box = canvas.canvas.getBoundingClientRect();
    const y = (node.pos[1] + widget.y + (widget.computedHeight ?? 20) / 2 + canvas.ds.offset[1]) + box.top;
    const x0 = node.pos[0] + canvas.ds.offset[0] + box.left;
    const title = node.pos[1] - window.LiteGraph.NODE_TITLE_HEIGHT / 2 + canvas.ds.offset[1] + box.top;
    return { y, title, left: x0 + ARROW_X, middle: x0 + node.size[0] / 2, right: x0 + node.size[0] - ARROW_X };
  }, [type, name, VIEW, ARROW_X]);
}

async function click(x, y) {
  await page.mouse.click(x, y);
  await page.waitForTimeout(CLICK_GAP_MS);
}

// Open the widget's prompt with a click on its middle, replace the text and press Enter.
async function typeInto(point, text) {
  await click(point.middle, point.y);
  const input = page.locator(".graphdialog input, .graphdialog textarea").last();
  await input.waitFor({ state: "visible", timeout: 10000 });
  await input.fill(text);
  await input.press("Enter");
  await page.locator(".graphdialog").first().waitFor({ state: "detached", timeout: 10000 }).catch(() => {});
  await page.waitForTimeout(CLICK_GAP_MS);
}

// Put the default back without the UI, so that each pair of clicks starts from it.
const reset = (type, name, value) => page.evaluate(([type, name, value]) => {
  const node = window.comfyAPI.app.app.graph.nodes.find((n) => n.type === type);
  node.widgets.find((w) => w.name === name).value = value;
}, [type, name, value]);

async function exercise(type, name, written) {
  const seen = {};
  const point = await place(type, name);
  seen.initial = await read(type, name);
  const start = seen.initial.value;
  const pairs = [["right", "left", "up", "upBack"], ["left", "right", "down", "downBack"]];
  for (const [first, second, there, back] of pairs) {
    await reset(type, name, start);
    await click(point[first], point.y);
    seen[there] = (await read(type, name)).value;
    await click(point[second], point.y);
    seen[back] = (await read(type, name)).value;
  }
  for (const [key, text] of [["typedShown", seen.initial.shown], ["typedDefault", written]]) {
    // Off the default first, by an arrow (a prompt that sets the same value changes nothing: it would prove
    // nothing); the right one unless the default is the maximum.
    await reset(type, name, start);
    await click(seen.up !== start ? point.right : point.left, point.y);
    seen[`${key}From`] = (await read(type, name)).value;
    await typeInto(point, text);
    seen[key] = await read(type, name);
  }
  return seen;
}

// The node in the frontend's Vue node mode (Nodes 2.0): its text before and after its footer's "Show advanced
// inputs" (the classic canvas shows every input: it reads widget.advanced, which the frontend leaves unset).
async function vueAdvanced(type) {
  const id = await page.evaluate(async ([type, view]) => {
    const app = window.comfyAPI.app.app;
    await app.extensionManager.setting.set("Comfy.VueNodes.Enabled", true);
    app.graph.clear();
    const node = window.LiteGraph.createNode(type);
    app.graph.add(node);
    node.pos = [100, 100];
    app.canvas.ds.scale = 0.75;
    app.canvas.ds.offset[0] = 140 / 0.75 - node.pos[0];
    app.canvas.ds.offset[1] = 110 / 0.75 - node.pos[1];
    app.canvas.setDirty(true, true);
    return String(node.id);
  }, [type, VIEW]);
  const element = page.locator(`[data-node-id="${id}"]`).first();
  await element.waitFor({ timeout: 30000 });
  await page.waitForTimeout(500);   // the node measured in the DOM (then fitted to the page, footer in view)
  await page.evaluate(([id, view]) => {
    const app = window.comfyAPI.app.app;
    const node = app.graph.getNodeById(Number(id));
    const scale = Math.min(0.75, (view.height - 200) / (node.size[1] + 80));
    app.canvas.ds.scale = scale;
    app.canvas.ds.offset[0] = 140 / scale - node.pos[0];
    app.canvas.ds.offset[1] = 110 / scale - node.pos[1];
    app.canvas.setDirty(true, true);
  }, [id, VIEW]);
  await page.waitForTimeout(500);   // one frame painted (screenshot only)
  const before = await element.innerText();
  await page.screenshot({ path: path.join(options.out, `${type}-vue.png`) });
  // Near the button's lower edge: 1.41 tucks the footer under the node's body, which takes clicks above that.
  const button = element.locator("button", { hasText: /show advanced/i }).first();
  const box = await button.boundingBox();
  await button.click({ position: { x: box.width / 2, y: box.height - 4 } });
  await page.waitForTimeout(500);
  const after = await element.innerText();
  await page.screenshot({ path: path.join(options.out, `${type}-vue-advanced.png`) });
  return { before, after };
}

try {
  await page.goto(options.url, { waitUntil: "domcontentloaded" });
  await page.waitForFunction((types) => {
    const app = window.comfyAPI?.app?.app;
    return app?.canvas && types.every((type) => window.LiteGraph?.registered_node_types?.[type]);
  }, Object.keys(wanted), { timeout, polling: 250 });
  await page.waitForTimeout(2000);   // the frontend's own start-up workflow loads asynchronously
  await page.keyboard.press("Escape");
  for (const [type, widgets] of Object.entries(wanted)) {
    const defaults = await page.evaluate((type) => {
      const app = window.comfyAPI.app.app;
      app.graph.clear();
      const node = window.LiteGraph.createNode(type);
      app.graph.add(node);
      node.pos = [100, 100];
      node.setSize([420, node.computeSize()[1]]);
      app.canvas.setDirty(true, true);
      return Object.fromEntries(node.widgets.map((w) => [w.name, w.value]));
    }, type);
    // Select the node by its title first, as a user's first click on a new node does.
    const first = await place(type, widgets[0].name);
    await click(first.middle, first.title);
    report.nodes[type] = {};
    for (const { name, written } of widgets) {
      report.nodes[type][name] = { default: defaults[name], ...(await exercise(type, name, written)) };
    }
    // The whole node in view with every float at its default again, for the screenshot.
    await page.evaluate(([type, view]) => {
      const app = window.comfyAPI.app.app;
      const node = app.graph.nodes.find((n) => n.type === type);
      const canvas = app.canvas;
      canvas.ds.scale = Math.min(1, (view.height - 60) / (node.size[1] + 40));
      canvas.ds.offset[0] = 140 / canvas.ds.scale - node.pos[0];   // clear of the sidebar
      canvas.ds.offset[1] = 110 / canvas.ds.scale - node.pos[1];   // the title below the toolbar
      canvas.setDirty(true, true);
    }, [type, VIEW]);
    await page.waitForTimeout(300);   // one frame painted (screenshot only; nothing is asserted on timing)
    await page.screenshot({ path: path.join(options.out, `${type}.png`) });
  }
  if (options.vue) report.vue = await vueAdvanced(options.vue);
  report.ok = true;
} catch (error) {
  report.ok = false;
  report.error = String(error.stack ?? error);
  await page.screenshot({ path: path.join(options.out, "failure.png") }).catch(() => {});
} finally {
  await context.close();
}
process.stdout.write(`${JSON.stringify(report)}\n`);
