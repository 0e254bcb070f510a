// Kiln nodes' text reports, as a pure ES module (no DOM, no ComfyUI imports; `node --test tests/web/` checks it).
// A Kiln node returns its report as ui.PreviewText: the executed message's output is {text: ["…"]}.
// kiln_reports.js draws it on the node; this module reads it, sizes its box and keeps it per workflow tab.

export const KEEP_REPORTS = 120; // newest reports remembered across tabs (sessionStorage stays small)
export const MAX_REPORT_CHARS = 20000; // a report longer than this is cut (a dataset check of thousands of files)

/** Kiln's node types, the ones whose reports are drawn (ComfyUI's own nodes draw their own outputs). */
export function isKilnNodeType(type) {
  return typeof type === "string" && type.startsWith("Kiln");
}

/** The report in an executed message's output, or null where it has none. */
export function reportText(output) {
  const text = output?.text;
  const parts = typeof text === "string" ? [text] : Array.isArray(text) ? text : [];
  if (!parts.length || !parts.every((part) => typeof part === "string")) return null;
  const joined = parts.join("\n\n"); // several parts (a list output) as ComfyUI's Preview Any shows them
  return joined.length > MAX_REPORT_CHARS ? `${joined.slice(0, MAX_REPORT_CHARS)}\n…` : joined;
}

/** Rows `line` takes in a box `columns` characters wide: words wrap whole, a word longer than a row (a path)
 * breaks anywhere, as the box's CSS (pre-wrap, overflow-wrap: anywhere) lays it out. */
export function wrappedRows(line, columns) {
  let rows = 1;
  let used = 0;
  for (const word of line.split(" ")) {
    const need = used ? used + 1 + word.length : word.length;
    if (need <= columns) {
      used = need;
      continue;
    }
    if (used) rows += 1;
    rows += Math.max(0, Math.ceil(word.length / columns) - 1);
    used = word.length % columns || Math.min(word.length, columns);
  }
  return rows;
}

/**
 * Pixel height of a report's box: its rows at `columns` characters (wrapped) times `lineHeight`, between
 * `min` and `max` (a longer report scrolls inside the box).
 */
export function reportHeight(text, { columns = 40, lineHeight = 15, padding = 12, min = 30, max = 220 } = {}) {
  const width = Math.max(1, Math.floor(columns));
  const rows = String(text).split("\n").reduce((sum, line) => sum + wrappedRows(line, width), 0);
  return Math.min(max, Math.max(min, rows * lineHeight + padding));
}

/** workflow tab key → node id → the node's newest report; the oldest entries go past KEEP_REPORTS. */
export class Reports {
  constructor(entries = []) {
    this.entries = new Map(); // JSON [key, node id] → [key, node id, text]
    for (const [key, nodeId, text] of entries) this.set(key, nodeId, text);
  }

  set(key, nodeId, text) {
    if (typeof key !== "string" || typeof text !== "string") return;
    const id = JSON.stringify([key, String(nodeId)]);
    this.entries.delete(id);
    this.entries.set(id, [key, String(nodeId), text]);
    while (this.entries.size > KEEP_REPORTS) this.entries.delete(this.entries.keys().next().value);
  }

  get(key, nodeId) {
    return this.entries.get(JSON.stringify([key, String(nodeId)]))?.[2];
  }

  rename(from, to) {
    if (from === to || typeof to !== "string") return;
    const moved = [...this.entries.values()].filter(([key]) => key === from);
    this.forget(from);
    for (const [, nodeId, text] of moved) this.set(to, nodeId, text);
  }

  forget(key) {
    for (const [id, [owner]] of [...this.entries]) if (owner === key) this.entries.delete(id);
  }

  toJSON() {
    return [...this.entries.values()];
  }

  static parse(text) {
    try {
      const entries = JSON.parse(text ?? "[]");
      return new Reports(Array.isArray(entries) ? entries.filter((e) => Array.isArray(e) && e.length === 3) : []);
    } catch {
      return new Reports();
    }
  }
}
