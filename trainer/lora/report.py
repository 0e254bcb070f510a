"""What `python -m trainer inspect` prints: a LoRA file's format, metadata and modules, for a person."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Mapping

from .. import safetensors_io
from ..config import TrainConfig
from . import adapter_files, stock
from . import adapters as adapter_kinds
from . import sources as lora_sources
from .keys import (
    COMFY_PREFIX,
    FORMATS,
    KOHYA_PREFIX,
    Lora,
    arch_of,
    detect_format,
    module_paths,
    native_keys,
    split_keys,
)

_SHOWN = ("kiln.arch", "kiln.steps", "kiln.trigger_words", "kiln.config", "kiln.format", "kiln.module_paths")
_BLOCK = re.compile(r"^([^.]+\.\d+)\.(.+)$")  # double_blocks.0.img_attn.qkv -> double_blocks.0, img_attn.qkv
_KOHYA_BLOCK = re.compile(r"^(.+?_\d+)_(.+)$")  # kohya's '_' names when the file has no kiln.module_paths
_DTYPE_NAMES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


def describe(path) -> dict:
    """What `python -m trainer inspect` prints; works without arch or module names: the modules, who wrote the
    file, the arch it fits, its adapter kinds, and the keys stock ComfyUI would leave unmatched."""
    tensors, metadata = safetensors_io.read(path)
    header, _ = safetensors_io.read_header(path)
    info = _modules_of(path, tensors, metadata, header)
    try:
        fit = lora_sources.read(
            tensors, arch=arch_of(None, metadata), module_names=module_paths(metadata, str(path)), metadata=metadata
        ).arch
    except ValueError:
        fit = None
    unmatched = stock.unmatched(tensors, fit)
    return {
        **info,
        "writer": stock.writer(metadata, tensors),
        "arch_fit": fit.name if fit else None,
        "kinds": sorted({row.get("kind", "lora") for row in info["module_table"]}),
        "comfyui_unmatched": len(unmatched),
        "comfyui_unmatched_keys": unmatched,
    }


def _modules_of(path, tensors, metadata, header) -> dict:
    own_adapters = adapter_files.read(tensors, metadata, str(path))
    if own_adapters is not None:
        return _describe_adapters(path, *own_adapters, metadata, header)
    if (
        not native_keys(tensors)
        or len({n for k in tensors for n, f in FORMATS.items() if k.startswith(f.key_prefix)}) != 1
    ):
        return _describe_foreign(path, tensors, metadata, header)
    fmt = detect_format(tensors, str(path))
    prefix = FORMATS[fmt].key_prefix
    modules = split_keys(tensors, prefix, str(path))  # file's modules, unfused
    dotted = {p.replace(".", "_"): p for p in module_paths(metadata, str(path)) or []}  # kohya's '_' names
    table = [
        {
            "name": dotted.get(name, name),
            "rank": w.rank,
            "alpha": w.alpha,
            "parameters": w.A.size + w.B.size,
            "dtype": header[
                prefix + name + next(s for s in (".lora_A.weight", ".lora_down.weight") if prefix + name + s in header)
            ]["dtype"],
        }
        for name, w in modules.items()
    ]
    return summary(path, fmt, modules, table, metadata, header)


def _describe_foreign(path, tensors, metadata, header) -> dict:
    """Another trainer's file as `convert` reads it (fused, in ComfyUI paths): LoRA pairs, and LoKr/LoHa/DoRA/diff
    modules as they pass through; dtypes as stored, names and examples from the file's own keys."""
    converted = lora_sources.read(
        tensors,
        arch=arch_of(None, metadata),
        module_names=module_paths(metadata, str(path)),
        metadata=metadata,
        source=str(path),
    )
    if not converted.lora and not converted.passthrough:
        raise ValueError(
            f"{path}: no LoRA, LoKr or LoHa weights Kiln can place (keys such as "
            f"{', '.join(converted.unplaced[:5]) or 'none'}); is this a LoRA for the diffusion model?"
        )
    table = [_foreign_row(name, keys, converted, tensors, header) for name, keys in converted.origins.items()]
    info = summary(path, "foreign (read as comfy paths)", {row["name"]: row for row in table}, table, metadata, header)
    return {**info, "arch_fit": converted.arch.name if converted.arch else None, "unplaced": converted.unplaced}


def _foreign_row(name: str, keys: list[str], converted, tensors, header) -> dict:
    weights = [k for k in keys if not k.endswith(".alpha")]
    if name in converted.lora:
        w = converted.lora[name]
        kind, rank, alpha = "lora", w.rank, w.alpha
    else:
        kind = next(
            (
                k
                for s, (k, _role) in lora_sources.SUFFIXES.items()
                for key in keys
                if key.endswith(s) and k not in ("lora", "")
            ),
            "dora",
        )
        by_role = {role: tensors[k] for k in keys for s, (_, role) in lora_sources.SUFFIXES.items() if k.endswith(s)}
        rank = _rank(kind, by_role)
        alpha = float(by_role["alpha"].reshape(-1)[0]) if "alpha" in by_role else float(rank or 1)
    return {
        "name": name,
        "kind": kind,
        "rank": rank,
        "alpha": alpha,
        "parameters": sum(int(tensors[k].size) for k in weights),
        "dtype": header[weights[0]]["dtype"],
        "keys": keys,
    }


def _rank(kind: str, roles: dict) -> int | None:
    """A module's rank as its file stores it; None for full matrices (a full-matrix LoKr, a diff)."""
    for role in {"lokr": ("lokr_w2_b", "lokr_w2_a"), "loha": ("hada_w1_b",), "dora": ("A",)}.get(kind, ()):
        if role in roles:
            return int(roles[role].shape[0] if role != "lokr_w2_a" else roles[role].shape[1])
    return None


def summary(path, fmt: str, weights: Mapping, table: list[dict], metadata, header) -> dict:
    """describe()'s dict (lora_report.py prints it) from a file's modules (anything with rank and alpha) and
    their table rows."""
    rank_of = {name: (row["rank"] if isinstance(row, dict) else row.rank) for name, row in weights.items()}
    alpha_of = [row["alpha"] if isinstance(row, dict) else row.alpha for row in weights.values()]
    return {
        "path": str(path),
        "format": fmt,
        "modules": len(weights),
        "ranks": sorted({r for r in rank_of.values()}, key=lambda r: (r is None, r or 0)),
        "alphas": sorted(set(alpha_of)),
        "dtypes": sorted({entry["dtype"] for entry in header.values()}),
        "metadata": dict(metadata),
        "parameters": sum(row["parameters"] for row in table),
        "module_table": table,
    }


def non_default_settings(config_json: str) -> list[tuple[str, object]] | None:
    """kiln.config's settings that differ from TrainConfig's defaults, in field order; None if unreadable."""

    try:
        config = json.loads(config_json)
    except json.JSONDecodeError:
        return None
    if not isinstance(config, dict):
        return None
    defaults = json.loads(json.dumps(TrainConfig().to_dict(), default=str))  # tuples as lists, as stored
    order = list(defaults) + sorted(set(config) - set(defaults))  # a newer Kiln's keys last
    return [(key, config[key]) for key in order if key in config and config[key] != defaults.get(key, object())]


def module_groups(table: list[dict]) -> dict[str, list[dict]]:
    """Modules grouped by block (the path up to the block index), in file order; the rest under "other"."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in table:
        match = _BLOCK.match(row["name"]) or _KOHYA_BLOCK.match(row["name"])
        group, rest = match.groups() if match else ("other", row["name"])
        groups[group].append({**row, "name": rest})
    return dict(sorted(groups.items(), key=lambda item: _natural(item[0])))


def _natural(text: str) -> list:
    """double_blocks.2 before double_blocks.10; "other" last."""
    return [text == "other"] + [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _number(value: float) -> str:
    return f"{value:g}"


def format_description(info: dict) -> str:
    """describe()'s dict as readable lines."""
    meta = info["metadata"]
    lines = [
        info["path"],
        f"  format         {info['format']}",
        f"  arch           {meta.get('kiln.arch', '(not recorded)')}",
    ]
    if "kiln.steps" in meta:
        lines.append(f"  steps          {meta['kiln.steps']}")
    try:
        words = json.loads(meta.get("kiln.trigger_words", "[]"))
    except json.JSONDecodeError:
        words = [meta["kiln.trigger_words"]]
    if words:
        lines.append(f"  trigger words  {', '.join(map(str, words))}")
    if "kiln.config" in meta:
        settings = non_default_settings(meta["kiln.config"])
        if settings is None:
            lines.append("  settings       (kiln.config is not readable JSON)")
        else:
            lines.append(
                "settings (kiln.config, those not at their default):"
                if settings
                else "settings (kiln.config): all at their defaults"
            )
            lines += [f"  {key} = {json.dumps(value, ensure_ascii=False)}" for key, value in settings]
    others = {k: v for k, v in meta.items() if k not in _SHOWN}
    if others:
        lines.append("metadata:")
        lines += [f"  {key} = {value}" for key, value in sorted(others.items())]
    lines += _provenance(info)
    lines.append("modules by block:")
    for group, rows in module_groups(info["module_table"]).items():
        lines.append(
            f"  {group}: "
            + ", ".join(
                f"{row['name']} {row['kind'] + ' ' if 'kind' in row else ''}{_rank_text(row['rank'])} α{_number(row['alpha'])} "
                f"{_DTYPE_NAMES.get(row['dtype'], row['dtype'])}"
                for row in rows
            )
        )
    lines.append(
        f"totals: {info['modules']} modules, {info['parameters']:,} parameters, "
        f"ranks {', '.join(_rank_text(r)[1:] if r is not None else 'full' for r in info['ranks'])}, alphas {', '.join(map(_number, info['alphas']))}, "
        f"dtypes {', '.join(info['dtypes'])}"
    )
    return "\n".join(lines)


def _rank_text(rank) -> str:
    return "full" if rank is None else f"r{rank}"


def _provenance(info: dict) -> list[str]:
    """Who wrote the file, what it fits, and what stock ComfyUI would make of it."""
    lines = [
        f"  written by     {info.get('writer', 'unknown')}",
        f"  fits arch      {info.get('arch_fit') or '(none known)'}",
        f"  adapters       {', '.join(info.get('kinds', [])) or '(none)'}",
    ]
    missed = info.get("comfyui_unmatched", 0)
    if missed:
        examples = ", ".join(info["comfyui_unmatched_keys"][:3])
        lines.append(
            f"  ComfyUI        would leave {missed} key(s) unmatched as is (e.g. {examples}); "
            "`python -m trainer convert` writes a file it loads key for key"
        )
    else:
        lines.append("  ComfyUI        loads every key as is")
    if info.get("unplaced"):
        lines.append(
            f"  not placed     {len(info['unplaced'])} key(s) fit no module: {', '.join(info['unplaced'][:5])}"
        )
    return lines


def _describe_adapters(path, lora: Lora, fmt: str, metadata, header) -> dict:
    """A Kiln LoKr/LoHa/DoRA file: a row per module with its kind and tensors."""
    prefix = COMFY_PREFIX if fmt == "comfy" else KOHYA_PREFIX
    table = [
        {
            "name": name,
            "kind": w.kind,
            "rank": w.rank or None,  # a full-matrix LoKr has no rank
            "alpha": w.alpha,
            "parameters": w.size,
            "dtype": header[
                next(
                    k
                    for k in adapter_kinds.file_tensors(
                        prefix + (name if fmt == "comfy" else name.replace(".", "_")), w
                    )
                    if not k.endswith((".alpha", ".dora_scale"))
                )
            ]["dtype"],
            "tensors": {role: list(t.shape) for role, t in w.tensors.items()},
        }
        for name, w in lora.items()
    ]
    return {**summary(path, fmt, lora, table, metadata, header), "adapter": sorted({w.kind for w in lora.values()})}
