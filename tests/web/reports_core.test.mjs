// Unit tests for web/kiln_reports_core.js (run: node --test tests/web/): Kiln nodes' text reports.
import assert from "node:assert/strict";
import { test } from "node:test";

import { KEEP_REPORTS, MAX_REPORT_CHARS, Reports, isKilnNodeType, reportHeight, reportText, wrappedRows }
  from "../../web/kiln_reports_core.js";

test("a report is the executed output's text (ui.PreviewText sends a list of one)", () => {
  assert.equal(reportText({ text: ["saved kiln/a.safetensors"] }), "saved kiln/a.safetensors");
  assert.equal(reportText({ text: "plain" }), "plain");
  assert.equal(reportText({ text: ["one", "two"] }), "one\n\ntwo");
  for (const none of [undefined, null, {}, { images: [{}] }, { text: [] }, { text: [1] }, { text: ["a", null] }]) {
    assert.equal(reportText(none), null, JSON.stringify(none));
  }
  const long = reportText({ text: ["x".repeat(MAX_REPORT_CHARS + 50)] });
  assert.equal(long.length, MAX_REPORT_CHARS + 2);
  assert.ok(long.endsWith("\n…"));
});

test("only Kiln's node types get a report box", () => {
  assert.equal(isKilnNodeType("KilnSaveLoRA"), true);
  assert.equal(isKilnNodeType("PreviewAny"), false);
  assert.equal(isKilnNodeType(undefined), false);
});

test("rows: words wrap whole, a path longer than a row breaks anywhere", () => {
  assert.equal(wrappedRows("", 10), 1);
  assert.equal(wrappedRows("a b c", 5), 1);
  assert.equal(wrappedRows("a b c", 3), 2);
  assert.equal(wrappedRows("abcdefghij", 4), 3); // abcd efgh ij
  assert.equal(wrappedRows("ab abcdefghij", 4), 4); // ab abcd efgh ij
  assert.equal(wrappedRows("saved /tmp/base/models/loras/kiln_test/tiny_flux2.safetensors (comfy, bf16)", 40), 3);
});

test("the box fits the report's rows, within its bounds", () => {
  assert.equal(reportHeight("one line", { columns: 40, lineHeight: 15, padding: 12, min: 10 }), 27);
  assert.equal(reportHeight("a\nb\nc", { columns: 40, lineHeight: 15, padding: 12 }), 57);
  assert.equal(reportHeight("x", { min: 30 }), 30);
  assert.equal(reportHeight("line\n".repeat(100), { max: 220 }), 220); // a long report scrolls in its box
  assert.ok(reportHeight("x".repeat(200), { columns: 20 }) > reportHeight("x".repeat(200), { columns: 100 }));
});

test("reports are kept per workflow tab and node; a renamed tab keeps them, a closed one loses them", () => {
  const reports = new Reports();
  reports.set("workflows/a.json", 9, "saved a");
  reports.set("workflows/b.json", "9", "saved b");
  assert.equal(reports.get("workflows/a.json", "9"), "saved a");
  assert.equal(reports.get("workflows/b.json", 9), "saved b");
  assert.equal(reports.get("workflows/c.json", 9), undefined);
  reports.set("workflows/a.json", 9, "saved again");
  assert.equal(reports.get("workflows/a.json", 9), "saved again");
  reports.rename("workflows/a.json", "workflows/mine.json");
  assert.equal(reports.get("workflows/mine.json", 9), "saved again");
  assert.equal(reports.get("workflows/a.json", 9), undefined);
  reports.forget("workflows/b.json");
  assert.equal(reports.get("workflows/b.json", 9), undefined);
  assert.equal(Reports.parse(JSON.stringify(reports)).get("workflows/mine.json", 9), "saved again");
  for (const junk of [null, "x", "{}", '[["a", 1]]']) assert.deepEqual(Reports.parse(junk).toJSON(), []);
});

test("only the newest reports are kept", () => {
  const reports = new Reports();
  for (let i = 0; i < KEEP_REPORTS + 3; i += 1) reports.set("w", i, `r${i}`);
  assert.equal(reports.toJSON().length, KEEP_REPORTS);
  assert.equal(reports.get("w", 0), undefined);
  assert.equal(reports.get("w", KEEP_REPORTS + 2), `r${KEEP_REPORTS + 2}`);
});
