// Drives Kiln's folder pickers (web/kiln_folders.js) in ComfyUI's real frontend (headless Chromium,
// playwright-core). Run by tests/nodes/test_folder_picker.py, which starts the server:
//
//   node tests/web/folder_picker.mjs --url http://127.0.0.1:PORT --out DIR --pick KilnLoadDataset=NAME ...
//
// For each --pick NODE=NAME it adds that node to the canvas, presses its "choose…" button as a click
// does, reads the menu that opens, clicks the entry named NAME and reports what the node then holds:
// {widgets, menu, serialized (the workflow's widgets_values), prompt (the inputs graphToPrompt sends)}.
// Prints one JSON line: {ok, nodes: {NODE: {...}}, console, pageErrors}.
import fs from "node:fs";
import path from "node:path";
import { parseArgs } from "node:util";
import { openPage } from "./browser.mjs";


const { values: options } = parseArgs({
  options: {
    url: { type: "string" },
    out: { type: "string" },
    pick: { type: "string", multiple: true, default: [] },
    chromium: { type: "string", default: "/usr/bin/chromium" },
    "timeout-s": { type: "string", default: "180" },
  },
});
const timeout = Number(options["timeout-s"]) * 1000;
fs.mkdirSync(options.out, { recursive: true });
const report = { nodes: {}, console: [], pageErrors: [] };

const { context, page } = await openPage({ out: options.out, executablePath: options.chromium, report,
  viewport: { width: 1400, height: 900 } });

try {
  await page.goto(options.url, { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => {
    const app = window.comfyAPI?.app?.app;
    return app?.graph && window.LiteGraph?.registered_node_types?.KilnLoadRun;
  }, null, { timeout, polling: 250 });
  await page.waitForTimeout(2000);   // the frontend's own start-up workflow loads asynchronously
  for (const pick of options.pick) {
    const [type, name] = pick.split("=");
    // Add the node and press its picker button with a real click event at the canvas.
    const before = await page.evaluate((type) => {
      const app = window.comfyAPI.app.app;
      document.querySelectorAll(".litecontextmenu").forEach((menu) => menu.remove());
      const node = window.LiteGraph.createNode(type);
      app.graph.add(node);
      const button = node.widgets.find((widget) => widget.kilnPicker);
      if (!button) return { id: node.id, error: "no picker button", widgets: node.widgets.map((w) => w.name) };
      button.callback(null, app.canvas, node, [0, 0], new MouseEvent("click", { clientX: 300, clientY: 200 }));
      return { id: node.id, label: button.name, type: button.type };
    }, type);
    if (before.error) {
      report.nodes[type] = before;
      continue;
    }
    await page.waitForSelector(".litecontextmenu .litemenu-entry", { timeout: 30000 });
    await page.screenshot({ path: path.join(options.out, `${type}.png`) });
    const menu = await page.$$eval(".litecontextmenu .litemenu-entry", (entries) => entries.map((e) => e.textContent));
    const entry = page.locator(".litecontextmenu .litemenu-entry", { hasText: name }).first();
    if (await entry.count()) await entry.click();
    report.nodes[type] = await page.evaluate(async ({ id, before, menu }) => {
      const app = window.comfyAPI.app.app;
      const node = app.graph.getNodeById(id);
      const { output } = await app.graphToPrompt();
      return {
        ...before, menu,
        widgets: node.widgets.map((widget) => [widget.name, widget.value ?? null]),
        serialized: node.serialize().widgets_values,
        prompt: output[String(id)]?.inputs ?? null,
      };
    }, { id: before.id, before, menu });
    await page.evaluate(() => document.querySelectorAll(".litecontextmenu").forEach((menu) => menu.remove()));
  }
  report.ok = true;
} catch (error) {
  report.ok = false;
  report.error = String(error.stack ?? error);
} finally {
  await context.close();
}
process.stdout.write(`${JSON.stringify(report)}\n`);
