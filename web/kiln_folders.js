// Folder pickers: a "choose…" button under Kiln Load Dataset's and Kiln Caption Images' `folder` and Kiln
// Load Run's `run_folder`
// that lists what exists (datasets under ComfyUI's input/, runs with a checkpoint under output/kiln/, from
// GET /kiln/folders/{datasets,runs}) and types the picked name into the text field. The field stays a
// text field, so an absolute path or a folder made after the list was read can still be typed.
//
// The button is not part of the workflow: it is never serialized (saved workflows keep their
// widgets_values) and never sent in a prompt; it sits after the node's own widgets, so nothing shifts.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const DATASET_PICKER = {
  widget: "folder",
  kind: "datasets",
  label: "choose a dataset…",
  title: "Datasets in ComfyUI's input/",
  none: "no dataset yet: put a folder of images with .txt captions in ComfyUI's input/",
};

export const PICKERS = {
  KilnLoadDataset: DATASET_PICKER,
  KilnCaptionImages: DATASET_PICKER,
  KilnLoadRun: {
    widget: "run_folder",
    kind: "runs",
    label: "choose a run…",
    title: "Runs in output/kiln/ (newest first)",
    none: "no run with a checkpoint in output/kiln/ yet: train one with Kiln Train LoRA",
  },
};

async function listFolders(kind) {
  const response = await api.fetchApi(`/kiln/folders/${kind}`, { cache: "no-store" });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(body.error ?? `HTTP ${response.status}`);
  return body.folders ?? [];
}

function choose(node, target, name) {
  target.value = name;
  target.callback?.(name, app.canvas, node);
  node.setDirtyCanvas?.(true, true);
  app.graph?.change?.();
}

async function openMenu(node, target, picker, event) {
  let entries;
  try {
    const folders = await listFolders(picker.kind);
    entries = folders.length
      ? folders.map((folder) => ({
          content: `${folder.name}   (${folder.detail})`,
          callback: () => choose(node, target, folder.name),
        }))
      : [{ content: picker.none, disabled: true }];
  } catch (error) {
    console.warn("[Kiln] could not list folders", error);
    entries = [{ content: `could not list the folders: ${error.message}`, disabled: true }];
  }
  const LiteGraph = window.LiteGraph;
  const at = event instanceof MouseEvent ? event : new MouseEvent("click", {
    clientX: app.canvas?.last_mouse?.[0] ?? 100, clientY: app.canvas?.last_mouse?.[1] ?? 100 });
  new LiteGraph.ContextMenu(entries, { event: at, title: picker.title, className: "kiln-folder-menu" });
}

function addPicker(node, picker) {
  const target = node.widgets?.find((widget) => widget.name === picker.widget);
  if (!target) return;
  const button = node.addWidget("button", picker.label, null,
    (value, canvas, n, pos, event) => openMenu(node, target, picker, event), { serialize: false });
  button.serialize = false;     // not in the workflow's widgets_values
  button.kilnPicker = picker.kind;
}

app.registerExtension({
  name: "kiln.folders",
  nodeCreated(node) {
    const picker = PICKERS[node.comfyClass];
    if (picker) addPicker(node, picker);
  },
});
