"""Kiln Caption Images: a .txt caption beside each image of a dataset folder, written by a vision-language
model (ComfyUI's own text encoder on the clip input, or a transformers captioner from models/LLM/)."""

from __future__ import annotations

from comfy_api.latest import io, ui

from ..trainer.data.captioning import jobs as captioning
from ..trainer.data.captioning.models import WHERE, list_models, resolve_model
from .comfy import bridge
from .input_folders import resolve_folder
from .widgets import CATEGORY, checked

NO_MODEL = "(none in models/LLM)"


def _clip_engine(clip, model, style, max_tokens, seed):
    if clip is None:
        raise ValueError(
            "Kiln Caption Images: the comfyui_clip engine needs a vision-language text encoder on the "
            "`clip` input (Load CLIP, e.g. Qwen2.5-VL 7B with type qwen_image)"
        )
    return (
        f"comfyui_clip:{type(getattr(clip, 'tokenizer', clip)).__name__}",
        lambda: bridge.clip_captioner(clip, max_tokens=max_tokens, seed=seed),
    )


def _transformers_engine(clip, model, style, max_tokens, seed):
    folder = resolve_model("" if model == NO_MODEL else model, bridge.caption_model_folders())
    return (
        f"transformers:{folder.resolve()}",
        lambda: bridge.device_captioner(folder, style=style, max_tokens=max_tokens, seed=seed),
    )


# engine → (clip, model, style, max_tokens, seed) -> (identity, build() -> caption(image, prompt) -> str)
ENGINES = {"comfyui_clip": _clip_engine, "transformers": _transformers_engine}


def caption_models() -> list[str]:
    """The model combo: folders under models/LLM/ (a placeholder when there are none)."""
    return list_models(bridge.caption_model_folders()) or [NO_MODEL]


def caption_choices() -> dict:
    """What Caption Images offers, for the dataset editor (GET /kiln/captioners): its engines, the models in
    models/LLM/ (and where to put one when there is none), Load CLIP's text encoder files and types, styles."""
    return {
        "engines": list(ENGINES),
        "models": list_models(bridge.caption_model_folders()),
        "where": WHERE,
        **bridge.clip_loader_choices(),
        "styles": {name: s.description for name, s in captioning.STYLES.items()},
    }


def model_inputs() -> list:
    """Which folder, and the model that captions it."""
    models = caption_models()
    return [
        io.String.Input(
            "folder",
            default="",
            tooltip="The dataset folder, as in Kiln Load Dataset: a name under ComfyUI's input/ (the 'choose a "
            "dataset…' button lists them) or an absolute path.",
        ),
        io.Combo.Input(
            "engine",
            options=list(ENGINES),
            default="comfyui_clip",
            tooltip="comfyui_clip: ComfyUI's own vision-language text encoder on the clip input (e.g. Qwen2.5-VL, "
            "Qwen3-VL, Gemma 3; Flux2's and Z-Image's are text-only). transformers: a captioner from models/LLM/ "
            "(e.g. Florence-2).",
        ),
        io.Clip.Input(
            "clip",
            optional=True,
            tooltip="For the comfyui_clip engine: a vision-language text encoder (Load CLIP). Not used by the "
            "transformers engine.",
        ),
        io.Combo.Input(
            "model",
            options=models,
            default=models[0],
            optional=True,
            tooltip=f"For the transformers engine: a model folder under models/LLM/; {WHERE}.",
        ),
    ]


def writing_inputs() -> list:
    """What to ask the model, and what to write."""
    return [
        io.Combo.Input(
            "style",
            options=list(captioning.STYLES),
            default="short",
            tooltip="; ".join(f"{name}: {style.description}" for name, style in captioning.STYLES.items()),
        ),
        io.String.Input(
            "prompt",
            default="",
            multiline=True,
            tooltip="The instruction to the model. Empty: the style's own prompt. (Florence-2 takes task tokens "
            "such as <CAPTION>.)",
        ),
        io.String.Input(
            "trigger_word",
            default="",
            tooltip="Put in front of every caption written (unless the caption already has it).",
        ),
        io.Boolean.Input(
            "overwrite",
            default=False,
            tooltip="Caption every image, not only those without a caption; each old caption is kept as "
            "<name>.txt.bak.",
        ),
        io.Int.Input("max_tokens", default=256, min=8, max=4096, tooltip="Longest caption, in tokens."),
        io.Int.Input(
            "seed",
            default=0,
            min=0,
            max=0xFFFFFFFFFFFFFFFF,
            control_after_generate=False,
            tooltip="Generation seed, the same for every image (a re-run writes the same captions).",
        ),
        io.String.Input(
            "only",
            default="",
            multiline=True,
            optional=True,
            tooltip="Caption only these images: paths relative to the folder, one a line (the dataset editor's "
            "'Caption selected' fills it). Empty: every image.",
        ),
    ]


class KilnCaptionImages(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnCaptionImages",
            display_name="Kiln Caption Images",
            category=f"{CATEGORY}/data",
            description="Write a .txt caption beside each image of a dataset folder that has none (or every "
            "image, with overwrite), with a vision-language model. Resumable: a re-run continues "
            "where a stopped one ended. Images Load Dataset would skip are skipped and listed.",
            inputs=[*model_inputs(), *writing_inputs()],
            outputs=[
                io.String.Output(
                    display_name="folder",
                    tooltip="The folder, to wire into Kiln Load Dataset's "
                    "folder (it then runs after the captions are written)",
                ),
                io.String.Output(display_name="report", tooltip="What was written, kept and skipped"),
            ],
        )

    @classmethod
    def validate_inputs(cls, folder=None):
        return checked(lambda text: resolve_folder(text, "Kiln Caption Images"), folder)

    @classmethod
    def fingerprint_inputs(cls, folder, only="", **kwargs):
        # Re-run when an image or a caption file comes or goes; the captions it writes itself do not count.
        # A selection (the editor's) runs whenever it is queued: the user asked for those images again.
        if captioning.parse_only(only):
            return float("nan")
        try:
            return captioning.folder_state(resolve_folder(folder, "Kiln Caption Images"))
        except ValueError:
            return float("nan")

    @classmethod
    def execute(
        cls,
        folder,
        engine,
        style,
        prompt,
        trigger_word,
        overwrite,
        max_tokens,
        seed,
        clip=None,
        model=NO_MODEL,
        only="",
    ):
        root = resolve_folder(folder, "Kiln Caption Images")
        if engine not in ENGINES:
            raise ValueError(f"Kiln Caption Images: engine {engine!r} is not one of {list(ENGINES)}")
        identity, build = ENGINES[engine](clip, model, style, max_tokens, seed)
        job = captioning.CaptionJob(
            style=style,
            prompt=prompt,
            trigger_word=trigger_word,
            overwrite=overwrite,
            engine=identity,
            only=captioning.parse_only(only),
        )
        try:
            todo, report = captioning.plan(root, job)
        except ValueError as err:  # `only` names an image that is not there
            raise ValueError(f"Kiln Caption Images: {err}") from None
        note = ""
        if todo:  # the model is loaded only when there is something to caption
            caption = build()
            note = getattr(caption, "note", "")
            bar = bridge.progress(len(todo))
            try:
                report = captioning.caption_folder(root, caption, job, progress=lambda done, total: bar.update(done))
            finally:
                del caption
                bridge.free_memory()
        text = (f"note: {note}\n" if note else "") + report.text()
        return io.NodeOutput(folder, text, ui=ui.PreviewText(text))
