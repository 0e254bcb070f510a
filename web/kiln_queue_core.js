// Which prompts each workflow tab queued, as a pure ES module (no DOM, no ComfyUI imports; `node --test
// tests/web/` checks it). kiln_queue.js fills it from the frontend; a Train LoRA node's dashboard and every
// Kiln node's report show only what their own tab queued: node ids repeat across workflows (three templates
// share one), so a node id alone would show another tab's run.

export const KEEP_PROMPTS = 200; // newest prompts remembered (a session's worth; older runs stay in the sidebar)

/** prompt id → the key of the workflow tab that queued it (its path; "" where the frontend has no tabs). */
export class QueuedPrompts {
  constructor(entries = []) {
    this.byPrompt = new Map();
    for (const [promptId, key] of entries) this.add(promptId, key);
  }

  add(promptId, key) {
    if (typeof promptId !== "string" || !promptId || typeof key !== "string") return;
    this.byPrompt.delete(promptId); // re-added: it becomes the newest
    this.byPrompt.set(promptId, key);
    while (this.byPrompt.size > KEEP_PROMPTS) this.byPrompt.delete(this.byPrompt.keys().next().value);
  }

  has(promptId) {
    return this.byPrompt.has(promptId);
  }

  /** The workflow key that queued `promptId`; undefined for a prompt queued elsewhere (another page, the API). */
  workflowOf(promptId) {
    return this.byPrompt.get(promptId);
  }

  promptsOf(key) {
    return new Set([...this.byPrompt].filter(([, owner]) => owner === key).map(([promptId]) => promptId));
  }

  /** A tab saved under a new name keeps its runs. */
  rename(from, to) {
    if (from === to || typeof to !== "string") return;
    for (const [promptId, owner] of this.byPrompt) if (owner === from) this.byPrompt.set(promptId, to);
  }

  /** A closed tab's runs: a later tab of the same name (ComfyUI reuses "Unsaved Workflow (2)") starts idle. */
  forget(key) {
    for (const [promptId, owner] of [...this.byPrompt]) if (owner === key) this.byPrompt.delete(promptId);
  }

  toJSON() {
    return [...this.byPrompt];
  }

  /** From toJSON()'s text (sessionStorage); anything else gives an empty ledger. */
  static parse(text) {
    try {
      const entries = JSON.parse(text ?? "[]");
      return new QueuedPrompts(Array.isArray(entries) ? entries.filter((e) => Array.isArray(e) && e.length === 2) : []);
    } catch {
      return new QueuedPrompts();
    }
  }
}
