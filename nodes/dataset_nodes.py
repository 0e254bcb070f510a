"""Caption Images → Load Dataset → Encode Images → Encode Captions: a folder becomes cached latents and
embeddings."""
from __future__ import annotations

import os
from pathlib import Path

from comfy_api.latest import io, ui

from ..trainer.archs import dataset_divisor
from ..trainer.data.captioning import jobs as captioning
from ..trainer.data.captioning.models import WHERE, list_models, resolve_model
from ..trainer.data.captions import CaptionSettings
from ..trainer.data.dataset import Dataset, DataSettings, folder_fingerprint
from ..trainer.errors import did_you_mean
from .comfy import bridge
from .widgets import CATEGORY, DATASET, checked, parse_list, widget


def resolve_folder(folder: str, node: str = "Kiln Load Dataset") -> Path:
    """An absolute path, or a folder under ComfyUI's input/ directory."""
    text = (folder or "").strip()
    if not text:
        raise ValueError(f"{node}: set `folder` to a folder of images with .txt captions "
                         "(a name under ComfyUI's input/ folder, or an absolute path)")
    path = Path(os.path.expanduser(text))
    inputs, relative = Path(bridge.folders()["input"]), not path.is_absolute()
    if relative:
        path = inputs / path
    if not path.is_dir():
        hint = did_you_mean(text, input_folders(inputs)) if relative else ""
        raise ValueError(f"{node}: {path} is not a folder{hint}; put your images in "
                         f"{inputs / 'my_dataset'} or give an absolute path")
    return path


def input_folders(inputs: Path) -> list[str]:
    """The folders under input/ and one level below ("people/anna"), for a "did you mean" (names only, no scan)."""
    found: list[str] = []
    if not inputs.is_dir():
        return found
    for child in sorted(p for p in inputs.iterdir() if p.is_dir() and not p.name.startswith(".")):
        found.append(child.name)
        found += [f"{child.name}/{g.name}" for g in sorted(child.iterdir()) if g.is_dir() and not g.name.startswith(".")]
    return found


class KilnLoadDataset(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnLoadDataset", display_name="Kiln Load Dataset", category=f"{CATEGORY}/data",
            description="Scan a folder of images with same-name .txt captions: validate every file, plan the "
                        "resolution buckets. No pixels are read yet.",
            inputs=[
                io.String.Input("folder", default="", tooltip="Folder of images (png, jpg, webp, bmp, tiff) with "
                                "same-name .txt captions: a name under ComfyUI's input/ (the 'choose a dataset…' button lists them) "
                                "or an absolute path. Sub-folders named like '10_name' repeat their images 10 times."),
                widget("trigger_word", default="", tooltip_text="Replaces {trigger} in captions, else put in front. "
                       "Empty: dataset.json's trigger_word."),
                widget("caption_prefix", tooltip_text="Text put before every caption (after the trigger word)."),
                widget("caption_suffix", tooltip_text="Text put after every caption."),
                io.String.Input("resolutions", default="512, 768, 1024", tooltip="Training resolutions: each image "
                                "trains at each size (area ≤ res², aspect kept, never upscaled). Empty: dataset.json's."),
                widget("repeats", tooltip_text="Times each image is seen per epoch (times a folder's N_ repeats)."),
                widget("caption_dropout", default=0.05, tooltip_text="Probability of training a step on the empty "
                       "caption (helps the LoRA work without its trigger)."),
                widget("default_caption", optional=True,
                       tooltip_text="Caption for images without a .txt ({trigger} allowed); else the trigger word."),
                widget("crop", optional=True),
                widget("shuffle_tags", optional=True),
                widget("keep_tags", optional=True),
                io.Boolean.Input("deep_check", default=False, optional=True, tooltip="Decode every image now "
                                 "(slower) to catch corrupt files before encoding."),
            ],
            outputs=[DATASET.Output(display_name="dataset", tooltip="The scanned dataset (KILN_DATASET)")],
        )

    @classmethod
    def validate_inputs(cls, folder=None):
        return checked(resolve_folder, folder)   # before any model loads

    @classmethod
    def fingerprint_inputs(cls, folder, **kwargs):
        # Re-scan when any file in the folder changes, even if the widgets did not.
        try:
            return folder_fingerprint(resolve_folder(folder))
        except ValueError:
            return float("nan")  # never equal: the error shows again on the next queue

    @classmethod
    def execute(cls, folder, trigger_word, caption_prefix, caption_suffix, resolutions, repeats, caption_dropout,
                default_caption="", crop="center", shuffle_tags=False, keep_tags=0, deep_check=False):
        root = resolve_folder(folder)
        captions = CaptionSettings(trigger_word=trigger_word, prefix=caption_prefix, suffix=caption_suffix,
                                   default_caption=default_caption, shuffle_tags=shuffle_tags, keep_tags=keep_tags)
        settings = DataSettings(resolutions=tuple(parse_list(resolutions, int)), divisor=dataset_divisor(), crop=crop,
                                repeats=repeats, captions=captions, deep=deep_check, caption_dropout=caption_dropout,
                                quality=True)
        dataset = Dataset.load(root, settings)
        return io.NodeOutput(dataset, ui=ui.PreviewText(dataset.report_text()))


class KilnEncodeImages(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnEncodeImages", display_name="Kiln Encode Images", category=f"{CATEGORY}/data",
            description="Encode every image at every bucket size with the VAE; latents are cached on disk "
                        "(keyed by image content, bucket, crop and VAE), so a re-run is instant.",
            inputs=[
                DATASET.Input("dataset", tooltip="From Kiln Load Dataset"),
                io.Vae.Input("vae", tooltip="The VAE of the model you will train (Flux2 or Z-Image's own)"),
                io.Int.Input("batch_size", default=1, min=1, max=32, optional=True,
                             tooltip="Images per VAE call within one bucket; raise it if VRAM allows"),
            ],
            outputs=[DATASET.Output(display_name="dataset", tooltip="The dataset with latents cached")],
        )

    @classmethod
    def execute(cls, dataset: Dataset, vae, batch_size=1):
        encode, identity = bridge.vae_encoder(vae)
        bar = bridge.progress(max(1, len(dataset.plan.entries)))
        encoded = dataset.encode_images(encode, identity, batch_size=batch_size,
                                        progress=lambda done, total: bar.update(done))
        items = encoded.report.items
        edits, masks = sum(bool(i.controls) for i in items), sum(bool(i.mask_file) for i in items)
        lines = [f"{len(encoded.usable_entries())} latents cached in {encoded.cache_dir}"
                 + (f"; {edits} edit targets with their control latents" if edits else "")
                 + (f"; {masks} mask files" if masks else "")]
        lines += [f"skipped {p.line()}" for p in encoded.encode_problems]
        return io.NodeOutput(encoded, ui=ui.PreviewText("\n".join(lines)))


class KilnEncodeCaptions(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnEncodeCaptions", display_name="Kiln Encode Captions", category=f"{CATEGORY}/data",
            description="Encode every caption (and the empty caption, for caption dropout) with the text "
                        "encoder; the embeddings are cached, so the text encoder can be unloaded for training.",
            inputs=[
                DATASET.Input("dataset", tooltip="From Kiln Load Dataset or Kiln Encode Images"),
                io.Clip.Input("clip", tooltip="The text encoder of the model you will train"),
                widget("preservation_class", optional=True, tooltip_text="Differential output preservation: a class "
                       "word (e.g. person) that replaces the trigger word in every caption; those captions are "
                       "encoded too, and preservation_weight (Training Options) turns the preservation on. "
                       "Empty: none"),
            ],
            outputs=[DATASET.Output(display_name="dataset", tooltip="The dataset with text embeddings cached")],
        )

    @classmethod
    def execute(cls, dataset: Dataset, clip, preservation_class=""):
        dataset = dataset.with_preservation(preservation_class or "", "Kiln Encode Captions: preservation_class")
        encode, identity = bridge.text_encoder(clip)
        texts = dataset.texts()
        bar = bridge.progress(len(texts))
        encoded = dataset.encode_captions(encode, identity, progress=lambda done, total: bar.update(done))
        preview = "\n".join(f"{item.path}: {' | '.join(caps)}"
                            for item, caps in list(zip(encoded.report.items, encoded.captions))[:20])
        more = f"\n… and {len(texts) - 20} more" if len(texts) > 21 else ""
        return io.NodeOutput(encoded, ui=ui.PreviewText(f"{len(texts)} texts encoded:\n{preview}{more}"))


NO_MODEL = "(none in models/LLM)"


def _clip_engine(clip, model, style, max_tokens, seed):
    if clip is None:
        raise ValueError("Kiln Caption Images: the comfyui_clip engine needs a vision-language text encoder on the "
                         "`clip` input (Load CLIP, e.g. Qwen2.5-VL 7B with type qwen_image)")
    return (f"comfyui_clip:{type(getattr(clip, 'tokenizer', clip)).__name__}",
            lambda: bridge.clip_captioner(clip, max_tokens=max_tokens, seed=seed))


def _transformers_engine(clip, model, style, max_tokens, seed):
    folder = resolve_model("" if model == NO_MODEL else model, bridge.caption_model_folders())
    return (f"transformers:{folder.resolve()}",
            lambda: bridge.device_captioner(folder, style=style, max_tokens=max_tokens, seed=seed))


# engine → (clip, model, style, max_tokens, seed) -> (identity, build() -> caption(image, prompt) -> str)
ENGINES = {"comfyui_clip": _clip_engine, "transformers": _transformers_engine}


def caption_models() -> list[str]:
    """The model combo: folders under models/LLM/ (a placeholder when there are none)."""
    return list_models(bridge.caption_model_folders()) or [NO_MODEL]


def caption_choices() -> dict:
    """What Caption Images offers, for the dataset editor (GET /kiln/captioners): its engines, the models in
    models/LLM/ (and where to put one when there is none), Load CLIP's text encoder files and types, styles."""
    return {"engines": list(ENGINES), "models": list_models(bridge.caption_model_folders()), "where": WHERE,
            **bridge.clip_loader_choices(), "styles": {name: s.description for name, s in captioning.STYLES.items()}}


class KilnCaptionImages(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        models = caption_models()
        return io.Schema(
            node_id="KilnCaptionImages", display_name="Kiln Caption Images", category=f"{CATEGORY}/data",
            description="Write a .txt caption beside each image of a dataset folder that has none (or every "
                        "image, with overwrite), with a vision-language model. Resumable: a re-run continues "
                        "where a stopped one ended. Images Load Dataset would skip are skipped and listed.",
            inputs=[
                io.String.Input("folder", default="", tooltip="The dataset folder, as in Kiln Load Dataset: a name "
                                "under ComfyUI's input/ (the 'choose a dataset…' button lists them) or an "
                                "absolute path."),
                io.Combo.Input("engine", options=list(ENGINES), default="comfyui_clip",
                               tooltip="comfyui_clip: ComfyUI's own vision-language text encoder on the clip input "
                               "(e.g. Qwen2.5-VL, Qwen3-VL, Gemma 3; Flux2's and Z-Image's are text-only). "
                               "transformers: a captioner from models/LLM/ (e.g. Florence-2)."),
                io.Clip.Input("clip", optional=True, tooltip="For the comfyui_clip engine: a vision-language text "
                              "encoder (Load CLIP). Not used by the transformers engine."),
                io.Combo.Input("model", options=models, default=models[0], optional=True,
                               tooltip=f"For the transformers engine: a model folder under models/LLM/; {WHERE}."),
                io.Combo.Input("style", options=list(captioning.STYLES), default="short",
                               tooltip="; ".join(f"{name}: {style.description}"
                                                 for name, style in captioning.STYLES.items())),
                io.String.Input("prompt", default="", multiline=True, tooltip="The instruction to the model. "
                                "Empty: the style's own prompt. (Florence-2 takes task tokens such as <CAPTION>.)"),
                io.String.Input("trigger_word", default="", tooltip="Put in front of every caption written "
                                "(unless the caption already has it)."),
                io.Boolean.Input("overwrite", default=False, tooltip="Caption every image, not only those without "
                                 "a caption; each old caption is kept as <name>.txt.bak."),
                io.Int.Input("max_tokens", default=256, min=8, max=4096, tooltip="Longest caption, in tokens."),
                io.Int.Input("seed", default=0, min=0, max=0xffffffffffffffff, control_after_generate=False,
                             tooltip="Generation seed, the same for every image (a re-run writes the same captions)."),
                io.String.Input("only", default="", multiline=True, optional=True,
                                tooltip="Caption only these images: paths relative to the folder, one a line (the "
                                "dataset editor's 'Caption selected' fills it). Empty: every image."),
            ],
            outputs=[io.String.Output(display_name="folder", tooltip="The folder, to wire into Kiln Load Dataset's "
                                      "folder (it then runs after the captions are written)"),
                     io.String.Output(display_name="report", tooltip="What was written, kept and skipped")],
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
    def execute(cls, folder, engine, style, prompt, trigger_word, overwrite, max_tokens, seed, clip=None,
                model=NO_MODEL, only=""):
        root = resolve_folder(folder, "Kiln Caption Images")
        if engine not in ENGINES:
            raise ValueError(f"Kiln Caption Images: engine {engine!r} is not one of {list(ENGINES)}")
        identity, build = ENGINES[engine](clip, model, style, max_tokens, seed)
        job = captioning.CaptionJob(style=style, prompt=prompt, trigger_word=trigger_word, overwrite=overwrite,
                                    engine=identity, only=captioning.parse_only(only))
        try:
            todo, report = captioning.plan(root, job)
        except ValueError as err:     # `only` names an image that is not there
            raise ValueError(f"Kiln Caption Images: {err}") from None
        note = ""
        if todo:    # the model is loaded only when there is something to caption
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


NODES = [KilnCaptionImages, KilnLoadDataset, KilnEncodeImages, KilnEncodeCaptions]
