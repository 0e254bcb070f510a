// Which prompts this page queued, and from which workflow tab (kiln_queue_core.js keeps the ledger).
// Both frontends (1.41 and 1.49) queue through api.queuePrompt, whose answer names the prompt; the tab is
// the workflow store's active workflow at that moment (its path). The ledger lives in sessionStorage, so a
// page reload (ComfyUI reopens the same tabs) keeps it. A frontend without the workflow store is one tab.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { QueuedPrompts } from "./kiln_queue_core.js";

const STORAGE_KEY = "kiln.queuedPrompts";
const listeners = new Set();

function storage() {
  try {
    return window.sessionStorage;
  } catch {
    return null; // storage blocked: the ledger lasts as long as the page
  }
}

export const queued = QueuedPrompts.parse(storage()?.getItem(STORAGE_KEY));

/** The key of the workflow tab on the canvas: its path ("workflows/Unsaved Workflow (2).json"), or "". */
export function activeWorkflowKey() {
  return app.extensionManager?.workflow?.activeWorkflow?.path ?? "";
}

/** The prompts the tab on the canvas queued. */
export function promptsOfActiveWorkflow() {
  return queued.promptsOf(activeWorkflowKey());
}

/** Hears {type: "queued", promptId, key} | {type: "renamed", from, to} | {type: "closed", key} |
 * {type: "active", key} (another tab is on the canvas). */
export function onQueueChange(listener) {
  listeners.add(listener);
  return () => listeners.delete(listener);
}

function changed(event) {
  try {
    storage()?.setItem(STORAGE_KEY, JSON.stringify(queued));
  } catch {
    // full or blocked storage: the ledger still serves this page
  }
  for (const listener of listeners) listener(event);
}

function wrapQueuePrompt() {
  const original = api.queuePrompt;
  if (typeof original !== "function" || original.kilnQueued) return;
  const wrapped = async function (...args) {
    const key = activeWorkflowKey(); // the tab at the moment of queueing: the user may switch before the answer
    const answer = await original.apply(this, args);
    if (typeof answer?.prompt_id === "string") {
      queued.add(answer.prompt_id, key);
      changed({ type: "queued", promptId: answer.prompt_id, key });
    }
    return answer;
  };
  wrapped.kilnQueued = true;
  api.queuePrompt = wrapped;
}

/** A tab saved under a new name keeps its runs; a closed tab's are forgotten (its name may come back); a
 * switch of tab is announced, for views to show the new tab's runs. All through the workflow store's actions. */
function followTabs() {
  const store = app.extensionManager?.workflow;
  if (typeof store?.$onAction !== "function") return; // no workflow store (Pinia): one tab, nothing to follow
  let active = activeWorkflowKey();
  store.$onAction(({ name, args, after }) => {
    const workflow = args[0];
    const before = workflow?.path;
    after(() => {
      if (name === "renameWorkflow" && typeof before === "string") {
        queued.rename(before, workflow.path);
        changed({ type: "renamed", from: before, to: workflow.path });
      } else if (name === "closeWorkflow" && typeof before === "string") {
        queued.forget(before);
        changed({ type: "closed", key: before });
      }
      if (activeWorkflowKey() === active) return;
      active = activeWorkflowKey();
      changed({ type: "active", key: active });
    });
  });
}

wrapQueuePrompt();

app.registerExtension({
  name: "kiln.queue",
  setup() {
    followTabs();
  },
});
