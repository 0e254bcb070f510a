"""LoRA files: one in-memory form, three key layouts that ComfyUI's loader reads.

In memory a LoRA is {ComfyUI module path: LoraWeights}, the path without
"diffusion_model." (e.g. "double_blocks.0.img_attn.qkv"). On disk
(comfy/lora.py model_lora_keys_unet + comfy/weight_adapter/lora.py LoRAAdapter):
  comfy      diffusion_model.<path>.lora_A.weight / .lora_B.weight / .alpha
  diffusers  transformer.<diffusers path>.lora_A/.lora_B, fused layers split, alpha/rank folded into B
  kohya      lora_unet_<path, '.'→'_'>.lora_down.weight / .lora_up.weight / .alpha
Reading (from_tensors, load_lora) takes these and other trainers' layouts: lora_sources.py.
ComfyUI scales every pair by alpha / rank, and by 1 when `.alpha` is absent; so do Kiln and diffusers.
"""
from __future__ import annotations

import datetime
import json
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import NamedTuple

import numpy as np

from . import safetensors_io
from .adapters import AdapterWeights
from .archs import ARCHS, Arch, DiffusersRule, get_arch
from .config import TrainConfig


@dataclass
class LoraWeights:
    A: np.ndarray  # [rank, in] float32 (lora_A / lora_down)
    B: np.ndarray  # [out, rank] float32 (lora_B / lora_up)
    alpha: float   # scale = alpha / rank

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


Lora = dict[str, LoraWeights]
_ROLES = {".lora_A.weight": "A", ".lora_down.weight": "A",
          ".lora_B.weight": "B", ".lora_up.weight": "B", ".alpha": "alpha"}
_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}


# ---------------------------------------------------------------- shared key handling

def _weights(source: str, name: str, parts: dict[str, np.ndarray]) -> LoraWeights:
    """Validated LoraWeights from one module's A, B and optional alpha."""
    for role, names in (("A", "lora_A/lora_down"), ("B", "lora_B/lora_up")):
        if role not in parts:
            raise ValueError(f"{source}: {name} has no {names} weight; the file is incomplete, re-export it")
    A, B = parts["A"], parts["B"]
    for role, array, kinds in (("A", A, "f"), ("B", B, "f"), ("alpha", parts.get("alpha", 1.0), "fiu")):
        if np.asarray(array).dtype.kind not in kinds:
            raise ValueError(f"{source}: {name}: {role} is {np.asarray(array).dtype}, not a number of the "
                             "right kind; the file is damaged or not a LoRA, re-export it")
    if A.ndim != 2 or B.ndim != 2:
        raise ValueError(f"{source}: {name}: A {list(A.shape)} and B {list(B.shape)} must both be 2-D; "
                         "only Linear LoRAs are supported (not conv/LoCon/LoKr)")
    if B.shape[1] != A.shape[0] or A.shape[0] == 0:
        raise ValueError(f"{source}: {name}: A has rank {A.shape[0]} but B has {B.shape[1]} columns; "
                         "the pair does not belong together, re-export the file")
    alpha = parts.get("alpha", np.array(float(A.shape[0])))  # ComfyUI: no alpha → scale 1
    if alpha.size != 1:
        raise ValueError(f"{source}: {name}.alpha has shape {list(alpha.shape)}; it must be a scalar")
    return LoraWeights(np.asarray(A, np.float32), np.asarray(B, np.float32), float(alpha.reshape(-1)[0]))


def _split_keys(tensors: Mapping[str, np.ndarray], prefix: str, source: str) -> Lora:
    """Keys under `prefix` → {module name without prefix/suffix: LoraWeights}."""
    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        suffix = next((s for s in _ROLES if key.endswith(s)), None)
        if not key.startswith(prefix) or suffix is None:
            raise ValueError(f"{source}: key {key!r} is not a LoRA weight or alpha under {prefix!r}; Kiln reads "
                             "plain diffusion-model LoRAs (lora_A/lora_B or lora_down/lora_up), nothing else")
        name, role = key[len(prefix):-len(suffix)], _ROLES[suffix]
        if role in modules.setdefault(name, {}):
            raise ValueError(f"{source}: {prefix}{name} has both lora_A and lora_down (or lora_B and "
                             "lora_up) keys; keep one naming")
        modules[name][role] = np.asarray(value)
    return {name: _weights(source, prefix + name, parts) for name, parts in modules.items()}


def _pair(name: str, weights: LoraWeights, down: str, up: str, *, alpha: bool = True) -> dict[str, np.ndarray]:
    pair = {f"{name}.{down}.weight": weights.A, f"{name}.{up}.weight": weights.B}
    if alpha:
        pair[f"{name}.alpha"] = np.array(weights.alpha, dtype=np.float32)  # scalar: ComfyUI calls .item()
    return pair


def _folded(weights: LoraWeights) -> LoraWeights:
    """The same product with scale 1: alpha/rank multiplied into B (in fp32, before the file's dtype
    rounds it; exact when the scale is a power of two), alpha = rank."""
    return LoraWeights(weights.A, weights.B * np.float32(weights.scale), float(weights.rank))


# ---------------------------------------------------------------- comfy and kohya

COMFY_PREFIX, KOHYA_PREFIX, DIFFUSERS_PREFIX = "diffusion_model.", "lora_unet_", "transformer."


def _comfy_to(lora: Lora, arch: Arch | None) -> dict[str, np.ndarray]:
    return {k: v for path, w in lora.items() for k, v in _pair(COMFY_PREFIX + path, w, "lora_A", "lora_B").items()}


def _kohya_to(lora: Lora, arch: Arch | None) -> dict[str, np.ndarray]:  # '.' → '_' as model_lora_keys_unet
    return {k: v for path, w in lora.items()
            for k, v in _pair(KOHYA_PREFIX + path.replace(".", "_"), w, "lora_down", "lora_up").items()}


# ---------------------------------------------------------------- diffusers

def _require_rules(arch: Arch | None, source: str) -> Arch:
    if arch is None or not arch.diffusers_rules:
        name = "no arch" if arch is None else f"arch {arch.name!r} (family {arch.family!r})"
        raise ValueError(f"{source}: diffusers export needs an arch with diffusers names, got {name}; "
                         "pass arch= (e.g. 'flux2_klein', 'zimage') or use the comfy or kohya format")
    return arch


def _targets(arch: Arch, path: str) -> tuple[DiffusersRule, list[str]] | None:
    """The first rule matching a ComfyUI path, and its diffusers names."""
    for rule in arch.diffusers_rules:
        match = re.fullmatch(rule.comfy, path)
        if match:
            return rule, [target.format(*match.groups()) for target in rule.targets]
    return None


def _row_sizes(rule: DiffusersRule, rows: int, where: str) -> list[int]:
    parts = len(rule.targets)
    sizes = list(rule.split_sizes) if rule.split_sizes else [rows // parts] * parts
    if sum(sizes) != rows:
        raise ValueError(f"{where}: B has {rows} rows, not divisible into the {parts} diffusers parts "
                         f"{[t.split('.')[-1] for t in rule.targets]} (sizes {sizes}); export it as comfy")
    return sizes


def _diffusers_to(lora: Lora, arch: Arch | None) -> dict[str, np.ndarray]:
    arch = _require_rules(arch, "diffusers export")
    out: dict[str, np.ndarray] = {}
    for path, w in lora.items():
        found = _targets(arch, path)
        if found is None:
            raise ValueError(f"{path}: no diffusers name for this module in arch {arch.name!r}; "
                             "export as comfy or kohya, or leave it out of the targets")
        rule, names = found
        # Scale folded into B, no .alpha keys: diffusers' load_lora_weights refuses (Flux2) or mis-converts
        # (Z-Image) `.alpha` keys and load_lora_adapter ignores them; scale 1 is what every reader assumes
        # without them (ComfyUI, diffusers/PEFT, Kiln), while safetensors metadata ComfyUI would not read.
        w = _folded(w)
        # Every part gets the same A (so the same scale) and its exact rows of B.
        for name, part in zip(names, np.split(w.B, np.cumsum(_row_sizes(rule, w.B.shape[0], path))[:-1])):
            out.update(_pair(arch.diffusers_prefix + name, LoraWeights(w.A, part, w.alpha), "lora_A", "lora_B",
                             alpha=False))
    return out


def _fill_groups(pattern: str, values: list[str]) -> str:
    r"""rule.comfy's capture groups filled in order: r"layers\.(\d+)\.attention\.qkv", ["3"] → "layers.3.…"."""
    remaining = iter(values)
    return re.sub(r"\((?!\?)[^()]*\)", lambda _: next(remaining), pattern).replace("\\.", ".")


def _fuse(rule: DiffusersRule, parts: dict[int, LoraWeights], where: str) -> LoraWeights:
    """Split parts back into the fused layer: shared A and alpha (our export) → concat B."""
    ordered = [parts.get(i) for i in range(len(rule.targets))]
    first = next(p for p in ordered if p is not None)
    if all(p is not None and p.alpha == first.alpha and p.A.shape == first.A.shape
           and np.array_equal(p.A, first.A) for p in ordered):
        return LoraWeights(first.A, np.concatenate([p.B for p in ordered]), first.alpha)
    return _block_diagonal(rule, ordered, where)


def _block_diagonal(rule: DiffusersRule, ordered: list[LoraWeights | None], where: str) -> LoraWeights:
    """Parts with their own A (foreign files): A = stacked As (rank Σr), B block-diagonal with each
    part's alpha/r folded in, alpha = Σr (scale 1), so B@A·scale equals the parts' exactly.
    A part the file lacks (e.g. only to_q and to_v trained) contributes zero rows."""
    present = [p for p in ordered if p is not None]
    rows = list(rule.split_sizes) if rule.split_sizes else [max(p.B.shape[0] for p in present)] * len(ordered)
    bad = [t for p, n, t in zip(ordered, rows, rule.targets) if p is not None and p.B.shape[0] != n]
    if bad or len({p.A.shape[1] for p in present}) != 1:
        raise ValueError(f"{where}: diffusers parts {bad or list(rule.targets)} do not fit one fused layer "
                         f"(rows {[p and p.B.shape[0] for p in ordered]}, expected {rows}, and equal inputs)")
    rank = sum(p.rank for p in present)
    B = np.zeros((sum(rows), rank), np.float32)
    row = col = 0
    for part, part_rows in zip(ordered, rows):
        if part is not None:
            B[row:row + part_rows, col:col + part.rank] = part.B * np.float32(part.scale)
            col += part.rank
        row += part_rows
    return LoraWeights(np.concatenate([p.A for p in present]), B, float(rank))


# ---------------------------------------------------------------- registry and files

class LoraFormat(NamedTuple):
    """A layout Kiln writes; reading any trainer's layout is lora_sources.py's."""
    to_tensors: Callable[[Lora, Arch | None], dict[str, np.ndarray]]
    key_prefix: str                     # how a file of this format is recognised


FORMATS: dict[str, LoraFormat] = {
    "comfy": LoraFormat(_comfy_to, COMFY_PREFIX),
    "diffusers": LoraFormat(_diffusers_to, DIFFUSERS_PREFIX),
    "kohya": LoraFormat(_kohya_to, KOHYA_PREFIX),
}


def _arch(arch: Arch | str | None, metadata: Mapping[str, str] | None = None) -> Arch | None:
    """The given arch (or name), else the file's kiln.arch; a name we do not know (a newer Kiln's) gives
    None, which only matters for diffusers, which then says so."""
    if arch is not None:
        return get_arch(arch) if isinstance(arch, str) else arch
    return ARCHS.get((metadata or {}).get("kiln.arch", ""))


def to_tensors(lora: Lora, fmt: str, arch: Arch | str | None) -> dict[str, np.ndarray]:
    if fmt not in FORMATS:
        raise ValueError(f"unknown LoRA format {fmt!r}; choose one of {list(FORMATS)}")
    if any(isinstance(w, AdapterWeights) for w in lora.values()):
        from . import adapter_files
        return adapter_files.to_tensors(lora, fmt)
    for path, w in lora.items():  # same checks as loading, so we never write what we could not read
        _weights("LoRA to save", path, {"A": np.asarray(w.A), "B": np.asarray(w.B), "alpha": np.array(w.alpha)})
    return FORMATS[fmt].to_tensors(lora, _arch(arch))


def _module_paths(metadata: Mapping[str, str], source: str) -> list[str] | None:
    if "kiln.module_paths" not in metadata:
        return None
    try:
        paths = json.loads(metadata["kiln.module_paths"])
    except json.JSONDecodeError:
        paths = None
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise ValueError(f"{source}: metadata 'kiln.module_paths' is not a JSON list of module paths; "
                         "pass module_names instead")
    return paths


def detect_format(keys, source: str = "tensors") -> str:
    found = {name for key in keys for name, f in FORMATS.items() if key.startswith(f.key_prefix)}
    if not found:
        raise ValueError(f"{source}: no LoRA keys (none start with {', '.join(f.key_prefix for f in FORMATS.values())}"
                         "); is this a LoRA for the diffusion model?")
    if len(found) > 1:
        raise ValueError(f"{source}: keys of several formats {sorted(found)} in one file; Kiln reads one")
    return found.pop()


def from_tensors(tensors: Mapping[str, np.ndarray], *, arch: Arch | str | None = None,
                 module_names=None, metadata: Mapping[str, str] | None = None,
                 source: str = "tensors") -> tuple[Lora, str]:
    """Read a LoRA of any trainer's key layout (lora_sources.py); arch and module names default to the
    file's metadata. Returns (LoRA, 'comfy' | 'diffusers' | 'kohya' | 'foreign')."""
    from . import adapter_files, lora_sources  # both build on this module's key handling

    metadata = metadata or {}
    own_adapters = adapter_files.read(tensors, metadata, source)
    if own_adapters is not None:
        return own_adapters
    if module_names is None:
        module_names = _module_paths(metadata, source)
    converted = lora_sources.read(tensors, arch=_arch(arch, metadata), module_names=module_names,
                                  metadata=metadata, source=source)
    if not converted.lora and not converted.passthrough:
        raise ValueError(f"{source}: no LoRA keys (no lora_A/lora_B, lora_down/lora_up, LoKr or LoHa weights "
                         f"Kiln can place: {', '.join(converted.unplaced[:5]) or 'the file is empty'}); "
                         "is this a LoRA for the diffusion model?")
    if converted.unplaced:
        raise ValueError(f"{source}: {len(converted.unplaced)} key(s) fit no module of arch "
                         f"{converted.arch.name if converted.arch else '(unknown)'}: {', '.join(converted.unplaced[:8])}; "
                         "is the LoRA for another model (pass arch=), or are these not LoRA weights?")
    if converted.passthrough:
        raise ValueError(f"{source}: {len(converted.passthrough)} tensor(s) are LoKr/LoHa/diff weights, not LoRA "
                         f"pairs (e.g. {next(iter(converted.passthrough))}); ComfyUI applies them, but Kiln trains "
                         "and edits only LoRA pairs")
    found = {name for key in tensors for name, f in FORMATS.items() if key.startswith(f.key_prefix)}
    return converted.lora, found.pop() if len(found) == 1 and _native(tensors) else "foreign"


def _native(tensors: Mapping[str, np.ndarray]) -> bool:
    """Keys in one of Kiln's own layouts (its suffixes only)."""
    return all(any(key.endswith(s) for s in _ROLES) for key in tensors)


def save_lora(path, lora: Lora, *, arch: Arch | str | None, fmt: str = "comfy", dtype: str = "bf16",
              metadata: Mapping[str, str], passthrough: Mapping[str, np.ndarray] | None = None) -> None:
    """Write a LoRA; `passthrough` tensors (LoKr/LoHa/diff already under ComfyUI names) go in as they are."""
    if dtype not in _DTYPES:
        raise ValueError(f"unknown LoRA dtype {dtype!r}; choose one of {list(_DTYPES)}")
    arch = _arch(arch)
    if passthrough and fmt != "comfy":
        raise ValueError(f"LoKr/LoHa/diff weights are written under ComfyUI's own names only; use format "
                         f"'comfy', not {fmt!r}")
    tensors = {**to_tensors(lora, fmt, arch), **(passthrough or {})}
    meta = {**metadata, "kiln.format": fmt}
    if arch is not None:
        meta["kiln.arch"] = arch.name  # the arch that named the keys; export reads it back
    if fmt == "kohya":  # the only way back from '_' to '.' (see _kohya_from)
        meta["kiln.module_paths"] = json.dumps(sorted(lora))
    # alpha stays an F32 scalar; DoRA's dora_scale F32 too (a tiny vector that scales every column)
    stored = {key: _DTYPES[dtype] for key in tensors if not key.endswith((".alpha", ".dora_scale"))}
    safetensors_io.write(path, tensors, meta, dtype=stored)


def load_lora(path, *, arch: Arch | str | None = None, module_names=None) -> tuple[Lora, dict[str, str]]:
    tensors, metadata = safetensors_io.read(path)
    lora, _ = from_tensors(tensors, arch=arch, module_names=module_names, metadata=metadata, source=str(path))
    return lora, metadata


def export(src, dst, fmt: str, *, arch: Arch | str | None = None) -> None:
    """Rewrite a LoRA file in another format, keeping its metadata and weight dtype."""
    header, metadata = safetensors_io.read_header(src)
    arch = _arch(arch, metadata)
    lora, metadata = load_lora(src, arch=arch)
    weight_dtypes = {e["dtype"] for key, e in header.items() if not key.endswith((".alpha", ".dora_scale"))}
    dtype = {"BF16": "bf16", "F16": "fp16"}.get(weight_dtypes.pop(), "fp32") if len(weight_dtypes) == 1 else "fp32"
    kept = {k: v for k, v in metadata.items() if k not in ("kiln.format", "kiln.module_paths")}
    save_lora(dst, lora, arch=arch, fmt=fmt, dtype=dtype, metadata=kept)


# ---------------------------------------------------------------- metadata

def build_metadata(*, arch_name: str, config: dict, steps: int, trigger_words: list[str], title: str,
                   notes: str = "", extra: dict | None = None) -> dict[str, str]:
    """kiln.* fields (what Kiln needs to resume/export) plus modelspec fields (what UIs show)."""
    # ModelSpec ids "<model>/lora" as the arch spells them (musubi-tuner's); an unknown name fails here.
    architecture, implementation = get_arch(arch_name).modelspec or (
        f"{arch_name}/lora", "https://github.com/comfyanonymous/ComfyUI")
    metadata = {
        "kiln.version": getattr(sys.modules[__package__], "__version__", "0.1.0"),
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
    if config.get("init_lora_sha256"):  # a run started from a LoRA (trainer/init_lora.py): where it started
        metadata["kiln.init_lora"] = json.dumps({"name": PurePath(str(config.get("init_lora", ""))).name,
                                                 "sha256": config["init_lora_sha256"]})
    for key, value in (extra or {}).items():
        if not isinstance(value, str):
            raise TypeError(f"metadata {key!r} is {type(value).__name__}; safetensors metadata must be str")
        metadata[key] = value
    return metadata


def lora_metadata(cfg: TrainConfig, arch: Arch, step: int) -> dict[str, str]:
    """A run's LoRA file metadata at `step`: its config, trigger word, and the run name as title."""
    return build_metadata(arch_name=arch.name, config=cfg.to_dict(), steps=step,
                          trigger_words=[cfg.trigger_word] if cfg.trigger_word else [],
                          title=cfg.run_name or f"{arch.name} LoRA")
