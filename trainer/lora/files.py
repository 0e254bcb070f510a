"""LoRA files: Kiln's in-memory LoRA written in three key layouts ComfyUI's loader reads, and read back from
those and every other trainer's layout (lora_keys.py holds the layouts, lora_sources.py the other trainers',
adapter_files.py Kiln's LoKr/LoHa/DoRA files); the metadata Kiln writes.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from pathlib import PurePath

import numpy as np

from .. import __version__, safetensors_io
from ..archs import Arch, get_arch
from ..config import TrainConfig
from . import adapter_files
from . import sources as lora_sources
from .adapters import KIND_NAMES, AdapterWeights
from .keys import (  # noqa: F401  (re-exported: callers reach the in-memory LoRA's types here too)
    COMFY_PREFIX,
    DIFFUSERS_PREFIX,
    DTYPES,
    FORMATS,
    KOHYA_PREFIX,
    ROLES,
    Lora,
    LoraFormat,
    LoraWeights,
    arch_of,
    checked_weights,
    detect_format,
    module_paths,
    native_keys,
)


def to_tensors(lora: Lora, fmt: str, arch: Arch | str | None) -> dict[str, np.ndarray]:
    if fmt not in FORMATS:
        raise ValueError(f"unknown LoRA format {fmt!r}; choose one of {list(FORMATS)}")
    if any(isinstance(w, AdapterWeights) for w in lora.values()):
        return adapter_files.to_tensors(lora, fmt)
    for path, w in lora.items():  # same checks as loading, so we never write what we could not read
        checked_weights("LoRA to save", path, {"A": np.asarray(w.A), "B": np.asarray(w.B), "alpha": np.array(w.alpha)})
    return FORMATS[fmt].to_tensors(lora, arch_of(arch))


def from_tensors(
    tensors: Mapping[str, np.ndarray],
    *,
    arch: Arch | str | None = None,
    module_names=None,
    metadata: Mapping[str, str] | None = None,
    source: str = "tensors",
) -> tuple[Lora, str]:
    """Read a LoRA of any trainer's key layout (lora_sources.py); arch and module names default to the
    file's metadata. Returns (LoRA, 'comfy' | 'diffusers' | 'kohya' | 'foreign')."""
    metadata = metadata or {}
    own_adapters = adapter_files.read(tensors, metadata, source)
    if own_adapters is not None:
        return own_adapters
    if module_names is None:
        module_names = module_paths(metadata, source)
    converted = lora_sources.read(
        tensors, arch=arch_of(arch, metadata), module_names=module_names, metadata=metadata, source=source
    )
    if not converted.lora and not converted.passthrough:
        raise ValueError(
            f"{source}: no LoRA keys (no lora_A/lora_B, lora_down/lora_up, LoKr or LoHa weights "
            f"Kiln can place: {', '.join(converted.unplaced[:5]) or 'the file is empty'}); "
            "is this a LoRA for the diffusion model?"
        )
    if converted.unplaced:
        raise ValueError(
            f"{source}: {len(converted.unplaced)} key(s) fit no module of arch "
            f"{converted.arch.name if converted.arch else '(unknown)'}: {', '.join(converted.unplaced[:8])}; "
            "is the LoRA for another model (pass arch=), or are these not LoRA weights?"
        )
    if converted.passthrough:
        kinds = "/".join(KIND_NAMES[k] for k in sorted(converted.kinds.keys() - {"lora"}))
        example = next(keys for path, keys in converted.origins.items() if path not in converted.lora)
        raise ValueError(
            f"{source}: {len(converted.origins) - len(converted.lora)} module(s) are {kinds} weights, not LoRA "
            f"pairs (e.g. {', '.join(example)}); ComfyUI applies them (`python -m trainer convert` writes them "
            "under its names), but Kiln trains and edits only LoRA pairs"
        )
    found = {name for key in tensors for name, f in FORMATS.items() if key.startswith(f.key_prefix)}
    return converted.lora, found.pop() if len(found) == 1 and native_keys(tensors) else "foreign"


def save_lora(
    path,
    lora: Lora,
    *,
    arch: Arch | str | None,
    fmt: str = "comfy",
    dtype: str = "bf16",
    metadata: Mapping[str, str],
    passthrough: Mapping[str, np.ndarray] | None = None,
) -> None:
    """Write a LoRA; `passthrough` tensors (LoKr/LoHa/diff already under ComfyUI names) go in as they are."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown LoRA dtype {dtype!r}; choose one of {list(DTYPES)}")
    arch = arch_of(arch)
    if passthrough and fmt != "comfy":
        raise ValueError(
            f"LoKr/LoHa/diff weights are written under ComfyUI's own names only; use format 'comfy', not {fmt!r}"
        )
    tensors = {**to_tensors(lora, fmt, arch), **(passthrough or {})}
    meta = {**metadata, "kiln.format": fmt}
    if arch is not None:
        meta["kiln.arch"] = arch.name  # the arch that named the keys; export reads it back
    if fmt == "kohya":  # the only way back from '_' to '.' (see _kohya_from)
        meta["kiln.module_paths"] = json.dumps(sorted(lora))
    # alpha stays an F32 scalar; DoRA's dora_scale F32 too (a tiny vector that scales every column)
    stored = {key: DTYPES[dtype] for key in tensors if not key.endswith((".alpha", ".dora_scale"))}
    safetensors_io.write(path, tensors, meta, dtype=stored)


def load_lora(path, *, arch: Arch | str | None = None, module_names=None) -> tuple[Lora, dict[str, str]]:
    tensors, metadata = safetensors_io.read(path)
    lora, _ = from_tensors(tensors, arch=arch, module_names=module_names, metadata=metadata, source=str(path))
    return lora, metadata


def export(src, dst, fmt: str, *, arch: Arch | str | None = None) -> None:
    """Rewrite a LoRA file in another format, keeping its metadata and weight dtype."""
    header, metadata = safetensors_io.read_header(src)
    arch = arch_of(arch, metadata)
    lora, metadata = load_lora(src, arch=arch)
    weight_dtypes = {e["dtype"] for key, e in header.items() if not key.endswith((".alpha", ".dora_scale"))}
    dtype = {"BF16": "bf16", "F16": "fp16"}.get(weight_dtypes.pop(), "fp32") if len(weight_dtypes) == 1 else "fp32"
    kept = {k: v for k, v in metadata.items() if k not in ("kiln.format", "kiln.module_paths")}
    save_lora(dst, lora, arch=arch, fmt=fmt, dtype=dtype, metadata=kept)


# ---------------------------------------------------------------- metadata


def build_metadata(
    *,
    arch_name: str,
    config: dict,
    steps: int,
    trigger_words: list[str],
    title: str,
    notes: str = "",
    extra: dict | None = None,
) -> dict[str, str]:
    """kiln.* fields (what Kiln needs to resume/export) plus modelspec fields (what UIs show)."""
    # ModelSpec ids "<model>/lora" as the arch spells them (musubi-tuner's); an unknown name fails here.
    architecture, implementation = get_arch(arch_name).modelspec or (
        f"{arch_name}/lora",
        "https://github.com/comfyanonymous/ComfyUI",
    )
    metadata = {
        "kiln.version": __version__,
        "kiln.arch": arch_name,
        "kiln.config": json.dumps(config, sort_keys=True, default=str),  # Paths etc. as strings
        "kiln.steps": str(int(steps)),
        "kiln.trigger_words": json.dumps(list(trigger_words), ensure_ascii=False),
        "kiln.adapter": str(config.get("adapter", "lora")),
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": architecture,
        "modelspec.implementation": implementation,
        "modelspec.title": title,
        "modelspec.date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "modelspec.trigger_phrase": ", ".join(trigger_words),
    }
    if notes:
        metadata["modelspec.description"] = notes
    if config.get("init_lora_sha256"):  # a run started from a LoRA (trainer/run/init_lora.py): where it started
        metadata["kiln.init_lora"] = json.dumps(
            {"name": PurePath(str(config.get("init_lora", ""))).name, "sha256": config["init_lora_sha256"]}
        )
    for key, value in (extra or {}).items():
        if not isinstance(value, str):
            raise TypeError(f"metadata {key!r} is {type(value).__name__}; safetensors metadata must be str")
        metadata[key] = value
    return metadata


def lora_metadata(cfg: TrainConfig, arch: Arch, step: int) -> dict[str, str]:
    """A run's LoRA file metadata at `step`: its config, trigger word, and the run name as title."""
    return build_metadata(
        arch_name=arch.name,
        config=cfg.to_dict(),
        steps=step,
        trigger_words=[cfg.trigger_word] if cfg.trigger_word else [],
        title=cfg.run_name or f"{arch.name} LoRA",
    )


def convert_file(
    src, dst, *, arch: Arch | str | None = None, fmt: str = "comfy", allow_unplaced: bool = False
) -> lora_sources.Converted:
    """Rewrite another trainer's LoRA as a file ComfyUI loads key for key. Keys nothing places stop the
    conversion (listed), unless allow_unplaced, which leaves them out and still lists them."""
    converted, metadata = lora_sources.read_file(src, arch=arch)
    if converted.unplaced and not allow_unplaced:
        raise ValueError(
            f"{src}: {len(converted.unplaced)} key(s) fit no module of arch "
            f"{converted.arch.name if converted.arch else '(unknown)'}: {', '.join(converted.unplaced)}; "
            "pass the arch the LoRA was trained for, or allow unplaced keys to write the rest"
        )
    header, _ = safetensors_io.read_header(src)
    weight_dtypes = {
        e["dtype"] for key, e in header.items() if not key.endswith((".alpha", *lora_sources.DORA_SUFFIXES))
    }
    dtype = {"BF16": "bf16", "F16": "fp16"}.get(weight_dtypes.pop(), "fp32") if len(weight_dtypes) == 1 else "fp32"
    kept = {k: v for k, v in metadata.items() if not k.startswith("kiln.") and k != "lora_adapter_metadata"}
    kept["kiln.converted_from"] = json.dumps(lora_sources.file_identity(src))
    kept["kiln.convert_report"] = converted.report()
    save_lora(
        dst, converted.lora, arch=converted.arch, fmt=fmt, dtype=dtype, metadata=kept, passthrough=converted.passthrough
    )
    return converted
