// Unit tests for web/kiln_queue_core.js (run: node --test tests/web/): which prompts each workflow tab queued.
import assert from "node:assert/strict";
import { test } from "node:test";

import { KEEP_PROMPTS, QueuedPrompts } from "../../web/kiln_queue_core.js";

test("each prompt belongs to the tab that queued it", () => {
  const queued = new QueuedPrompts();
  queued.add("p1", "workflows/a.json");
  queued.add("p2", "workflows/b.json");
  queued.add("p3", "workflows/a.json");
  assert.deepEqual([...queued.promptsOf("workflows/a.json")], ["p1", "p3"]);
  assert.deepEqual([...queued.promptsOf("workflows/c.json")], []);
  assert.equal(queued.workflowOf("p2"), "workflows/b.json");
  assert.equal(queued.workflowOf("from-the-api"), undefined);
  assert.equal(queued.has("p1"), true);
  assert.equal(queued.has("p9"), false);
});

test("a renamed tab keeps its prompts; a closed tab's are forgotten, so a new tab of that name starts empty", () => {
  const queued = new QueuedPrompts([["p1", "workflows/Unsaved Workflow (2).json"], ["p2", "workflows/b.json"]]);
  queued.rename("workflows/Unsaved Workflow (2).json", "workflows/mine.json");
  assert.deepEqual([...queued.promptsOf("workflows/mine.json")], ["p1"]);
  assert.deepEqual([...queued.promptsOf("workflows/Unsaved Workflow (2).json")], []);
  queued.forget("workflows/mine.json");
  assert.equal(queued.has("p1"), false);
  assert.equal(queued.workflowOf("p2"), "workflows/b.json");
});

test("only the newest prompts are kept", () => {
  const queued = new QueuedPrompts();
  for (let i = 0; i < KEEP_PROMPTS + 5; i += 1) queued.add(`p${i}`, "w");
  assert.equal(queued.promptsOf("w").size, KEEP_PROMPTS);
  assert.equal(queued.has("p4"), false);
  assert.equal(queued.has(`p${KEEP_PROMPTS + 4}`), true);
  queued.add("p5", "w"); // queued again: the newest now, kept past the next trim
  queued.add("extra", "w");
  assert.equal(queued.has("p5"), true);
  assert.equal(queued.has("p6"), false);
});

test("the ledger round-trips through sessionStorage's text; junk gives an empty one", () => {
  const queued = new QueuedPrompts([["p1", "a"], ["p2", ""]]);
  const back = QueuedPrompts.parse(JSON.stringify(queued));
  assert.deepEqual(back.toJSON(), [["p1", "a"], ["p2", ""]]);
  for (const junk of [null, "", "{", "{}", "[1, [2]]", '[["p", 3]]']) {
    assert.deepEqual(QueuedPrompts.parse(junk).toJSON(), [], String(junk));
  }
});
