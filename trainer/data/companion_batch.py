"""A batch's companion data: loss masks (masked training) and reference latents (edit training).

Masks weight the loss per latent cell: w = clamp(mask, unmasked_weight, 1) (OneTrainer's clamp, its
`unmasked_weight`), so a full mask equals the unmasked loss and a black region still trains at
unmasked_weight (0 lets it train not at all). Control latents go to the model as the family takes
reference latents (archs: Arch.reference_latents), raw: ComfyUI's extra_conds puts them through the
model's latent format, as it does for the ReferenceLatent node's. Only the target's tokens are trained
(the loss is on the target latent; the model's output carries no reference tokens).
"""

from __future__ import annotations

import logging

import numpy as np

from ..archs import Arch
from ..config import ConfigError, TrainConfig


def mask_weights(masks: list[np.ndarray | None], shape: tuple, unmasked_weight: float) -> np.ndarray | None:
    """Rows' masks ([1,h,w] or None) → loss weights [B,1,h,w] float32, None when no row has a mask.
    A row without a mask weighs 1 everywhere."""
    if all(mask is None for mask in masks):
        return None
    height, width = shape[-2:]
    rows = []
    for mask in masks:
        if mask is None:
            rows.append(np.ones((1, height, width), np.float32))
        elif mask.shape[-2:] != (height, width):
            raise ValueError(
                f"a loss mask of {mask.shape[-2]}×{mask.shape[-1]} cells does not fit its "
                f"{height}×{width} latent; run Encode Images again (the cache is from another VAE)"
            )
        else:
            rows.append(mask.reshape(1, height, width))
    return np.clip(np.stack(rows), unmasked_weight, 1.0).astype(np.float32)


def reference_extras(controls: list[list[np.ndarray]], arch: Arch, names: list[str]) -> dict:
    """Rows' control latents → the model extras that feed them as reference latents ({} for none)."""
    if not any(controls):
        return {}
    counts = {len(c) for c in controls}
    if len(counts) != 1:
        raise ValueError(
            f"a batch mixes edit items with {sorted(counts)} control images ({', '.join(names)}); "
            "give every target the same control folders"
        )
    if not arch.reference_latents:
        raise ConfigError(
            f"{arch.name} cannot train on control images (the dataset has a control/ folder): "
            "edit training is for Flux2 (Klein, Dev) and Qwen-Image (Edit 2509, 2511); move control/ out "
            "of the dataset to train the targets alone"
        )
    slots = []
    for slot in range(counts.pop()):
        shapes = {c[slot].shape for c in controls}
        if len(shapes) != 1:
            raise ValueError(
                f"control images of one batch encode to different sizes {sorted(shapes)} "
                f"({', '.join(names)}); use batch_size 1 or controls of one aspect per bucket"
            )
        slots.append(np.stack([c[slot] for c in controls]).astype(np.float32, copy=False))
    return {arch.reference_latents: slots}


# The extras that hold raw VAE latents (WanImageToVideo's start image and its mask): fp32 on the device, as
# ComfyUI's conds hold them until extra_conds has put them through the latent format (device_batch.py).
START_LATENT, START_MASK = "concat_latent_image", "concat_mask"
LATENT_EXTRAS = frozenset({START_LATENT, START_MASK})
# The start image's CLIP vision features (CLIPVisionEncode's penultimate_hidden_states [B,257,1280]): the cond
# WanImageToVideo sets, which WAN21.extra_conds turns into clip_fea (nodes/comfy/model.py wraps the tensor).
CLIP_VISION = "clip_vision_output"
# Extras kept fp32 to the model call: cast once there to the model dtype, as _apply_model casts ComfyUI's conds.
RAW_EXTRAS = LATENT_EXTRAS | {CLIP_VISION}


def starts(data, indices: list[int]) -> list[np.ndarray | None]:
    """Rows' cached start images (clips under start_images), None where the data keeps none (images, in-memory)."""
    read = getattr(data, "start", None)
    return [read(i) if read is not None else None for i in indices]


def visions(data, indices: list[int]) -> list[np.ndarray | None]:
    """Rows' cached CLIP vision features of their start images [T,D] (Encode Images' clip_vision), else None."""
    read = getattr(data, "clip_vision", None)
    return [read(i) if read is not None else None for i in indices]


def start_extras(starts: list[np.ndarray | None], arch: Arch, visions: list | None = None) -> dict:
    """Rows' start images ([C,t,h,w] raw latents, None for an image) → WanImageToVideo's conds: the latents and
    a mask [B,1,t,h,w] that is 0 on the start frame's latent frame, 1 after it, and for an arch that reads them
    (Wan 2.1 I2V) the start images' CLIP vision features `visions` ([T,D] each) as its clip_vision_output. {} for
    a family without a start image, and for images (a still trains as ComfyUI samples an I2V model given no
    start image)."""
    if not arch.start_image or all(start is None for start in starts):
        return {}
    latents = np.stack(starts).astype(np.float32, copy=False)  # one bucket: all clips of one size
    mask = np.ones((latents.shape[0], 1, *latents.shape[2:]), np.float32)
    mask[:, :, :1] = 0.0
    out = {START_LATENT: latents, START_MASK: mask}
    if arch.clip_vision and visions and all(vision is not None for vision in visions):
        out[CLIP_VISION] = np.stack(visions).astype(np.float32, copy=False)
    return out


def start_conds(data, indices: list[int], arch: Arch) -> dict:
    """start_extras of rows `indices` of `data`: their cached start images and CLIP vision features."""
    return start_extras(starts(data, indices), arch, visions(data, indices))


def check(cfg: TrainConfig, data, arch: Arch) -> None:
    """Refuse, before the first step, what a backend or family cannot train (one item per bucket tells:
    an edit dataset's every item has its controls)."""
    clips = [indices[0] for indices in data.buckets.values() if indices and data.latent(indices[0]).ndim == 4]
    _check_clip_vision(data, arch, clips)  # first: its fix (clip_vision) encodes the start images too
    start = getattr(data, "start", None)
    if arch.start_image and clips and (start is None or start(clips[0]) is None):
        raise ConfigError(
            f"{arch.name} trains a clip with its first frame as the start image (WanImageToVideo's "
            "concat_latent_image and concat_mask), which the dataset's latent cache does not hold: turn "
            "start_images on in Kiln Encode Images (headless training encodes them by itself)"
        )
    edit = any(data.controls(indices[0]) for indices in data.buckets.values() if indices)
    if not edit:
        return
    if not arch.reference_latents:
        reference_extras([[np.zeros(1)]], arch, [])  # raises the family's ConfigError
    if cfg.preservation_weight > 0:
        raise ConfigError(
            "preservation_weight: differential output preservation does not take an edit dataset "
            "(a control/ folder) yet; set preservation_weight to 0"
        )


def _check_clip_vision(data, arch: Arch, clips: list[int]) -> None:
    """Wan 2.1 I2V without its start images' CLIP vision features is refused: ComfyUI's sampler would run it
    with the caption as its image context, not the model that samples with CLIP Vision Encode. Features cached
    for a model that reads none (Wan 2.2 I2V's experts, same VAE) are ignored with one log line, not refused:
    the cache is the dataset's, not the model's, and one encode may serve both models."""
    features = visions(data, clips[:1])[0] if clips else None
    if arch.clip_vision and clips and features is None:
        raise ConfigError(
            f"{arch.name} reads each start image's CLIP vision features (WanImageToVideo's clip_vision_output) "
            "and the dataset's latent cache does not hold them: connect a CLIP Vision Loader with "
            "clip_vision_h.safetensors to Kiln Encode Images' clip_vision input (it encodes the start images too)"
        )
    if not arch.clip_vision and features is not None:
        logging.getLogger("kiln").info(
            "%s reads no CLIP vision: the start images' CLIP vision features in the cache are ignored", arch.name
        )
