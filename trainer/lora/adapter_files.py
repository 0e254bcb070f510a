"""Kiln's LoKr, LoHa and DoRA files (trainer/lora/adapters.py): written under ComfyUI's adapter names with comfy
paths or kohya's flat `lora_unet_` names (LyCORIS's), read back, described. lora_format.py reads and writes through here; lora_report.py describes them."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import adapters
from .adapters import AdapterWeights
from .keys import COMFY_PREFIX, KOHYA_PREFIX, Lora, module_paths


def to_tensors(lora: Lora, fmt: str) -> dict[str, np.ndarray]:
    """LoKr/LoHa/DoRA under ComfyUI's names: comfy paths, or kohya's flat names (LyCORIS's lora_unet_)."""
    kinds = {w.kind if isinstance(w, AdapterWeights) else "lora" for w in lora.values()}
    if len(kinds) != 1:
        raise ValueError(f"LoRA to save mixes adapter kinds {sorted(kinds)}; a file holds one kind")
    if fmt == "diffusers":
        raise ValueError(
            f"format 'diffusers' has no {kinds.pop()} layout (diffusers loads LoRA pairs only); save as comfy or kohya"
        )
    prefix = {"comfy": COMFY_PREFIX, "kohya": KOHYA_PREFIX}[fmt]
    return {
        k: v
        for path, w in lora.items()
        for k, v in adapters.file_tensors(prefix + (path if fmt == "comfy" else path.replace(".", "_")), w).items()
    }


def read(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str], source: str) -> tuple[Lora, str] | None:
    """A Kiln LoKr/LoHa/DoRA file (or LORA_MODEL): comfy keys, or kohya keys with kiln.module_paths. Other
    trainers' LoKr/LoHa (any naming) are lora_sources.py's pass-through; None here."""
    if not any(adapters.is_adapter_key(key) for key in tensors):
        return None
    if not all(key.endswith((*adapters.FILE_SUFFIXES, ".alpha")) for key in tensors) or any(
        key.endswith(".dora_scale") and np.shape(value)[:1] != (1,) for key, value in tensors.items()
    ):  # another trainer's LoKr/LoHa/DoRA (lora_down + dora_scale, a per-row DoRA, ...): lora_sources.py's
        return None
    if all(key.startswith(COMFY_PREFIX) for key in tensors):
        return adapters.from_file_tensors(tensors, COMFY_PREFIX, source), "comfy"
    paths = module_paths(metadata, source) if all(key.startswith(KOHYA_PREFIX) for key in tensors) else None
    if paths is None:
        return None
    flat = adapters.from_file_tensors(tensors, KOHYA_PREFIX, source)
    dotted = {p.replace(".", "_"): p for p in paths}
    unknown = sorted(set(flat) - set(dotted))
    if unknown:
        raise ValueError(f"{source}: {unknown[:3]} are not in the file's kiln.module_paths; re-save it with Kiln")
    return {dotted[name]: w for name, w in flat.items()}, "kohya"
