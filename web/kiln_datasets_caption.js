// The dataset editor's "Caption selected" row (web/kiln_datasets.js): captions the selected images with Kiln
// Caption Images' engines by queueing a small prompt on ComfyUI's own queue (POST /prompt: Load CLIP or a
// models/LLM/ captioner → Kiln Caption Images restricted to the selection → Preview Any), so progress, the
// Stop button and one GPU job at a time are ComfyUI's. The gallery reloads when the prompt ends (ComfyUI's
// websocket events, with /history polled in case they do not reach this tab). GET /kiln/captioners says what
// the node would offer; the prompt itself is built by captionPrompt (kiln_datasets_core.js).
import { api } from "../../scripts/api.js";
import { captionPrompt, captionSummary, promptError } from "./kiln_datasets_core.js";
import { el, field } from "./kiln_datasets_view.js";

const POLL_MS = 2000;

function option(value, text = value) {
  const node = document.createElement("option");
  node.value = value;
  node.textContent = text;
  return node;
}

function labelled(title, input) {
  input.title = title;                 // the longer why, on hover; each control also has a visible label
  return input;
}

/** The report text a finished prompt's Caption Images (or Preview Any) showed, from an `executed` output. */
function reportText(output) {
  const text = output?.text;
  return Array.isArray(text) ? text.join("\n") : (typeof text === "string" ? text : "");
}

export class CaptionRow {
  /** editor: { dataset, selected (Set of paths), run(action), say(text, error), reload(message) }. */
  constructor(editor, choices) {
    this.editor = editor;
    this.choices = choices;
    const make = (tag, props = {}) => Object.assign(document.createElement(tag), props);
    this.engine = labelled("Caption Images' engine", make("select"));
    this.engine.append(...choices.engines.map((e) => option(e)));
    this.engine.value = choices.models.length || !choices.clips.length ? "transformers" : "comfyui_clip";
    this.model = labelled("A captioner under models/LLM/", make("select"));
    this.model.append(...(choices.models.length ? choices.models.map((m) => option(m)) : [option("", "(none in models/LLM)")]));
    this.clip = labelled("A vision-language text encoder (Load CLIP)", make("select"));
    this.clip.append(...(choices.clips.length ? choices.clips.map((c) => option(c)) : [option("", "(no text encoders)")]));
    this.clipType = labelled("Load CLIP's type for it", make("select"));
    this.clipType.append(...choices.clip_types.map((t) => option(t)));
    if (choices.clip_types.includes("qwen_image")) this.clipType.value = "qwen_image";
    this.style = labelled("Caption style", make("select"));
    this.style.append(...Object.entries(choices.styles).map(([name, about]) => option(name, `${name} (${about})`)));
    this.trigger = labelled("Put in front of every caption written", make("input", { placeholder: "trigger word" }));
    this.trigger.value = editor.dataset?.meta?.trigger_word ?? "";
    this.maxTokens = labelled("Longest caption, in tokens", make("input", { type: "number", min: 8, max: 4096, value: 256 }));
    this.overwrite = labelled("Caption images that have a caption too (the old one is kept as .txt.bak)",
      make("input", { type: "checkbox" }));
    this.button = make("button", { type: "button", textContent: "Caption selected" });
    this.hint = make("span", { className: "kds-hint", textContent: choices.models.length ? "" : `transformers: ${choices.where}` });
    for (const [node, name] of [[this.engine, "caption-engine"], [this.model, "caption-model"], [this.clip, "caption-clip"],
      [this.clipType, "caption-clip-type"], [this.style, "caption-style"], [this.trigger, "caption-trigger"], [this.maxTokens, "caption-max-tokens"],
      [this.overwrite, "caption-overwrite"], [this.button, "caption-run"], [this.hint, "caption-hint"]]) node.dataset.kiln = name;
    this.engine.addEventListener("change", () => this.showEngine());
    this.button.addEventListener("click", () => this.editor.run(() => this.queue()));
    this.fields = { model: field("captioner (models/LLM)", this.model), clip: field("text encoder", this.clip),
      clipType: field("CLIP type", this.clipType) };
    this.element = el("fieldset", { kiln: "caption" }, el("legend", { textContent: "Caption selected images" }),
      field("engine", this.engine), this.fields.model, this.fields.clip, this.fields.clipType, field("style", this.style),
      field("trigger word", this.trigger), field("max tokens", this.maxTokens),
      el("label", { className: "kds-inline" }, this.overwrite, "overwrite existing captions"), this.button, this.hint);
    this.showEngine();
  }

  showEngine() {
    const clip = this.engine.value === "comfyui_clip";
    this.fields.model.hidden = clip;
    this.hint.hidden = clip;
    this.fields.clip.hidden = !clip;
    this.fields.clipType.hidden = !clip;
  }

  /** Queue the prompt; the status line follows it until it ends, then the gallery reloads. */
  async queue() {
    const name = this.editor.dataset.name;
    const paths = [...this.editor.selected];
    const prompt = captionPrompt({ dataset: name, engine: this.engine.value, model: this.model.value, clip: this.clip.value,
      clipType: this.clipType.value, style: this.style.value, triggerWord: this.trigger.value, overwrite: this.overwrite.checked,
      paths, where: this.choices.where, maxTokens: this.maxTokens.value });
    const response = await api.fetchApi("/prompt", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ prompt, client_id: api.clientId ?? api.initialClientId }) });
    const body = await response.json().catch(() => ({}));
    if (!response.ok || !body.prompt_id) throw new Error(`ComfyUI refused the caption prompt: ${promptError(body)}`);
    this.follow(body.prompt_id, name, paths.length);
    return `queued: captioning ${paths.length} image(s) of ${name} on ComfyUI's queue (Stop there cancels it)`;
  }

  follow(promptId, name, count) {
    let report = "";
    let ended = false;
    const mine = (event) => event.detail?.prompt_id === promptId;
    const listeners = {
      executed: (event) => { if (mine(event)) report = reportText(event.detail.output) || report; },
      progress: (event) => {
        if (mine(event)) this.editor.say(`captioning ${name}: ${event.detail.value}/${event.detail.max}`);
      },
      execution_success: (event) => { if (mine(event)) end(report ? captionSummary(report) : `captioned ${count} image(s)`, false); },
      execution_error: (event) => {
        if (mine(event)) end(`captioning failed: ${event.detail.exception_message ?? "see ComfyUI's console"}`, true);
      },
      execution_interrupted: (event) => {
        if (mine(event)) end("captioning stopped; the captions written before the stop are kept", true);
      },
    };
    const poll = setInterval(async () => {
      const history = await api.fetchApi(`/history/${promptId}`).then((r) => r.json()).catch(() => ({}));
      const entry = history?.[promptId];
      if (!entry?.status?.completed && entry?.status?.status_str !== "error") return;
      const text = Object.values(entry.outputs ?? {}).map(reportText).find(Boolean);
      end(text ? captionSummary(text) : `captioning ${entry.status.status_str}`, entry.status.status_str === "error");
    }, POLL_MS);
    const end = (message, error) => {
      if (ended) return;
      ended = true;
      clearInterval(poll);
      for (const [type, listener] of Object.entries(listeners)) api.removeEventListener(type, listener);
      const reload = this.editor.dataset?.name === name ? this.editor.reload(message) : Promise.resolve(message);
      reload.then((text) => this.editor.say(text, error), (e) => this.editor.say(e.message, true));
    };
    for (const [type, listener] of Object.entries(listeners)) api.addEventListener(type, listener);
  }
}
