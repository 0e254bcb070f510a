"""MLX diffusion models by arch name: `build(arch_name, weights, dtype)` → an mlx.nn.Module.

Each model family lives in its own module here with a `build(arch_name, weights, dtype="bfloat16")`;
BUILDERS names that module per arch, and it is imported only when an arch of it is built (one line
per arch to add one). `weights` are ComfyUI diffusion-model keys without prefix (see weights.py).
"""
from __future__ import annotations

import importlib

BUILDERS = {
    "flux2_klein": "flux2",
    "flux2_dev": "flux2",
    "demo": "tiny",
    "zimage": "zimage", "zimage_turbo": "zimage",
}


def builder(arch_name: str):
    """The `build` function of the module that implements `arch_name`."""
    module_name = BUILDERS.get(arch_name)
    if module_name is None:
        raise ValueError(f"no MLX model for arch {arch_name!r}; known: {', '.join(sorted(BUILDERS))}")
    return importlib.import_module(f"{__name__}.{module_name}").build


def build(arch_name: str, weights, dtype="bfloat16"):
    """The MLX model of `arch_name` loaded with `weights`, parameters and activations in `dtype`."""
    return builder(arch_name)(arch_name, weights, dtype)
