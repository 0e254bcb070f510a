"""Names that become paths (a run name, a LoRA file name): refused when they could leave their folder.

A name is one or more parts of letters, digits, `- _ .` and spaces; sub-folders
with `/` only where the caller allows them. Absolute paths, `..`, backslashes,
drive letters and `~` are refused, and the joined path is resolved (links
followed) and must stay inside its root, so nothing is written elsewhere.
"""

from __future__ import annotations

import re
from pathlib import Path

_PART = re.compile(r"^[\w\-. ]+$")


def _problem(name: str, subfolders: bool) -> str | None:
    if not name.strip():
        return "is empty"
    if name.startswith(("/", "\\", "~")) or re.match(r"^[A-Za-z]:", name):
        return "is an absolute path"
    if "\\" in name or ("/" in name and not subfolders):
        return "has a path separator"
    parts = name.split("/")
    if any(set(part) <= {"."} or part != part.strip() for part in parts):
        return "has an empty, '.', '..' or space-padded part"
    if not all(_PART.match(part) for part in parts):
        return "has characters other than letters, digits, - _ . and spaces"
    return None


def check_name(name: str, what: str, *, subfolders: bool = False) -> str:
    """`name` itself, or ValueError naming `what` (the node and input, or the config file and key) and the fix."""
    problem = _problem(name if isinstance(name, str) else "", subfolders)
    if problem is None:
        return name
    allowed = "letters, digits, - _ . and spaces" + (", sub-folders with /" if subfolders else "")
    raise ValueError(
        f"{what}: {name!r} {problem}; give a plain name ({allowed}), not a path that leads outside its folder"
    )


def inside(root: str | Path, name: str, what: str, *, subfolders: bool = False, suffix: str = "") -> Path:
    """root/<name><suffix>, checked by check_name and, links resolved, still inside root."""
    check_name(name, what, subfolders=subfolders)
    root = Path(root).resolve()
    path = (root / f"{name}{suffix}").resolve()
    if root not in path.parents:
        raise ValueError(f"{what}: {name!r} leads to {path}, outside {root} (through a link?); choose another name")
    return path
