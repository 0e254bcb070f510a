// Drives Kiln's dataset editor (web/kiln_datasets.js) in ComfyUI's real frontend (headless Chromium,
// playwright-core). Run by tests/nodes/test_dataset_editor_e2e.py, which starts the server and writes the files:
//
//   node tests/web/dataset_editor.mjs --url URL --out DIR --name NAME --image a.png --image b.png --image c.png
//        --drop tiny.png --drop notes.png --caption a.png="a red square" --prefix ohwx
//        --photo coffee.jpg --photo coffee_small.jpg --photo blurred.png --caption-model Florence-2-tiny
//
// Opens the "Kiln datasets" sidebar tab, creates NAME (character, trigger ohwx, 64 px), uploads the --image
// files through the file chooser, drops the --drop files on the drop zone (a real drop event with a
// DataTransfer), edits one caption, selects all and adds the prefix; then uploads the --photo files, selects
// them alone and captions them with "Caption selected" (transformers, --caption-model), waits for ComfyUI's
// queue to finish and the quality verdicts to load, and ticks "only images with problems". Prints one JSON line:
// {ok, statuses (the status line after each step), cards: [{path, severity, codes, caption, verdict,
// verdictCodes}], problemsOnly (the cards the filter leaves), console, pageErrors}.
import fs from "node:fs";
import path from "node:path";
import { parseArgs } from "node:util";
import { openPage } from "./browser.mjs";


const { values: options } = parseArgs({
  options: {
    url: { type: "string" },
    out: { type: "string" },
    name: { type: "string" },
    image: { type: "string", multiple: true, default: [] },
    drop: { type: "string", multiple: true, default: [] },
    caption: { type: "string" },
    prefix: { type: "string" },
    photo: { type: "string", multiple: true, default: [] },
    "caption-model": { type: "string" },
    chromium: { type: "string", default: "/usr/bin/chromium" },
    "timeout-s": { type: "string", default: "180" },
  },
});
const timeout = Number(options["timeout-s"]) * 1000;
fs.mkdirSync(options.out, { recursive: true });
const report = { statuses: {}, console: [], pageErrors: [] };

const { context, page } = await openPage({ out: options.out, executablePath: options.chromium, report,
  viewport: { width: 1500, height: 1000 } });

const EDITOR = ".kiln-datasets";
const status = () => page.locator(`${EDITOR} [data-kiln=status]`);

/** Wait until the status line matches `pattern` (or shows an error), and record it under `step`. */
async function settled(step, pattern) {
  await page.waitForFunction(([sel, pattern]) => {
    const line = document.querySelector(sel);
    return line && (new RegExp(pattern).test(line.textContent) || line.classList.contains("kds-error"));
  }, [`${EDITOR} [data-kiln=status]`, pattern], { timeout, polling: 100 });
  report.statuses[step] = { text: await status().textContent(), error: await status().evaluate((e) => e.classList.contains("kds-error")) };
}

try {
  await page.goto(options.url, { waitUntil: "domcontentloaded" });
  // The sidebar button exists once the extensions' setup ran, which is after the node definitions.
  await page.waitForFunction(() => {
    const app = window.comfyAPI?.app?.app;
    return app?.canvas && window.LiteGraph?.registered_node_types?.KilnLoadDataset &&
      document.querySelector(".kiln-datasets-tab-button");
  }, null, { timeout, polling: 250 });
  await page.waitForTimeout(1500);       // the frontend's own start-up workflow loads asynchronously
  await page.keyboard.press("Escape");
  await page.evaluate(() => window.comfyAPI.app.app.extensionManager.command.execute("Workspace.ToggleSidebarTab.kiln-datasets"));
  await page.waitForSelector(`${EDITOR} [data-kiln=new]`, { timeout });

  // Create the dataset.
  await page.click(`${EDITOR} [data-kiln=new]`);
  const form = `${EDITOR} [data-kiln=create-form]`;
  await page.fill(`${form} input[name=name]`, options.name);
  await page.selectOption(`${form} select[name=type]`, "character");
  await page.fill(`${form} input[name=trigger_word]`, "ohwx");
  await page.fill(`${form} input[name=resolutions]`, "64");
  await page.click(`${form} [data-kiln=create]`);
  await settled("create", "^created");

  // Three images through the file chooser, then two files dropped on the drop zone.
  await page.setInputFiles(`${EDITOR} [data-kiln=files]`, options.image);
  await settled("upload", "^added");
  const dropped = options.drop.map((file) => ({ name: path.basename(file), data: fs.readFileSync(file).toString("base64") }));
  await page.evaluate(([sel, files]) => {
    const transfer = new DataTransfer();
    for (const { name, data } of files) {
      transfer.items.add(new File([Uint8Array.from(atob(data), (c) => c.charCodeAt(0))], name, { type: "image/png" }));
    }
    const zone = document.querySelector(sel);
    zone.dispatchEvent(new DragEvent("dragover", { dataTransfer: transfer, bubbles: true, cancelable: true }));
    zone.dispatchEvent(new DragEvent("drop", { dataTransfer: transfer, bubbles: true, cancelable: true }));
  }, [`${EDITOR} [data-kiln=drop]`, dropped]);
  await settled("drop", "^added");

  // Edit one caption, then add a prefix to every image's caption.
  const [image, text] = options.caption.split("=");
  const card = `${EDITOR} .kds-card[data-path="${image}"]`;
  await page.fill(`${card} .kds-caption`, text);
  await page.click(`${card} .kds-save`);
  await settled("caption", "^saved");
  await page.check(`${EDITOR} [data-kiln=select-all]`);
  await page.selectOption(`${EDITOR} [data-kiln=bulk-op]`, "prefix");
  await page.fill(`${EDITOR} [data-kiln=bulk-text]`, options.prefix);
  await page.click(`${EDITOR} [data-kiln=bulk-apply]`);
  await settled("bulk", "caption\\(s\\) changed");

  // Real photos, captioned alone through ComfyUI's queue (the trigger word comes from dataset.json).
  await page.setInputFiles(`${EDITOR} [data-kiln=files]`, options.photo);
  await settled("photos", "^added");
  await page.check(`${EDITOR} [data-kiln=select-all]`);     // all, then none: the photos alone are selected next
  await page.uncheck(`${EDITOR} [data-kiln=select-all]`);
  for (const file of options.photo) await page.check(`${EDITOR} .kds-card[data-path="${path.basename(file)}"] .kds-select`);
  await page.waitForSelector(`${EDITOR} [data-kiln=caption-run]`, { timeout });
  await page.selectOption(`${EDITOR} [data-kiln=caption-engine]`, "transformers");
  await page.selectOption(`${EDITOR} [data-kiln=caption-model]`, options["caption-model"]);
  await page.fill(`${EDITOR} [data-kiln=caption-max-tokens]`, "8");     // the tiny model's captions: short
  await page.click(`${EDITOR} [data-kiln=caption-run]`);
  await settled("captioned", "captions? written|captioning (failed|stopped)|refused");
  await page.waitForFunction((sel) => document.querySelector(sel)?.textContent.startsWith("quality:"),
    `${EDITOR} [data-kiln=verdicts-status]`, { timeout, polling: 100 });

  // Thumbnails load lazily (a big dataset loads what is in view): load them all now.
  await page.$$eval(`${EDITOR} .kds-card img`, (images) => images.forEach((i) => { i.loading = "eager"; }));
  await page.waitForFunction((sel) => [...document.querySelectorAll(`${sel} .kds-card img`)].every((i) => i.complete),
    EDITOR, { timeout });
  report.cards = await page.$$eval(`${EDITOR} .kds-card`, (cards) => cards.map((c) => ({
    path: c.dataset.path, severity: c.dataset.severity, caption: c.querySelector(".kds-caption").value,
    codes: [...c.querySelectorAll(".kds-problems li")].map((li) => li.dataset.code),
    problems: [...c.querySelectorAll(".kds-problems li")].map((li) => li.textContent),
    thumbnail: c.querySelector("img").naturalWidth,
    verdict: c.querySelector(".kds-verdict").hidden ? null : c.querySelector(".kds-verdict").textContent,
    verdictCodes: c.querySelector(".kds-verdict").dataset.codes ?? null,
  })));
  await page.check(`${EDITOR} [data-kiln=problems-only]`);
  report.problemsOnly = await page.$$eval(`${EDITOR} .kds-card`, (cards) => cards.filter((c) => !c.hidden).map((c) => c.dataset.path));
  await page.screenshot({ path: path.join(options.out, "dataset_editor_problems.png") });
  await page.uncheck(`${EDITOR} [data-kiln=problems-only]`);
  report.summary = await page.textContent(`${EDITOR} [data-kiln=summary]`);
  report.formHidden = await page.isHidden(form);
  report.text = await page.textContent(EDITOR);
  report.listed = await page.$$eval(`${EDITOR} [data-kiln=pick] option`, (o) => o.map((e) => e.textContent));
  await page.screenshot({ path: path.join(options.out, "dataset_editor.png") });
  report.ok = true;
} catch (error) {
  report.ok = false;
  report.error = String(error.stack ?? error);
  await page.screenshot({ path: path.join(options.out, "dataset_editor_failed.png") }).catch(() => {});
} finally {
  await context.close();
}
process.stdout.write(`${JSON.stringify(report)}\n`);
