"""A full fine-tune's output: a diffusion-model file in ComfyUI's own layout (the diffusion model's state-dict keys,
no prefix), which Load Diffusion Model (UNETLoader) loads and `python -m trainer extract` reads beside the base."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .. import safetensors_io

RUN_FILE = "diffusion_model.safetensors"  # in a node run's folder: what Kiln Save Diffusion Model copies
STORED = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}


def save_diffusion_model(path, tensors: Mapping[str, np.ndarray], *, dtype: str, metadata: Mapping[str, str]) -> None:
    """Write the model's floating tensors in `dtype` (save_dtype), the others as they are; atomically."""
    if dtype not in STORED:
        raise ValueError(f"unknown save_dtype {dtype!r}; choose one of {list(STORED)}")
    stored = {
        key: STORED[dtype] for key, array in tensors.items() if np.issubdtype(np.asarray(array).dtype, np.floating)
    }
    safetensors_io.write(path, tensors, {**metadata, "kiln.kind": "diffusion_model"}, dtype=stored)
