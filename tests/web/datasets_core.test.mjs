// Unit tests of the dataset editor's logic (web/kiln_datasets_core.js): node --test tests/web/
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  bulkBody, createBody, datasetPath, keepSelected, parseResolutions, problemLines, summary, uploadMessage, viewQuery,
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
