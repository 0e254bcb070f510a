// Drives Kiln's dataset editor (web/kiln_datasets.js) in ComfyUI's real frontend (headless Chromium,
// playwright-core). Run by tests/nodes/test_dataset_editor_e2e.py, which starts the server and writes the files:
//
//   node tests/web/dataset_editor.mjs --url URL --out DIR --name NAME --image a.png --image b.png --image c.png
//        --drop tiny.png --drop notes.png --caption a.png="a red square" --enter c.png="green|square" --prefix ohwx
//        --photo coffee.jpg --photo coffee_small.jpg --photo blurred.png --caption-model Florence-2-tiny --other kiln_tiny_dataset
//
// Opens the "Kiln datasets" sidebar tab and from it the wide editor (their widths are measured), creates NAME
// (character, trigger ohwx, 64 px), uploads the --image files through the file chooser (the cards' problems are
// read once the quality pass answers: uncaptioned images), drops the --drop files on the drop zone (a real drop
// event with a DataTransfer); types one caption and leaves the field (Tab), recording the card's state and the
// caption the server has before and after; types another with Shift+Enter inside and saves it with Enter; selects
// all and adds the prefix. Then a caption the server refuses (over 20,000 characters) stays unsaved, and switching
// to --other asks: dismissed (stays), then accepted (switches, the refused text is dropped); Esc with an unsaved
// caption asks too (dismissed), and closes once the caption is back to its saved text. Then uploads the --photo
// files, selects them alone and captions them with "Caption selected" (transformers, --caption-model), waits for
// ComfyUI's queue to finish and the quality verdicts to load; lists each control's label; enlarges a thumbnail
// (→ steps, Esc closes the zoom only); ticks "only images with problems". Prints one JSON line: {ok, statuses
// (the status line after each step), widths, uncaptioned, blurSave, enterSave, switchAsk, closeAsk, unlabelled,
// captionLabels, zoom, cards: [{path, severity, codes, problems, caption, verdict, verdictCodes}], problemsOnly,
// dialogs, console, pageErrors}.
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
    enter: { type: "string" },
    prefix: { type: "string" },
    photo: { type: "string", multiple: true, default: [] },
    "caption-model": { type: "string" },
    other: { type: "string" },
    chromium: { type: "string", default: "/usr/bin/chromium" },
    "timeout-s": { type: "string", default: "180" },
  },
});
const timeout = Number(options["timeout-s"]) * 1000;
fs.mkdirSync(options.out, { recursive: true });
const report = { statuses: {}, dialogs: [], console: [], pageErrors: [] };

const { context, page } = await openPage({ out: options.out, executablePath: options.chromium, report,
  viewport: { width: 1500, height: 1000 } });

const EDITOR = ".kds-wide";
const LAUNCHER = ".kds-launcher";
const status = () => page.locator(`${EDITOR} [data-kiln=status]`);
const cardOf = (file) => `${EDITOR} .kds-card[data-path="${file}"]`;

// window.confirm answers: each is recorded and answered with `answer` (dismissed when no step expects one).
let answer = "dismiss";
page.on("dialog", async (dialog) => {
  report.dialogs.push({ type: dialog.type(), message: dialog.message(), answer });
  await (answer === "accept" ? dialog.accept() : dialog.dismiss());
});

/** Wait until the status line matches `pattern` (or shows an error), and record it under `step`. */
async function settled(step, pattern) {
  await page.waitForFunction(([sel, pattern]) => {
    const line = document.querySelector(sel);
    return line && (new RegExp(pattern).test(line.textContent) || line.classList.contains("kds-error"));
  }, [`${EDITOR} [data-kiln=status]`, pattern], { timeout, polling: 100 });
  report.statuses[step] = { text: await status().textContent(), error: await status().evaluate((e) => e.classList.contains("kds-error")) };
}

/** The caption the server has for `file` of `dataset` (it reads the .txt on disk). */
const serverCaption = (dataset, file) => page.evaluate(async ([dataset, file]) => {
  const response = await fetch(`/kiln/datasets/${encodeURIComponent(dataset)}`, { cache: "no-store" });
  return (await response.json()).images.find((image) => image.path === file)?.caption ?? null;
}, [dataset, file]);

/** A card's caption state: data-state, the marker's text and the field's value. */
const cardState = (file) => page.$eval(cardOf(file), (card) => ({ state: card.dataset.state,
  marker: card.querySelector("[data-kiln=caption-state]").textContent, value: card.querySelector(".kds-caption").value,
  saveShown: !card.querySelector(".kds-save").hidden }));

const waitState = (file, state) => page.waitForFunction(([sel, state]) => document.querySelector(sel)?.dataset.state === state,
  [cardOf(file), state], { timeout, polling: 100 });

const quality = () => page.waitForFunction((sel) => document.querySelector(sel)?.textContent.startsWith("quality:"),
  `${EDITOR} [data-kiln=verdicts-status]`, { timeout, polling: 100 });

/** Each card as the user sees it: its problems (list items), its verdict line and its caption. */
const readCards = () => page.$$eval(`${EDITOR} .kds-card`, (cards) => cards.map((c) => ({
  path: c.dataset.path, severity: c.dataset.severity, caption: c.querySelector(".kds-caption").value,
  codes: [...c.querySelectorAll(".kds-problems li")].map((li) => li.dataset.code),
  problems: [...c.querySelectorAll(".kds-problems li")].map((li) => li.textContent),
  thumbnail: c.querySelector("img").naturalWidth,
  verdict: c.querySelector(".kds-verdict").hidden ? null : c.querySelector(".kds-verdict").textContent,
  verdictCodes: c.querySelector(".kds-verdict").dataset.codes ?? null,
})));

/** Wait until the page has asked `count` questions in all (window.confirm). */
async function dialogsReach(count) {
  const end = Date.now() + timeout;
  while (report.dialogs.length < count) {
    if (Date.now() > end) throw new Error(`expected question ${count}; asked: ${JSON.stringify(report.dialogs)}`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

/** Open the dataset editor from the sidebar tab's button; its width and the sidebar's. */
async function openEditor() {
  await page.click(`${LAUNCHER} [data-kiln=open-editor]`);
  await page.waitForSelector(EDITOR, { state: "visible", timeout });
  return page.evaluate(([launcher, editor]) => ({ sidebar: document.querySelector(launcher).getBoundingClientRect().width,
    editor: document.querySelector(editor).getBoundingClientRect().width, viewport: window.innerWidth }), [LAUNCHER, EDITOR]);
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
  await page.waitForSelector(`${LAUNCHER} [data-kiln=open-editor]`, { timeout });
  await page.waitForSelector(`${LAUNCHER} [data-kiln=launcher-list] button`, { timeout });
  report.launcher = await page.$$eval(`${LAUNCHER} [data-kiln=launcher-list] button`, (b) => b.map((e) => e.textContent));
  await page.screenshot({ path: path.join(options.out, "dataset_editor_sidebar.png") });
  report.widths = await openEditor();

  // Create the dataset.
  await page.click(`${EDITOR} [data-kiln=new]`);
  const form = `${EDITOR} [data-kiln=create-form]`;
  await page.fill(`${form} input[name=name]`, options.name);
  await page.selectOption(`${form} select[name=type]`, "character");
  await page.fill(`${form} input[name=trigger_word]`, "ohwx");
  await page.fill(`${form} input[name=resolutions]`, "64");
  await page.click(`${form} [data-kiln=create]`);
  await settled("create", "^created");

  // Three images through the file chooser: uncaptioned, so the scan and the quality pass both flag them.
  await page.setInputFiles(`${EDITOR} [data-kiln=files]`, options.image);
  await settled("upload", "^added");
  await quality();
  report.uncaptioned = await readCards();
  // Then two files dropped on the drop zone.
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

  // A caption typed shows "unsaved" (the server still has the old one); leaving the field (Tab) saves it.
  const [image, text] = options.caption.split("=");
  await page.fill(`${cardOf(image)} .kds-caption`, text);
  report.blurSave = { typed: await cardState(image), serverBefore: await serverCaption(options.name, image) };
  await page.screenshot({ path: path.join(options.out, "dataset_editor_unsaved.png") });
  await page.keyboard.press("Tab");
  await settled("caption", "^saved");
  await waitState(image, "clean");
  report.blurSave.saved = await cardState(image);
  report.blurSave.serverAfter = await serverCaption(options.name, image);
  // Shift+Enter is a new line; Enter saves.
  const [enterImage, enterText] = options.enter.split("=");
  const [first, second] = enterText.split("|");
  await page.click(`${cardOf(enterImage)} .kds-caption`);
  await page.keyboard.type(first);
  await page.keyboard.press("Shift+Enter");
  await page.keyboard.type(second);
  report.enterSave = { typed: await cardState(enterImage) };
  await page.keyboard.press("Enter");
  await waitState(enterImage, "clean");
  report.enterSave.saved = await cardState(enterImage);
  report.enterSave.serverAfter = await serverCaption(options.name, enterImage);
  report.enterSave.focused = await page.evaluate(() => document.activeElement?.closest(".kds-card")?.dataset.path ?? null);

  await page.check(`${EDITOR} [data-kiln=select-all]`);
  await page.selectOption(`${EDITOR} [data-kiln=bulk-op]`, "prefix");
  await page.fill(`${EDITOR} [data-kiln=bulk-text]`, options.prefix);
  await page.click(`${EDITOR} [data-kiln=bulk-apply]`);
  await settled("bulk", "caption\\(s\\) changed");

  // A caption the server refuses stays unsaved: switching dataset asks; Cancel stays, OK switches and drops it.
  await page.fill(`${cardOf(image)} .kds-caption`, "long ".repeat(4001));
  await page.keyboard.press("Tab");
  await waitState(image, "error");
  report.switchAsk = { refused: await cardState(image), dialogsBefore: report.dialogs.length };
  report.switchAsk.refused.value = report.switchAsk.refused.value.length;
  answer = "dismiss";
  await page.selectOption(`${EDITOR} [data-kiln=pick]`, options.other);
  await dialogsReach(report.switchAsk.dialogsBefore + 1);
  await page.waitForFunction(([sel, name]) => document.querySelector(sel).value === name,
    [`${EDITOR} [data-kiln=pick]`, options.name], { timeout, polling: 100 });
  report.switchAsk.dismissed = { pick: await page.inputValue(`${EDITOR} [data-kiln=pick]`), dialogs: report.dialogs.length,
    card: (await cardState(image)).state, length: (await cardState(image)).value.length };
  answer = "accept";
  await page.selectOption(`${EDITOR} [data-kiln=pick]`, options.other);
  await page.waitForFunction((sel) => !document.querySelector(sel), cardOf(image), { timeout, polling: 100 });
  report.switchAsk.accepted = { pick: await page.inputValue(`${EDITOR} [data-kiln=pick]`), dialogs: report.dialogs.length,
    cards: await page.$$eval(`${EDITOR} .kds-card`, (c) => c.length) };
  answer = "dismiss";
  await page.selectOption(`${EDITOR} [data-kiln=pick]`, options.name);      // nothing unsaved: no question
  await page.waitForSelector(cardOf(image), { timeout });
  report.switchAsk.back = { dialogs: report.dialogs.length, caption: (await cardState(image)).value,
    server: await serverCaption(options.name, image) };

  // Esc with an unsaved caption asks (dismissed: the editor stays); back to the saved text, Esc closes at once.
  const saved = (await cardState(image)).value;
  await page.fill(`${cardOf(image)} .kds-caption`, `${saved}!`);
  const before = report.dialogs.length;
  await page.keyboard.press("Escape");
  await dialogsReach(before + 1);
  report.closeAsk = { dialogs: report.dialogs.length, open: await page.isVisible(EDITOR) };
  await page.fill(`${cardOf(image)} .kds-caption`, saved);
  await page.keyboard.press("Escape");
  await page.waitForSelector(EDITOR, { state: "hidden", timeout });
  report.closeAsk.closedDialogs = report.dialogs.length;
  // The sidebar's list was reread on closing: it has the new dataset.
  await page.waitForFunction(([sel, name]) => [...document.querySelectorAll(sel)].some((b) => b.textContent.startsWith(`${name} (`)),
    [`${LAUNCHER} [data-kiln=launcher-list] button`, options.name], { timeout, polling: 100 });
  report.launcherAfter = await page.$$eval(`${LAUNCHER} [data-kiln=launcher-list] button`, (b) => b.map((e) => e.textContent));
  report.widths.again = (await openEditor()).editor;
  await page.waitForSelector(cardOf(image), { timeout });

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
  await quality();

  // Every control has a name a screen reader says: its <label>, aria-label, or (a button) its text.
  [report.unlabelled, report.captionLabels] = await page.$eval(EDITOR, (root) => {
    const text = (label) => {        // a label's own words, without the control inside it
      const copy = label.cloneNode(true);
      copy.querySelectorAll("input, select, textarea, button").forEach((control) => control.remove());
      return copy.textContent;
    };
    const name = (e) => (e.getAttribute("aria-label") || [...(e.labels ?? [])].map(text).join(" ") ||
      (e.matches("button, [role=button]") ? e.textContent : "")).trim();
    const controls = [...root.querySelectorAll("input, select, textarea, button, [role=button]")];
    return [controls.filter((e) => !name(e)).map((e) => e.outerHTML.slice(0, 120)), Object.fromEntries(
      [...root.querySelectorAll("[data-kiln=caption] :is(input, select, button)")].map((e) => [e.dataset.kiln, name(e)]))];
  });

  // Thumbnails load lazily (a big dataset loads what is in view): load them all now.
  await page.$$eval(`${EDITOR} .kds-card img`, (images) => images.forEach((i) => { i.loading = "eager"; }));
  await page.waitForFunction((sel) => [...document.querySelectorAll(`${sel} .kds-card img`)].every((i) => i.complete),
    EDITOR, { timeout });
  report.cards = await readCards();

  // A thumbnail enlarges on click; → shows the next image; Esc closes the zoom, not the editor.
  const zoom = `${EDITOR} [data-kiln=zoom]`;
  // The size the image is drawn at (object-fit: contain in its box).
  const box = (sel) => page.$eval(sel, (i) => {
    const r = i.getBoundingClientRect();
    const scale = Math.min(r.width / i.naturalWidth, r.height / i.naturalHeight);
    return [Math.round(i.naturalWidth * scale), Math.round(i.naturalHeight * scale)];
  });
  await page.click(`${cardOf(image)} .kds-thumb`);
  await page.waitForSelector(zoom, { state: "visible", timeout });
  await page.waitForFunction((sel) => document.querySelector(`${sel} img`).complete, zoom, { timeout });
  await page.waitForFunction((sel) => document.querySelector(sel).complete, `${cardOf(image)} img`, { timeout });
  report.zoom = { thumbnail: await box(`${cardOf(image)} img`), shown: await box(`${zoom} img`),
    natural: await page.$eval(`${zoom} img`, (i) => i.naturalWidth), name: await page.textContent(`${zoom} [data-kiln=zoom-name]`) };
  await page.screenshot({ path: path.join(options.out, "dataset_editor_zoom.png") });
  await page.keyboard.press("ArrowRight");
  report.zoom.next = await page.textContent(`${zoom} [data-kiln=zoom-name]`);
  await page.keyboard.press("Escape");
  await page.waitForSelector(zoom, { state: "hidden", timeout });
  report.zoom.editorOpen = await page.isVisible(EDITOR);

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
