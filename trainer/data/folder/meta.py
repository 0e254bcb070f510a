"""dataset.json, the optional description of a dataset at its root (DatasetMeta): read and checked.
Bad JSON or a bad value is fatal, an unknown key a warning; each problem says the fix."""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path

from ...config import BOUNDS, CHOICES
from .report import META_FILE, DatasetMeta, Problem, fatal

META_TYPES = ("character", "style", "concept", "")
# The keys that take a number (the setting's bounds), and those that take one of a few words.
NUMBERS = {"repeats": int, "frames": int, "frame_windows": int, "fps": float}
WORDS = {"type": META_TYPES, "frame_extraction": CHOICES["frame_extraction"]}


def read_meta(root: Path) -> tuple[DatasetMeta, list[Problem]]:
    """dataset.json at the root, if any. Bad JSON or a bad value is fatal; an unknown key a warning."""
    path = root / META_FILE
    if not path.is_file():
        return DatasetMeta(), []
    raw, problem = _parse(path)
    if problem is not None:
        return DatasetMeta(), [problem]
    return _checked(raw)


def _parse(path: Path) -> tuple[dict, Problem | None]:
    """The file's JSON object, or the fatal problem that stops it being read as one."""
    try:
        raw = json.loads(path.read_bytes().decode("utf-8-sig"))
    except OSError as err:
        return {}, fatal(
            "dataset_json_unreadable", META_FILE, f"cannot read: {err.strerror or err}", "check the file's permissions"
        )
    except UnicodeDecodeError as err:
        return {}, fatal(
            "dataset_json_syntax", META_FILE, f"not UTF-8 (byte offset {err.start})", "re-save it as UTF-8"
        )
    except json.JSONDecodeError as err:
        return {}, fatal(
            "dataset_json_syntax",
            META_FILE,
            f"invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}",
            "fix the JSON there (a missing comma or quote, or a trailing comma?)",
        )
    if not isinstance(raw, dict):
        return {}, fatal(
            "dataset_json_value",
            META_FILE,
            f"must be a JSON object, got {_kind(raw)}",
            'write an object, e.g. {"trigger_word": "ohwx", "type": "character"}',
        )
    return raw, None


def _checked(raw: dict) -> tuple[DatasetMeta, list[Problem]]:
    """The known keys with good values; a warning per unknown key, a fatal problem per bad value."""
    names = [f.name for f in dataclasses.fields(DatasetMeta)]
    values, problems = {}, []
    for key, value in raw.items():
        if key not in names:
            match = difflib.get_close_matches(key, names, 1)
            hint = f" (did you mean {match[0]!r}?)" if match else ""
            problems.append(
                Problem(
                    "dataset_json_unknown_key",
                    META_FILE,
                    f"unknown key {key!r}{hint}; ignored",
                    f"rename or remove it; known keys: {', '.join(names)}",
                    "warning",
                )
            )
        elif (error := meta_value_error(key, value)) is not None:
            problems.append(
                fatal(
                    "dataset_json_value",
                    META_FILE,
                    f"{key!r}: {error}",
                    f"correct {key!r} in {META_FILE}, or remove it",
                )
            )
        else:
            values[key] = list(value) if key == "resolutions" else value
    return DatasetMeta(**values), problems


def meta_value_error(key: str, value) -> str | None:
    """What is wrong with one dataset.json value (None when it is fine); the editor checks with it too."""
    if key in ("resolutions", "frame_extraction", *NUMBERS) and value is None:
        return None
    if key == "resolutions":
        low, high = BOUNDS["resolutions"]
        if not isinstance(value, list) or not value or not all(_is_int(v) and low <= v <= high for v in value):
            return f"must be a list of whole numbers {low:g}..{high:g}, e.g. [512, 768], got {value!r}"
        return None
    if key in NUMBERS:
        (low, high), kind = BOUNDS[key], NUMBERS[key]
        fits = (_is_int(value) or (kind is float and isinstance(value, float))) and low <= value <= high
        return None if fits else f"must be a {'whole ' * (kind is int)}number {low:g}..{high:g}"
    if not isinstance(value, str):
        return f"must be a string, got {_kind(value)}"
    if key in WORDS and value not in WORDS[key]:
        match = difflib.get_close_matches(value, WORDS[key], 1)
        return f"must be one of {', '.join(map(repr, WORDS[key]))}, got {value!r}" + (
            f" (did you mean {match[0]!r}?)" if match else ""
        )
    return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null"}.get(
        type(value), f"the number {value!r}"
    )
