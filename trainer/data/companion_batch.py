"""A batch's companion data: loss masks (masked training) and reference latents (edit training).

Masks weight the loss per latent cell: w = clamp(mask, unmasked_weight, 1) (OneTrainer's clamp, its
`unmasked_weight`), so a full mask equals the unmasked loss and a black region still trains at
unmasked_weight (0 lets it train not at all). Control latents go to the model as the family takes
reference latents (archs: Arch.reference_latents), raw: ComfyUI's extra_conds puts them through the
model's latent format, as it does for the ReferenceLatent node's. Only the target's tokens are trained
(the loss is on the target latent; the model's output carries no reference tokens).
"""

from __future__ import annotations

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


def check(cfg: TrainConfig, data, arch: Arch) -> None:
    """Refuse, before the first step, what a backend or family cannot train (one item per bucket tells:
    an edit dataset's every item has its controls)."""
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
