"""What `python -m trainer inspect` prints: a LoRA file's format, metadata and modules, for a person."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Mapping

from .. import safetensors_io
from ..config import TrainConfig
from . import adapter_files
from . import adapters as adapter_kinds
from .files import from_tensors
from .keys import (
    COMFY_PREFIX,
    FORMATS,
    KOHYA_PREFIX,
    Lora,
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
    """What `python -m trainer inspect` prints; works without arch or module names."""
    tensors, metadata = safetensors_io.read(path)
    header, _ = safetensors_io.read_header(path)
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
    """Another trainer's file, as Kiln reads it (fused, in ComfyUI paths)."""
    lora = from_tensors(tensors, metadata=metadata, source=str(path))[0]
    table = [
        {"name": name, "rank": w.rank, "alpha": w.alpha, "parameters": w.A.size + w.B.size, "dtype": "F32"}
        for name, w in lora.items()
    ]
    return summary(path, "foreign (read as comfy paths)", lora, table, metadata, header)


def summary(path, fmt: str, weights: Mapping, table: list[dict], metadata, header) -> dict:
    """describe()'s dict (lora_report.py prints it) from a file's modules (anything with rank and alpha) and
    their table rows."""
    return {
        "path": str(path),
        "format": fmt,
        "modules": len(weights),
        "ranks": sorted({w.rank for w in weights.values()}),
        "alphas": sorted({w.alpha for w in weights.values()}),
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
    lines.append("modules by block:")
    for group, rows in module_groups(info["module_table"]).items():
        lines.append(
            f"  {group}: "
            + ", ".join(
                f"{row['name']} {row['kind'] + ' ' if 'kind' in row else ''}r{row['rank']} α{_number(row['alpha'])} "
                f"{_DTYPE_NAMES.get(row['dtype'], row['dtype'])}"
                for row in rows
            )
        )
    lines.append(
        f"totals: {info['modules']} modules, {info['parameters']:,} parameters, "
        f"ranks {', '.join(map(str, info['ranks']))}, alphas {', '.join(map(_number, info['alphas']))}, "
        f"dtypes {', '.join(info['dtypes'])}"
    )
    return "\n".join(lines)


def _describe_adapters(path, lora: Lora, fmt: str, metadata, header) -> dict:
    """A Kiln LoKr/LoHa/DoRA file: a row per module with its kind and tensors."""
    prefix = COMFY_PREFIX if fmt == "comfy" else KOHYA_PREFIX
    table = [
        {
            "name": name,
            "kind": w.kind,
            "rank": w.rank,
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
