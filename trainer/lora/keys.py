"""A LoRA in memory and Kiln's three key layouts: the base the readers and writers share (no file I/O).

In memory a LoRA is {ComfyUI module path: LoraWeights}, the path without
"diffusion_model." (e.g. "double_blocks.0.img_attn.qkv"). On disk
(comfy/lora.py model_lora_keys_unet + comfy/weight_adapter/lora.py LoRAAdapter):
  comfy      diffusion_model.<path>.lora_A.weight / .lora_B.weight / .alpha
  diffusers  transformer.<diffusers path>.lora_A/.lora_B, fused layers split, alpha/rank folded into B
  kohya      lora_unet_<path, '.'→'_'>.lora_down.weight / .lora_up.weight / .alpha
ComfyUI scales every pair by alpha / rank, and by 1 when `.alpha` is absent; so do Kiln and diffusers.
Files are lora_format.py's; other trainers' layouts lora_sources.py's; Kiln's LoKr/LoHa/DoRA adapter_files.py's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..archs import ARCHS, Arch, DiffusersRule, get_arch
from . import outside


@dataclass
class LoraWeights:
    A: np.ndarray  # [rank, in] float32 (lora_A / lora_down)
    B: np.ndarray  # [out, rank] float32 (lora_B / lora_up)
    alpha: float  # scale = alpha / rank

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


Lora = dict[str, LoraWeights]
ROLES = {
    ".lora_A.weight": "A",
    ".lora_down.weight": "A",
    ".lora_B.weight": "B",
    ".lora_up.weight": "B",
    ".alpha": "alpha",
}
DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}


# ---------------------------------------------------------------- shared key handling


def checked_weights(source: str, name: str, parts: dict[str, np.ndarray]) -> LoraWeights:
    """Validated LoraWeights from one module's A, B and optional alpha."""
    for role, names in (("A", "lora_A/lora_down"), ("B", "lora_B/lora_up")):
        if role not in parts:
            raise ValueError(f"{source}: {name} has no {names} weight; the file is incomplete, re-export it")
    A, B = parts["A"], parts["B"]
    for role, array, kinds in (("A", A, "f"), ("B", B, "f"), ("alpha", parts.get("alpha", 1.0), "fiu")):
        if np.asarray(array).dtype.kind not in kinds:
            raise ValueError(
                f"{source}: {name}: {role} is {np.asarray(array).dtype}, not a number of the "
                "right kind; the file is damaged or not a LoRA, re-export it"
            )
    if A.ndim != 2 or B.ndim != 2:
        raise ValueError(
            f"{source}: {name}: A {list(A.shape)} and B {list(B.shape)} must both be 2-D; "
            "only Linear LoRAs are supported (not conv/LoCon/LoKr)"
        )
    if B.shape[1] != A.shape[0] or A.shape[0] == 0:
        raise ValueError(
            f"{source}: {name}: A has rank {A.shape[0]} but B has {B.shape[1]} columns; "
            "the pair does not belong together, re-export the file"
        )
    alpha = parts.get("alpha", np.array(float(A.shape[0])))  # ComfyUI: no alpha → scale 1
    if alpha.size != 1:
        raise ValueError(f"{source}: {name}.alpha has shape {list(alpha.shape)}; it must be a scalar")
    return LoraWeights(np.asarray(A, np.float32), np.asarray(B, np.float32), float(alpha.reshape(-1)[0]))


def split_keys(tensors: Mapping[str, np.ndarray], prefix: str, source: str) -> Lora:
    """Keys under `prefix` → {module name without prefix/suffix: LoraWeights}."""
    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        suffix = next((s for s in ROLES if key.endswith(s)), None)
        if not key.startswith(prefix) or suffix is None:
            raise ValueError(
                f"{source}: key {key!r} is not a LoRA weight or alpha under {prefix!r}; Kiln reads "
                "plain diffusion-model LoRAs (lora_A/lora_B or lora_down/lora_up), nothing else"
            )
        name, role = key[len(prefix) : -len(suffix)], ROLES[suffix]
        if role in modules.setdefault(name, {}):
            raise ValueError(
                f"{source}: {prefix}{name} has both lora_A and lora_down (or lora_B and lora_up) keys; keep one naming"
            )
        modules[name][role] = np.asarray(value)
    return {name: checked_weights(source, prefix + name, parts) for name, parts in modules.items()}


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
    return {
        k: v
        for path, w in lora.items()
        for k, v in _pair(KOHYA_PREFIX + path.replace(".", "_"), w, "lora_down", "lora_up").items()
    }


# ---------------------------------------------------------------- diffusers


def _require_rules(arch: Arch | None, source: str) -> Arch:
    if arch is None or not arch.diffusers_rules:
        name = "no arch" if arch is None else f"arch {arch.name!r} (family {arch.family!r})"
        raise ValueError(
            f"{source}: diffusers export needs an arch with diffusers names, got {name}; "
            "pass arch= (e.g. 'flux2_klein', 'zimage') or use the comfy or kohya format"
        )
    return arch


def diffusers_targets(arch: Arch, path: str) -> tuple[DiffusersRule, list[str]] | None:
    """The first rule matching a ComfyUI path (per-module rules, then outside.py's), and its diffusers names."""
    for rule in outside.rules(arch):
        match = re.fullmatch(rule.comfy, path)
        if match:
            return rule, [target.format(*match.groups()) for target in rule.targets]
    return None


def _row_sizes(rule: DiffusersRule, rows: int, where: str) -> list[int]:
    parts = len(rule.targets)
    sizes = list(rule.split_sizes) if rule.split_sizes else [rows // parts] * parts
    if sum(sizes) != rows:
        raise ValueError(
            f"{where}: B has {rows} rows, not divisible into the {parts} diffusers parts "
            f"{[t.split('.')[-1] for t in rule.targets]} (sizes {sizes}); export it as comfy"
        )
    return sizes


def _diffusers_to(lora: Lora, arch: Arch | None) -> dict[str, np.ndarray]:
    arch = _require_rules(arch, "diffusers export")
    out: dict[str, np.ndarray] = {}
    for path, w in lora.items():
        found = diffusers_targets(arch, path)
        if found is None:
            raise ValueError(
                f"{path}: no diffusers name for this module in arch {arch.name!r}; "
                "export as comfy or kohya, or leave it out of the targets"
            )
        rule, names = found
        if not names:  # a module outside the per-module rules that diffusers renames past a plain name
            raise ValueError(
                f"{path}: no plain diffusers name for this module in arch {arch.name!r} "
                f"({outside.NO_NAME_WHY.get(arch.family, 'diffusers has none')}); export as comfy or kohya, "
                "or leave it out of the targets"
            )
        # Scale folded into B, no .alpha keys: diffusers' load_lora_weights refuses (Flux2) or mis-converts
        # (Z-Image) `.alpha` keys and load_lora_adapter ignores them; scale 1 is what every reader assumes
        # without them (ComfyUI, diffusers/PEFT, Kiln), while safetensors metadata ComfyUI would not read.
        w = _folded(w)
        # Every part gets the same A (so the same scale) and its exact rows of B.
        for name, part in zip(names, np.split(w.B, np.cumsum(_row_sizes(rule, w.B.shape[0], path))[:-1])):
            out.update(
                _pair(arch.diffusers_prefix + name, LoraWeights(w.A, part, w.alpha), "lora_A", "lora_B", alpha=False)
            )
    return out


def fill_groups(pattern: str, values: list[str]) -> str:
    r"""rule.comfy's capture groups filled in order: r"layers\.(\d+)\.attention\.qkv", ["3"] → "layers.3.…"."""
    remaining = iter(values)
    return re.sub(r"\((?!\?)[^()]*\)", lambda _: next(remaining), pattern).replace("\\.", ".")


def fuse(rule: DiffusersRule, parts: dict[int, LoraWeights], where: str) -> LoraWeights:
    """Split parts back into the fused layer: shared A and alpha (our export) → concat B."""
    ordered = [parts.get(i) for i in range(len(rule.targets))]
    first = next(p for p in ordered if p is not None)
    if all(
        p is not None and p.alpha == first.alpha and p.A.shape == first.A.shape and np.array_equal(p.A, first.A)
        for p in ordered
    ):
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
        raise ValueError(
            f"{where}: diffusers parts {bad or list(rule.targets)} do not fit one fused layer "
            f"(rows {[p and p.B.shape[0] for p in ordered]}, expected {rows}, and equal inputs)"
        )
    rank = sum(p.rank for p in present)
    B = np.zeros((sum(rows), rank), np.float32)
    row = col = 0
    for part, part_rows in zip(ordered, rows):
        if part is not None:
            B[row : row + part_rows, col : col + part.rank] = part.B * np.float32(part.scale)
            col += part.rank
        row += part_rows
    return LoraWeights(np.concatenate([p.A for p in present]), B, float(rank))


# ---------------------------------------------------------------- registry and files


class LoraFormat(NamedTuple):
    """A layout Kiln writes; reading any trainer's layout is lora_sources.py's."""

    to_tensors: Callable[[Lora, Arch | None], dict[str, np.ndarray]]
    key_prefix: str  # how a file of this format is recognised


FORMATS: dict[str, LoraFormat] = {
    "comfy": LoraFormat(_comfy_to, COMFY_PREFIX),
    "diffusers": LoraFormat(_diffusers_to, DIFFUSERS_PREFIX),
    "kohya": LoraFormat(_kohya_to, KOHYA_PREFIX),
}


def arch_of(arch: Arch | str | None, metadata: Mapping[str, str] | None = None) -> Arch | None:
    """The given arch (or name), else the file's kiln.arch; a name we do not know (a newer Kiln's) gives
    None, which only matters for diffusers, which then says so."""
    if arch is not None:
        return get_arch(arch) if isinstance(arch, str) else arch
    return ARCHS.get((metadata or {}).get("kiln.arch", ""))


def module_paths(metadata: Mapping[str, str], source: str) -> list[str] | None:
    if "kiln.module_paths" not in metadata:
        return None
    try:
        paths = json.loads(metadata["kiln.module_paths"])
    except json.JSONDecodeError:
        paths = None
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise ValueError(
            f"{source}: metadata 'kiln.module_paths' is not a JSON list of module paths; pass module_names instead"
        )
    return paths


def detect_format(keys, source: str = "tensors") -> str:
    found = {name for key in keys for name, f in FORMATS.items() if key.startswith(f.key_prefix)}
    if not found:
        raise ValueError(
            f"{source}: no LoRA keys (none start with {', '.join(f.key_prefix for f in FORMATS.values())}"
            "); is this a LoRA for the diffusion model?"
        )
    if len(found) > 1:
        raise ValueError(f"{source}: keys of several formats {sorted(found)} in one file; Kiln reads one")
    return found.pop()


def native_keys(tensors: Mapping[str, np.ndarray]) -> bool:
    """Keys in one of Kiln's own layouts (its suffixes only)."""
    return all(any(key.endswith(s) for s in ROLES) for key in tensors)
