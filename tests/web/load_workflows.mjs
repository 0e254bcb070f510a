// Loads saved UI workflows into ComfyUI's real frontend (headless Chromium, playwright-core) and reports
// what each node's widgets then hold, by name. Run by tests/nodes/test_saved_workflows.py:
//
//   node tests/web/load_workflows.mjs --url http://127.0.0.1:PORT --out DIR [--chromium PATH] [--templates PACK]
//        FILE...
//
// Prints one JSON line: {ok, files: {FILE: [{id, type, widgets: [[name, value], ...]}]}, console, pageErrors}.
// With --templates PACK, also `templates`: PACK's cards in the template browser and each template as opened
// from its card (templates.mjs), with screenshots in DIR.
import fs from "node:fs";
import path from "node:path";
import { parseArgs } from "node:util";
import { openPage } from "./browser.mjs";
import { browseTemplates } from "./templates.mjs";


const { values: options, positionals: files } = parseArgs({
  allowPositionals: true,
  options: {
    url: { type: "string" },
    out: { type: "string" },
    chromium: { type: "string", default: "/usr/bin/chromium" },
    "timeout-s": { type: "string", default: "180" },
    templates: { type: "string" },
  },
});
const timeout = Number(options["timeout-s"]) * 1000;
fs.mkdirSync(options.out, { recursive: true });
const report = { files: {}, console: [], pageErrors: [] };

const { context, page } = await openPage({ out: options.out, executablePath: options.chromium, report,
  viewport: { width: 1400, height: 900 } });

try {
  await page.goto(options.url, { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => {
    const app = window.comfyAPI?.app?.app;
    return app?.graph && window.LiteGraph?.registered_node_types?.KilnTrainLoRA;
  }, null, { timeout, polling: 250 });
  for (const file of files) {
    const workflow = JSON.parse(fs.readFileSync(file, "utf-8"));
    // The frontend loads its own start-up workflow asynchronously after the app appears; a graph loaded
    // before that is replaced. Load until the canvas holds this file's nodes (ids and types).
    report.files[path.basename(file)] = await page.evaluate(async (graph) => {
      const app = window.comfyAPI.app.app;
      const wanted = graph.nodes.map((node) => `${node.id}:${node.type}`).sort().join(",");
      for (let attempt = 0; attempt < 40; attempt += 1) {
        await app.loadGraphData(graph, true, true, "saved_workflow_check");
        await new Promise((resolve) => setTimeout(resolve, 250));
        const shown = app.graph.nodes.map((node) => `${node.id}:${node.type}`).sort().join(",");
        if (shown === wanted) break;
      }
      return app.graph.nodes.map((node) => ({
        id: node.id, type: node.type,
        widgets: (node.widgets ?? []).map((widget) => [widget.name, widget.value ?? null]),
      }));
    }, workflow);
  }
  if (options.templates) report.templates = await browseTemplates(page, { pack: options.templates, out: options.out });
  report.ok = true;
} catch (error) {
  report.ok = false;
  report.error = String(error.stack ?? error);
} finally {
  await context.close();
}
process.stdout.write(`${JSON.stringify(report)}\n`);
