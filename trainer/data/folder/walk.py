"""Walking a dataset folder: every file below the root with its kohya-style repeats, and the candidate
dataset folders a picker lists. Names only: nothing here reads a file's bytes."""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ...config import BOUNDS
from ..companions import is_companion
from .images import CLIP_FORMATS, IMAGE_EXTENSIONS
from .report import Problem

REPEAT_FOLDER = re.compile(r"^(\d+)_(.+)$")
# A link the walk cannot follow: (code, message, fix), all "skipped".
LINK_PROBLEMS = {
    "broken": ("broken_link", "a link whose target does not exist", "point it at the file, or delete it"),
    "loop": (
        "symlink_loop",
        "a link that leads back to itself; not followed",
        "point it at a real file or folder, or delete it",
    ),
}


@dataclass(frozen=True)
class FolderFile:
    rel: str  # relative to the root, '/'-separated
    path: Path
    repeats: int


def stem(rel: str) -> str:
    """The path without its extension: an image and its caption share it."""
    return rel.rsplit(".", 1)[0]


def walk(root: Path) -> tuple[list[FolderFile], list[Problem]]:
    """Every file below root, sorted, skipping hidden entries; each directory's real path visited once."""
    files, problems = [], []
    seen = {os.path.realpath(root)}
    stack = [(root, "", 1)]
    while stack:
        folder, rel, repeats = stack.pop()
        try:
            with os.scandir(folder) as entries:
                entries = sorted(entries, key=lambda entry: entry.name)
        except OSError as err:
            problems.append(
                Problem(
                    "unreadable_folder",
                    rel,
                    f"cannot list this folder: {err.strerror or err}",
                    "check its permissions",
                    "warning",
                )
            )
            continue
        for entry in entries:
            if entry.name.startswith("."):  # .kiln_cache, .git, .DS_Store, macOS "._" files
                continue
            child, kind = f"{rel}/{entry.name}" if rel else entry.name, _entry_kind(entry)
            if kind == "dir":
                problems += _enter(entry, child, repeats, seen, stack)
            elif kind == "file":
                files.append(FolderFile(child, Path(entry.path), repeats))
            elif kind in LINK_PROBLEMS:
                problems.append(Problem(LINK_PROBLEMS[kind][0], child, *LINK_PROBLEMS[kind][1:], "skipped"))
    files.sort(key=lambda file: file.rel.split("/"))
    return files, problems


def _enter(entry: os.DirEntry, rel: str, repeats: int, seen: set[str], stack: list) -> list[Problem]:
    """Push a sub-folder onto the walk's stack unless its real path was visited; the problems it raises."""
    real = os.path.realpath(entry.path)
    if real in seen:
        return [
            Problem(
                "symlink_loop",
                rel,
                f"links to {real}, which is already scanned; not followed again",
                "remove the link if it is a loop",
                "warning",
            )
        ]
    seen.add(real)
    child_repeats, problem = _folder_repeats(entry.name, rel, repeats)
    stack.append((Path(entry.path), rel, child_repeats))
    return [problem] if problem else []


def _entry_kind(entry: os.DirEntry) -> str:
    """'dir' or 'file' (links followed), 'broken' (a link to nothing), 'loop' (a link chain that comes
    back to itself), or 'other' (sockets, no permission)."""
    try:
        return "dir" if entry.is_dir() else "file" if entry.is_file() else "broken" if entry.is_symlink() else "other"
    except OSError as err:
        return "loop" if err.errno == errno.ELOOP else "other"


def _folder_repeats(name: str, rel: str, inherited: int) -> tuple[int, Problem | None]:
    """kohya-style `N_name`: N repeats for everything below (the nearest such folder wins)."""
    match = REPEAT_FOLDER.match(name)
    if not match:
        return inherited, None
    count, (low, high) = int(match.group(1)), BOUNDS["repeats"]
    if low <= count <= high:
        return count, None
    return inherited, Problem(
        "repeats_out_of_range",
        rel,
        f"the folder name asks for {count} repeats, outside {low:g}..{high:g}; its images use {inherited}",
        "rename it (e.g. 'photos_2024' if the number is a date, or '10_name' for 10 repeats)",
        "warning",
    )


@dataclass(frozen=True)
class FolderSummary:
    """A candidate dataset folder, as Load Dataset's picker lists it (names and counts, no reading)."""

    name: str
    images: int  # stills
    captions: int
    clips: int = 0  # last, with a default: a summary built before clips were counted apart still builds

    def describe(self) -> str:
        """'4 images, 4 captions', '1 clip, 1 caption', '2 clips, 3 images, 5 captions' (a mixed folder)."""
        counts = ((self.clips, "clip"), (self.images, "image"))
        media = [_count(n, word) for n, word in counts if n] or [_count(0, "image")]
        return ", ".join([*media, _count(self.captions, "caption")])


def _count(number: int, word: str) -> str:
    return f"{number} {word}{'s' * (number != 1)}"


def list_datasets(root: str | Path, most_files: int = 100_000) -> list[FolderSummary]:
    """Each folder directly under root that holds images or clips (at any depth, as `N_name/` sub-folders do),
    by name; hidden folders (.kiln_cache, .trash) are left out. Only names are listed, nothing is read;
    at most `most_files` entries are counted per folder, so a huge input/ cannot stall the page."""
    root = Path(root)
    found = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        images = clips = captions = seen = 0
        for where, dirs, files in os.walk(folder, followlinks=False):
            top = where == str(folder)  # control/ folders and name.mask.png files are no training images
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not (top and is_companion(f"{d}/x")))
            for name in files:
                suffix, counted = os.path.splitext(name)[1].lower(), not name.startswith(".") and not is_companion(name)
                images += counted and suffix in IMAGE_EXTENSIONS
                clips += counted and suffix in CLIP_FORMATS
                captions += suffix == ".txt" and not name.startswith(".")
            seen += len(files)
            if seen >= most_files:
                break
        if images or clips:
            found.append(FolderSummary(folder.name, images, captions, clips))
    return found
