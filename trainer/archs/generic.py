"""Any other ComfyUI MODEL on the PyTorch backend: targets by name pattern.

The bridge (nodes/comfy/) calls ComfyUI's own model with ComfyUI's own
conditioning, so the trainer needs no facts beyond the user's target patterns.
"""

from __future__ import annotations

from .base import Arch, no_extras

ARCHS = (
    Arch(
        name="generic",
        family="generic",
        latent_channels=0,
        latent_downscale=8,
        patch=1,
        bucket_divisor=16,
        default_targets=(),
        block_lists=(),
        shift_mode="none",
        shift=1.0,
        model_extras=no_extras,
        description="any ComfyUI MODEL; set `targets` to the module-name patterns to train",
    ),
)
