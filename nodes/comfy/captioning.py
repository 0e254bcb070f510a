"""Captioners for Kiln Caption Images: ComfyUI's own vision-language text encoders (a CLIP that can
generate, used as ComfyUI's TextGenerate node uses it), and the models/LLM/ folder where transformers
captioners are kept (registered with folder_paths, so extra_model_paths.yaml can add more)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import comfy.model_management as mm
import folder_paths
import numpy as np
import torch
from PIL import Image

from ...trainer.data.captioning.models import MODELS_FOLDER, transformers_captioner

MAX_PIXELS = 768 * 768  # the image as the vision encoder sees it: enough for a caption, bounded cost
# TextGenerate's "sampling on" defaults; the seed is the same for every image (a resumed run writes
# what an uninterrupted one would)
SAMPLING = {
    "do_sample": True,
    "temperature": 0.7,
    "top_k": 64,
    "top_p": 0.95,
    "min_p": 0.05,
    "repetition_penalty": 1.05,
    "presence_penalty": 0.0,
}
NO_VISION = (
    "Kiln Caption Images: this CLIP ({name}) cannot see images: it is a text-only text encoder (in "
    "ComfyUI, Flux2 Klein's and Z-Image's Qwen3 and Flux2 Dev's Mistral are). Load a vision-language "
    "text encoder with Load CLIP (e.g. Qwen2.5-VL 7B with type qwen_image), or set engine to "
    "transformers with a Florence-2 in models/LLM/"
)


def clip_captioner(clip, *, max_tokens: int = 256, seed: int = 0):
    """caption(image, prompt) -> str through clip.tokenize(prompt, image=...), clip.generate, clip.decode."""
    if not callable(getattr(clip, "generate", None)):
        raise ValueError(
            "Kiln Caption Images: this ComfyUI's CLIP cannot generate text; update ComfyUI, or set "
            "engine to transformers"
        )
    accepted = inspect.signature(clip.generate).parameters  # presence_penalty: newer ComfyUI only
    settings = {k: v for k, v in {**SAMPLING, "max_length": max_tokens, "seed": seed}.items() if k in accepted}
    name = type(getattr(clip, "tokenizer", clip)).__name__

    def caption(image, prompt: str) -> str:
        pixels = _pixels(image)
        # `image=` for the encoders that take one image (Gemma, Qwen3-VL), `images=` for Qwen2.5-VL's
        tokens = clip.tokenize(prompt, image=pixels, images=[pixels], skip_template=False, min_length=1, thinking=False)
        if not _has_image(tokens):
            raise ValueError(NO_VISION.format(name=name))
        with torch.inference_mode():
            ids = clip.generate(tokens, **settings)
        return clip.decode(ids, skip_special_tokens=True)

    return caption


def _pixels(image) -> torch.Tensor:
    """A PIL RGB image → IMAGE [1,H,W,3] float in [0,1], scaled down to MAX_PIXELS at most."""
    scale = min(1.0, (MAX_PIXELS / (image.width * image.height)) ** 0.5)
    if scale < 1.0:
        image = image.resize(
            (max(1, round(image.width * scale)), max(1, round(image.height * scale))), Image.Resampling.LANCZOS
        )
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)[None]


def _has_image(tokens, depth: int = 0) -> bool:
    """Did the tokenizer put the image into the tokens? (A text-only encoder ignores it.)"""
    if isinstance(tokens, dict):
        if tokens.get("type") == "image":
            return True
        tokens = list(tokens.values())
    if not isinstance(tokens, (list, tuple)) or depth > 6:
        return False
    return any(isinstance(t, (dict, list, tuple)) and _has_image(t, depth + 1) for t in tokens)


def caption_model_folders() -> list[str]:
    """models/LLM/ (and any extra_model_paths.yaml entries for LLM), registered once."""
    if MODELS_FOLDER not in folder_paths.folder_names_and_paths:
        folder_paths.add_model_folder_path(MODELS_FOLDER, os.path.join(folder_paths.models_dir, MODELS_FOLDER))
    return list(folder_paths.get_folder_paths(MODELS_FOLDER))


def device_captioner(model_dir: str | Path, *, style: str, max_tokens: int, seed: int):
    """transformers_captioner on ComfyUI's device, with room made for it (ComfyUI's models unloaded as needed)."""
    device = mm.get_torch_device()
    size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    mm.free_memory(int(size * 1.3) + (512 << 20), device)
    return transformers_captioner(model_dir, style=style, max_tokens=max_tokens, seed=seed, device=str(device))


def clip_loader_choices() -> dict:
    """What ComfyUI's Load CLIP (CLIPLoader) offers: the text encoder files and its `type` options (the
    dataset editor builds a CLIPLoader → Kiln Caption Images prompt from them)."""
    import nodes as comfy_nodes  # ComfyUI's own nodes.py (this pack is imported under its folder's name)

    spec = comfy_nodes.CLIPLoader.INPUT_TYPES()["required"]
    return {"clips": list(spec["clip_name"][0]), "clip_types": list(spec["type"][0])}
