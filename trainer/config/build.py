"""A TrainConfig from plain values: defaults, then a preset, then the values, each checked (checks.py)."""

from __future__ import annotations

import difflib
from typing import Any

from .checks import check_combinations, check_value
from .declaration import ConfigError
from .fields import FIELDS, TrainConfig
from .presets import PRESETS

__all__ = ["from_dict", "replace", "validate"]


def from_dict(values: dict[str, Any], *, preset: str | None = None) -> TrainConfig:
    """Defaults, then the preset (argument or `preset` key), then `values`; validated."""
    values = dict(values)
    preset = values.pop("preset", None) or preset
    merged: dict[str, Any] = {}
    if preset:
        if not isinstance(preset, str) or preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of {list(PRESETS)}")
        merged.update(PRESETS[preset])
    unknown = [key for key in values if key not in FIELDS]
    if unknown:
        hints = [
            f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, FIELDS, 1)) else repr(k)
            for k in unknown
        ]
        raise ConfigError(f"unknown config key(s): {', '.join(hints)}")
    merged.update(values)
    cfg = TrainConfig(**{key: check_value(key, value) for key, value in merged.items()})
    check_combinations(cfg)
    return cfg


def validate(cfg: TrainConfig) -> TrainConfig:
    """Re-check a config built or edited in code."""
    return from_dict(cfg.to_dict())


def replace(cfg: TrainConfig, **changes: Any) -> TrainConfig:
    return from_dict({**cfg.to_dict(), **changes})
