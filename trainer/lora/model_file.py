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


def run_model_file(run_dir) -> str:
    """A full fine-tune's diffusion-model file in its run folder: RUN_FILE (a node run's), else the newest
    `*.safetensors` there whose metadata says kiln.kind diffusion_model (a headless run names it `<name>.safetensors`);
    "" for an adapter run's folder."""
    from pathlib import Path

    folder = Path(run_dir)
    if (folder / RUN_FILE).is_file():
        return str(folder / RUN_FILE)
    for path in sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            _, metadata = safetensors_io.read_header(path)
        except (OSError, safetensors_io.SafetensorsError):
            continue  # not a file Kiln wrote: not the run's model
        if metadata.get("kiln.kind") == "diffusion_model":
            return str(path)
    return ""
