"""Caption Images → Load Dataset → Encode Images → Encode Captions: a folder becomes cached latents and
embeddings. Caption Images lives in caption_nodes.py, the folder a node names in input_folders.py."""

from __future__ import annotations

from comfy_api.latest import io, ui

from ..trainer.archs import dataset_divisor
from ..trainer.data.captions import CaptionSettings
from ..trainer.data.dataset import Dataset, DataSettings, folder_fingerprint
from ..trainer.data.frames import FrameSettings
from .caption_nodes import NO_MODEL, KilnCaptionImages, caption_choices, caption_models  # noqa: F401 (one release)
from .comfy import bridge
from .input_folders import input_folders, resolve_folder  # noqa: F401 (kept here one release)
from .widgets import CATEGORY, DATASET, checked, parse_list, widget


# Load Dataset's clip inputs, each a TrainConfig field (trainer/config/data.py), in widget order.
CLIP_WIDGETS = ("frames", "fps", "frame_extraction", "frame_windows")


def frame_settings(values: dict) -> FrameSettings:
    """The clip inputs given (a workflow saved before they existed has none: the defaults)."""
    defaults = FrameSettings()
    return FrameSettings(
        frames=values.get("frames", defaults.frames),
        fps=values.get("fps", defaults.fps),
        extraction=values.get("frame_extraction", defaults.extraction),
        windows=values.get("frame_windows", defaults.windows),
    )


class KilnLoadDataset(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnLoadDataset",
            display_name="Kiln Load Dataset",
            category=f"{CATEGORY}/data",
            description="Scan a folder of images with same-name .txt captions: validate every file, plan the "
            "resolution buckets. No pixels are read yet.",
            inputs=[
                io.String.Input(
                    "folder",
                    default="",
                    tooltip="Folder of images (png, jpg, webp, bmp, tiff) and clips (mp4, webm, mov, mkv, gif) with "
                    "same-name .txt captions: a name under ComfyUI's input/ (the 'choose a dataset…' button lists them) "
                    "or an absolute path. Sub-folders named like '10_name' repeat their images 10 times.",
                ),
                widget(
                    "trigger_word",
                    default="",
                    tooltip_text="Replaces {trigger} in captions, else put in front. "
                    "Empty: dataset.json's trigger_word.",
                ),
                widget("caption_prefix", tooltip_text="Text put before every caption (after the trigger word)."),
                widget("caption_suffix", tooltip_text="Text put after every caption."),
                io.String.Input(
                    "resolutions",
                    default="512, 768, 1024",
                    tooltip="Training resolutions: each image "
                    "trains at each size (area ≤ res², aspect kept, never upscaled). Empty: dataset.json's.",
                ),
                widget("repeats", tooltip_text="Times each image is seen per epoch (times a folder's N_ repeats)."),
                widget(
                    "caption_dropout",
                    default=0.05,
                    tooltip_text="Probability of training a step on the empty "
                    "caption (helps the LoRA work without its trigger).",
                ),
                widget(
                    "default_caption",
                    optional=True,
                    tooltip_text="Caption for images without a .txt ({trigger} allowed); else the trigger word.",
                ),
                widget("crop", optional=True),
                widget("shuffle_tags", optional=True),
                widget("keep_tags", optional=True),
                io.Boolean.Input(
                    "deep_check",
                    default=False,
                    optional=True,
                    tooltip="Decode every image now (slower) to catch corrupt files before encoding.",
                ),
                # Clips (mp4, webm, mov, mkv, gif); images ignore these. Added last: saved workflows keep their values.
                *(widget(name, optional=True) for name in CLIP_WIDGETS),
            ],
            outputs=[DATASET.Output(display_name="dataset", tooltip="The scanned dataset (KILN_DATASET)")],
        )

    @classmethod
    def validate_inputs(cls, folder=None):
        return checked(resolve_folder, folder)  # before any model loads

    @classmethod
    def fingerprint_inputs(cls, folder, **kwargs):
        # Re-scan when any file in the folder changes, even if the widgets did not.
        try:
            return folder_fingerprint(resolve_folder(folder))
        except ValueError:
            return float("nan")  # never equal: the error shows again on the next queue

    @classmethod
    def execute(
        cls,
        folder,
        trigger_word,
        caption_prefix,
        caption_suffix,
        resolutions,
        repeats,
        caption_dropout,
        default_caption="",
        crop="center",
        shuffle_tags=False,
        keep_tags=0,
        deep_check=False,
        **clip_settings,
    ):
        root = resolve_folder(folder)
        captions = CaptionSettings(
            trigger_word=trigger_word,
            prefix=caption_prefix,
            suffix=caption_suffix,
            default_caption=default_caption,
            shuffle_tags=shuffle_tags,
            keep_tags=keep_tags,
        )
        settings = DataSettings(
            resolutions=tuple(parse_list(resolutions, int)),
            divisor=dataset_divisor(),
            crop=crop,
            repeats=repeats,
            captions=captions,
            deep=deep_check,
            caption_dropout=caption_dropout,
            quality=True,
            frames=frame_settings(clip_settings),
        )
        dataset = Dataset.load(root, settings)
        return io.NodeOutput(dataset, ui=ui.PreviewText(dataset.report_text()))


class KilnEncodeImages(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnEncodeImages",
            display_name="Kiln Encode Images",
            category=f"{CATEGORY}/data",
            description="Encode every image at every bucket size with the VAE; latents are cached on disk "
            "(keyed by image content, bucket, crop and VAE), so a re-run is instant.",
            inputs=[
                DATASET.Input("dataset", tooltip="From Kiln Load Dataset"),
                io.Vae.Input("vae", tooltip="The VAE of the model you will train (Flux2 or Z-Image's own)"),
                io.Int.Input(
                    "batch_size",
                    default=1,
                    min=1,
                    max=32,
                    optional=True,
                    tooltip="Images per VAE call within one bucket; raise it if VRAM allows",
                ),
                io.Boolean.Input(
                    "start_images",
                    default=False,
                    optional=True,
                    tooltip="Image-to-video (Wan I2V): also encode each clip's first frame as its start image, as "
                    "WanImageToVideo does (the first frame, then grey frames); images ignore it",
                ),
                io.ClipVision.Input(
                    "clip_vision",
                    optional=True,
                    tooltip="Wan 2.1 image-to-video only: a CLIP Vision Loader with clip_vision_h.safetensors. Each "
                    "clip's start image is encoded as CLIP Vision Encode (crop none) does for WanImageToVideo, and "
                    "cached beside it (start images are encoded then, whatever start_images says). Other models "
                    "ignore the features",
                ),
            ],
            outputs=[DATASET.Output(display_name="dataset", tooltip="The dataset with latents cached")],
        )

    @classmethod
    def execute(cls, dataset: Dataset, vae, batch_size=1, start_images=False, clip_vision=None):
        encode, identity = bridge.vae_encoder(vae)
        vision = bridge.clip_vision_encoder(clip_vision) if clip_vision is not None else None
        bar = bridge.progress(max(1, len(dataset.plan.entries)))
        encoded = dataset.encode_images(
            encode,
            identity,
            batch_size=batch_size,
            progress=lambda done, total: bar.update(done),
            start_images=bool(start_images),
            clip_vision=vision,
        )
        items = encoded.report.items
        edits, masks = sum(bool(i.controls) for i in items), sum(bool(i.mask_file) for i in items)
        lines = [
            f"{len(encoded.usable_entries())} latents cached in {encoded.cache_dir}"
            + (f"; {edits} edit targets with their control latents" if edits else "")
            + (f"; {masks} mask files" if masks else "")
        ]
        lines += [f"skipped {p.line()}" for p in encoded.encode_problems]
        return io.NodeOutput(encoded, ui=ui.PreviewText("\n".join(lines)))


class KilnEncodeCaptions(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnEncodeCaptions",
            display_name="Kiln Encode Captions",
            category=f"{CATEGORY}/data",
            description="Encode every caption (and the empty caption, for caption dropout) with the text "
            "encoder; the embeddings are cached, so the text encoder can be unloaded for training.",
            inputs=[
                DATASET.Input("dataset", tooltip="From Kiln Load Dataset or Kiln Encode Images"),
                io.Clip.Input("clip", tooltip="The text encoder of the model you will train"),
                widget(
                    "preservation_class",
                    optional=True,
                    tooltip_text="Differential output preservation: a class "
                    "word (e.g. person) that replaces the trigger word in every caption; those captions are "
                    "encoded too, and preservation_weight (Training Options) turns the preservation on. "
                    "Empty: none",
                ),
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
        preview = "\n".join(
            f"{item.path}: {' | '.join(caps)}" for item, caps in list(zip(encoded.report.items, encoded.captions))[:20]
        )
        more = f"\n… and {len(texts) - 20} more" if len(texts) > 21 else ""
        return io.NodeOutput(encoded, ui=ui.PreviewText(f"{len(texts)} texts encoded:\n{preview}{more}"))


NODES = [KilnCaptionImages, KilnLoadDataset, KilnEncodeImages, KilnEncodeCaptions]
