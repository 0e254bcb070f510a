"""Run folders named as the user typed them: <root>/<name>, and <name>-2, <name>-3, ... only on a clash.

A run's identity (a hash of everything that determines its result; nodes/run.py computes it) is written
into its folder when the folder is first taken (`identity.json`, atomically), so a re-queue finds its own
run among <name>, <name>-2, ... by reading that file, never by parsing a name. A folder is another run's
when it holds anything but an identity file: a new run then takes the next free suffix. Folders that
Kiln named <name>-<first 10 hex digits of the identity> before are still found (`legacy`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..atomic import atomic_write_text
from ..paths import check_name, inside

IDENTITY_FILE = "identity.json"
IDENTITY_FORMAT = "kiln-run-identity/1"
RUN_KEY = "kiln.run"  # the LoRA metadata key naming the run that wrote a file (Save LoRA, Save now, checkpoints)
LEGACY_HASH = 10  # hex digits of the identity in a folder name before identity files
_SUFFIX = re.compile(r"^-([1-9]\d{0,5})$")


def run_key(run_dir: str | Path) -> str:
    """Which run a LoRA file comes from, as its kiln.run records it: the run folder's name, one per run identity,
    the same across its stops and resumes. The one place that says so."""
    return Path(run_dir).name


def read_identity(folder: str | Path) -> str | None:
    """The identity written in a run folder, or None (no file, not ours, unreadable)."""
    try:
        info = json.loads((Path(folder) / IDENTITY_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(info, dict) or info.get("format") != IDENTITY_FORMAT:
        return None
    identity = info.get("identity")
    return identity if isinstance(identity, str) and identity else None


def write_identity(folder: str | Path, identity: str, name: str) -> None:
    text = json.dumps({"format": IDENTITY_FORMAT, "identity": identity, "name": name}, indent=1)
    atomic_write_text(Path(folder) / IDENTITY_FILE, text + "\n")


def legacy_name(name: str, identity: str) -> str:
    """The folder name Kiln gave a run before identity files: <name>-<first 10 hex digits>."""
    return f"{name}-{identity[:LEGACY_HASH]}"


def default_name(candidates: list[str], fallback: str) -> str:
    """The first of `candidates` (e.g. the dataset folder's name) that is a valid run name, else `fallback`."""
    for candidate in candidates:
        try:
            return check_name(candidate, "run name")
        except ValueError:
            continue
    return fallback


def _numbered(root: Path, name: str) -> list[Path]:
    """<name> and <name>-N under root that exist, in suffix order (case folded, as macOS and Windows match
    names)."""
    found, key = [], name.casefold()
    for child in root.iterdir() if root.is_dir() else []:
        folded = child.name.casefold()
        if folded == key:
            found.append((1, child))
        elif folded.startswith(key) and (match := _SUFFIX.match(folded[len(key) :])):
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def _free(folder: Path) -> bool:
    """Nothing there yet, or only an identity file (a run that failed before it wrote anything)."""
    if not folder.exists():
        return True
    return folder.is_dir() and {child.name for child in folder.iterdir()} <= {IDENTITY_FILE}


def find_or_claim(root: str | Path, name: str, identity: str, what: str, *, legacy: str | None = None) -> Path:
    """The folder of the run `identity` named `name` under root: its own (by identity file), else a legacy
    <legacy>-<hash> folder of the same identity, else <name> or the first free <name>-N, taken now (its
    identity written). `what` names the setting in errors (a name that would leave root)."""
    root = Path(root)
    check_name(name, what)
    for folder in _numbered(root, name):
        if read_identity(folder) == identity:
            return inside(root, folder.name, what)
    if legacy is not None and (old := inside(root, legacy_name(legacy, identity), what)).is_dir():
        return old
    number = 1
    while True:
        folder = inside(root, name if number == 1 else f"{name}-{number}", what)
        if _free(folder):
            folder.mkdir(parents=True, exist_ok=True)
            write_identity(folder, identity, name)
            return folder
        number += 1
