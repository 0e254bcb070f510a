"""Config files: a TrainConfig read from and written to .toml or .json, every error naming the file.

TOML is written without a dependency (the values a TrainConfig holds are scalars, lists and sample-prompt
tables); reading uses the standard library's tomllib (tomli on Python 3.10).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (ComfyUI still supports it)
    import tomli as tomllib

from .build import from_dict
from .declaration import ConfigError
from .fields import TrainConfig


def load(path: str | Path) -> TrainConfig:
    """Read a .toml or .json config; errors name the file."""
    path = Path(path)
    parsers = {".json": (json.loads, json.JSONDecodeError), ".toml": (tomllib.loads, tomllib.TOMLDecodeError)}
    if path.suffix.lower() not in parsers:
        raise ConfigError(f"{path}: config must end in .toml or .json")
    parse, parse_error = parsers[path.suffix.lower()]
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read config ({err})") from err
    try:
        values = parse(text)
    except parse_error as err:
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {err}") from err
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: the top level must be a table of settings")
    try:
        return from_dict(values)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def save(cfg: TrainConfig, path: str | Path) -> None:
    """Write .toml or .json (atomically: a crash never leaves half a config)."""
    from ..atomic import atomic_write_text

    path = Path(path)
    data = cfg.to_dict()
    if path.suffix.lower() == ".json":
        text = json.dumps(data, indent=2) + "\n"
    elif path.suffix.lower() == ".toml":
        text = "".join(f"{key} = {_toml_value(value)}\n" for key, value in data.items())
    else:
        raise ConfigError(f"{path}: config must end in .toml or .json")
    atomic_write_text(path, text)


def _toml_value(value: Any) -> str:
    """TOML for the values a TrainConfig holds: scalars, lists, a sample prompt's table (no extra dependency)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):  # a sample prompt's table, inline; its keys are PROMPT_KEYS (bare keys)
        return "{" + ", ".join(f"{key} = {_toml_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, str):
        # JSON's escapes are TOML's, but not its \uD83D\uDE00 surrogate pairs: non-ASCII stays literal
        # UTF-8 (emoji in a trigger word), and DEL, which TOML forbids raw, is escaped.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return "[" + ", ".join(_toml_value(item) for item in value) + "]"
