"""The built-in demo DiT (trainer/demo/run.py): a small Flux2-shaped model for CPU.

Same module names and call convention as ComfyUI's Flux2 (model(x, sigma,
context)), so LoRA targets, key names and diffusers export are exercised
exactly as for the real family, at a size that trains on a CPU in a minute.
"""

from __future__ import annotations

from .base import Arch, no_extras
from .flux2 import DEFAULT_TARGETS, DIFFUSERS_RULES, IMPLEMENTATION

ARCHS = (
    Arch(
        name="demo",
        family="flux2",
        latent_channels=16,
        latent_downscale=8,
        patch=1,
        bucket_divisor=16,
        default_targets=DEFAULT_TARGETS,
        block_lists=("double_blocks", "single_blocks"),
        shift_mode="none",
        shift=1.0,
        model_extras=no_extras,
        mlx_model="tiny",
        diffusers_rules=DIFFUSERS_RULES,
        modelspec=("Flux.2-klein/lora", IMPLEMENTATION),
        description="built-in tiny Flux2-shaped DiT for `python -m trainer demo` and the tests",
    ),
)
