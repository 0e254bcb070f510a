// Unit tests of the dataset editor's logic (web/kiln_datasets_core.js): node --test tests/web/
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  bulkBody, cardLabel, createBody, datasetPath, shownFile, keepSelected, parseResolutions, problemLines, summary, uploadMessage, viewQuery,
  worst,
} from "../../web/kiln_datasets_core.js";

test("the create form becomes POST /kiln/datasets's body", () => {
  assert.deepEqual(createBody({ name: " faces ", type: "character", trigger_word: " ohwx", resolutions: "512, 768 1024" }),
    { name: "faces", type: "character", trigger_word: "ohwx", resolutions: [512, 768, 1024] });
  assert.equal(parseResolutions(" "), null);
  assert.throws(() => parseResolutions("512, 7x8"), /"7x8" is not a whole number/);
});

test("a bulk edit sends its own fields and the selection", () => {
  assert.deepEqual(bulkBody("prefix", { text: "ohwx", find: "a" }, new Set(["a.png"])),
    { op: "prefix", paths: ["a.png"], text: "ohwx" });
  assert.deepEqual(bulkBody("replace", { find: "a", replace: "b" }, ["x.png"]),
    { op: "replace", paths: ["x.png"], find: "a", replace: "b" });
  assert.throws(() => bulkBody("shout", {}, []), /unknown bulk edit/);
});

test("paths and images are addressed by name under input/", () => {
  assert.equal(datasetPath("my set", "caption"), "/kiln/datasets/my%20set/caption");
  assert.equal(viewQuery("faces", "10_close/a b.png", "7"),
    "/view?filename=a+b.png&subfolder=faces%2F10_close&type=input&v=7");
  assert.equal(viewQuery("faces", "a.png"), "/view?filename=a.png&subfolder=faces&type=input");
});

test("a clip's card shows its first frame and its length; an image's itself and its size", () => {
  const clip = { path: "clips/a.mp4", width: 96, height: 64, frames: 24, seconds: 1.5, thumbnail: ".kiln_cache/thumbnails/ab.jpg" };
  assert.equal(shownFile(clip), ".kiln_cache/thumbnails/ab.jpg");
  assert.equal(cardLabel(clip), "clips/a.mp4 96×64 · 24 frames, 1.5 s");
  assert.equal(shownFile({ path: "b.mp4", thumbnail: null }), "b.mp4");  // unreadable: no picture to show
  assert.equal(shownFile({ path: "a.png" }), "a.png");
  assert.equal(cardLabel({ path: "a.png", width: 10, height: 20 }), "a.png 10×20");
  assert.equal(cardLabel({ path: "bad.png", width: null }), "bad.png");
});

test("problems are shown worst first and summed up", () => {
  const problems = [{ severity: "note", message: "n", fix: "none" }, { severity: "skipped", message: "small", fix: "bigger" }];
  assert.equal(worst(problems), "skipped");
  assert.equal(worst([]), "");
  assert.deepEqual(problemLines(problems), ["skipped: small — fix: bigger", "note: n — fix: none"]);
  const dataset = { trash: 2, images: [{ usable: true, problems: [] }, { usable: false, problems: problems },
    { usable: true, problems: [{ severity: "warning" }] }] };
  assert.equal(summary(dataset), "3 images, 1 skipped, 1 with warnings, 2 in .trash");
  assert.equal(uploadMessage({ added: [{ path: "a.png" }], refused: [{ error: "b.txt: not an image" }] }),
    "added a.png; refused b.txt: not an image");
  assert.deepEqual([...keepSelected(new Set(["a.png", "gone.png"]), [{ path: "a.png" }])], ["a.png"]);
});

test("caption the selection: Caption Images restricted to it, behind the right loader, into Preview Any", async () => {
  const { captionPrompt, promptError } = await import("../../web/kiln_datasets_core.js");
  const florence = captionPrompt({ dataset: "faces", engine: "transformers", model: "Florence-2-base", style: "tags",
    triggerWord: " ohwx ", overwrite: true, paths: new Set(["a.png", "sub/b.png"]) });
  assert.deepEqual(florence, {
    2: { class_type: "KilnCaptionImages", inputs: { folder: "faces", engine: "transformers", style: "tags", prompt: "",
      trigger_word: "ohwx", overwrite: true, max_tokens: 256, seed: 0, only: "a.png\nsub/b.png", model: "Florence-2-base" } },
    3: { class_type: "PreviewAny", inputs: { source: ["2", 1] } } });
  const clip = captionPrompt({ dataset: "faces", engine: "comfyui_clip", clip: "qwen_2.5_vl_7b.safetensors",
    clipType: "qwen_image", paths: ["a.png"], maxTokens: "48" });
  assert.equal(clip[2].inputs.max_tokens, 48);
  assert.deepEqual(clip[1], { class_type: "CLIPLoader", inputs: { clip_name: "qwen_2.5_vl_7b.safetensors", type: "qwen_image" } });
  assert.deepEqual(clip[2].inputs.clip, ["1", 0]);
  assert.equal(clip[2].inputs.overwrite, false);
  assert.throws(() => captionPrompt({ dataset: "f", engine: "transformers", paths: [] }), /select the images/);
  assert.throws(() => captionPrompt({ dataset: "f", engine: "transformers", paths: ["a.png"], where: "put one in X" }),
    /no captioner in models\/LLM\/: put one in X/);
  assert.throws(() => captionPrompt({ dataset: "f", engine: "comfyui_clip", paths: ["a.png"] }), /models\/text_encoders/);
  assert.equal(promptError({ error: { message: "Prompt outputs failed validation" }, node_errors: { 2: { class_type:
    "KilnCaptionImages", errors: [{ message: "Value not in list", details: "model: 'x' not in []" }] } } }),
    "Prompt outputs failed validation; KilnCaptionImages: Value not in list (model: 'x' not in [])");
});

test("verdicts: the card's line, and which cards the 'only problems' filter keeps", async () => {
  const { hasProblems, verdictText } = await import("../../web/kiln_datasets_core.js");
  assert.equal(verdictText({ path: "a b.png", line: "a b.png 64x64 [64: 64x64] ok" }), "64x64 [64: 64x64] ok");
  assert.equal(hasProblems({ problems: [] }, { ok: true }), false);
  assert.equal(hasProblems({ problems: [] }, { ok: false }), true);
  assert.equal(hasProblems({ problems: [{ severity: "warning" }] }, undefined), true);
  assert.equal(hasProblems({ problems: [] }, undefined), false);
});

test("Caption Images' report becomes the status line, without the server's folder path", async () => {
  const { captionSummary } = await import("../../web/kiln_datasets_core.js");
  assert.equal(captionSummary("note: Florence-2 takes task tokens\n/srv/input/faces: 2 captions written, 1 old caption(s) kept as .bak\n  a.txt: ohwx, a cat"),
    "2 captions written, 1 old caption(s) kept as .bak");
  assert.equal(captionSummary("C:\\in: x: 1 caption written\n  a.txt: y\n1 file(s) not captioned:\n  [truncated] b.png: cut"),
    "1 caption written\n1 file(s) not captioned:\n[truncated] b.png: cut");
});

test("a card lists each problem once: the scan's, then the quality pass's own", async () => {
  const { cardProblems } = await import("../../web/kiln_datasets_core.js");
  const missing = { code: "caption_missing", severity: "warning", message: "no caption file a.txt", fix: "write one" };
  const image = { path: "a.png", problems: [missing, { code: "converted", severity: "note", message: "CMYK", fix: "none" }] };
  // The verdict repeats the scan's warning (same code) and adds the quality pass's own.
  const verdict = { path: "a.png", ok: false, problems: ["caption_missing", "blurry", "blurry"],
    messages: ["no caption file a.txt", "soft", "soft"], fixes: ["write one", "retake it", "retake it"] };
  const listed = cardProblems(image, verdict);
  assert.deepEqual(listed.map((p) => p.code), ["caption_missing", "blurry", "converted"]);
  assert.deepEqual(listed[1], { code: "blurry", severity: "warning", message: "soft", fix: "retake it" });
  assert.deepEqual(cardProblems(image, null).map((p) => p.code), ["caption_missing", "converted"]);
  assert.deepEqual(cardProblems({ problems: [] }, { problems: ["near_duplicate"], messages: [], fixes: [] }),
    [{ code: "near_duplicate", severity: "warning", message: "near_duplicate", fix: "" }]);
});

test("a card's verdict line keeps the size, the buckets, ok and the keep note, not the problems again", async () => {
  const { verdictHead } = await import("../../web/kiln_datasets_core.js");
  assert.equal(verdictHead({ size: [96, 80], buckets: ["64: 64x48 crop 0x5"], ok: true, note: "" }), "96x80 [64: 64x48 crop 0x5] ok");
  assert.equal(verdictHead({ size: [192, 128], buckets: ["64: 96x64", "512: none, too small"], ok: false,
    problems: ["near_duplicate"] }), "192x128 [64: 96x64, 512: none, too small]");
  assert.equal(verdictHead({ size: [8, 8], buckets: [], ok: false, note: "near-duplicate of b.png; keep this one" }),
    "8x8 — near-duplicate of b.png; keep this one");
});

test("Enter saves a caption; Shift+Enter, a composing IME and modified Enter do not", async () => {
  const { captionKey } = await import("../../web/kiln_datasets_core.js");
  assert.equal(captionKey({ key: "Enter" }), "save");
  assert.equal(captionKey({ key: "Enter", shiftKey: true }), null);
  assert.equal(captionKey({ key: "Enter", isComposing: true }), null);
  assert.equal(captionKey({ key: "Enter", ctrlKey: true }), null);
  assert.equal(captionKey({ key: "a" }), null);
});

test("dropping unsaved captions asks, naming them; nothing unsaved asks nothing", async () => {
  const { unsavedQuestion } = await import("../../web/kiln_datasets_core.js");
  assert.equal(unsavedQuestion(new Map(), "open faces"), null);
  const one = unsavedQuestion(new Map([["a.png", "x"]]), "open faces");
  assert.match(one, /^The caption of a\.png is not saved\. Discard it and open faces\?/);
  const many = unsavedQuestion(new Map(["a", "b", "c", "d", "e"].map((n) => [`${n}.png`, n])), "close the editor");
  assert.match(many, /^5 captions are not saved \(a\.png, b\.png, c\.png and 2 more\)\. Discard them and close the editor\?/);
});

test("the zoom's arrows wrap around the gallery", async () => {
  const { zoomStep } = await import("../../web/kiln_datasets_core.js");
  assert.equal(zoomStep(0, -1, 3), 2);
  assert.equal(zoomStep(2, 1, 3), 0);
  assert.equal(zoomStep(1, 1, 3), 2);
  assert.equal(zoomStep(0, 1, 0), -1);
});
