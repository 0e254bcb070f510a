"""Scan a dataset folder: which images are usable, which are not and why, each with a fix.

The folder holds images with same-stem `.txt` captions, in any nesting;
kohya-style `N_name/` folders give their images N repeats, and an optional
`dataset.json` at the root describes the set (DatasetMeta). Nothing here
raises on a bad file: every file ends up as an Item or named in a Problem.

The fast scan (the default) reads each image file once: it hashes the bytes
(for duplicates), parses the header (size, mode, EXIF orientation) and checks
that a JPEG ends with its end-of-image marker, a PNG with its IEND chunk and a
WebP is as long as its RIFF header says; a file that fails that check is
decoded in full there and then. So it catches empty, unreadable, mislabelled,
unsupported, too small, too large and truncated files. It cannot catch damage
inside the compressed data of a file whose header and end are intact, nor a
truncated BMP or TIFF: `deep=True` decodes every pixel and catches those too.

The steps, one module each: walk.py (the files below the root), check.py (one image),
caption_files.py (one caption) and items.py (images and captions to items, duplicates).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..companions import attach, is_companion
from ..frames import FrameSettings
from .caption_files import read_caption
from .check import EXTENSION_OF, NOTE_FIX, check_image
from .clips import check_clip
from .images import CLIP_FORMATS, IMAGE_EXTENSIONS
from .items import collect
from .meta import META_FILE, read_meta
from .report import DatasetMeta, Problem, ScanReport, fatal
from .walk import FolderFile, FolderSummary, list_datasets, stem, walk

# Importable from here as before: editing.py, uploads.py, nodes/folders.py and the tests use these names.
__all__ = ["EXTENSION_OF", "UNSUPPORTED_IMAGES", "FolderSummary", "list_datasets", "read_caption", "scan"]

DEFAULT_RESOLUTIONS = (512,)
# Image formats people drop into datasets that we do not decode: skipped, with a fix.
UNSUPPORTED_IMAGES = {
    ".heic": "HEIC",
    ".heif": "HEIF",
    ".avif": "AVIF",
    ".jxl": "JPEG XL",
    ".svg": "SVG",
    ".psd": "Photoshop",
    ".tga": "TGA",
    ".ico": "ICO",
    ".jp2": "JPEG 2000",
    ".dng": "camera raw",
    ".cr2": "camera raw",
    ".cr3": "camera raw",
    ".nef": "camera raw",
    ".arw": "camera raw",
    ".raf": "camera raw",
    ".orf": "camera raw",
    ".rw2": "camera raw",
}
# Files that belong in or near a dataset (caches, configs, notes): ignored without a word.
# .bak: captions Kiln Caption Images replaced (photo.txt.bak).
QUIET_EXTENSIONS = {
    ".npz",
    ".npy",
    ".safetensors",
    ".pt",
    ".pth",
    ".ckpt",
    ".json",
    ".jsonl",
    ".toml",
    ".yaml",
    ".yml",
    ".md",
    ".log",
    ".ini",
    ".db",
    ".csv",
    ".bak",
}


def scan(
    root: str | Path,
    *,
    deep: bool = False,
    resolutions: Sequence[int] | None = None,
    min_side: int = 64,
    workers: int | None = None,
    frames: FrameSettings | None = None,
) -> ScanReport:
    """Scan `root`; see the module docstring for what the fast and deep scans catch.

    resolutions: the bucket resolutions, to warn about images that would train smaller (default: dataset.json's,
    else 512). frames: how clips train (dataset.json's where at their defaults), to name clips too short for it.
    Item.repeats comes from the `N_name/` folders only; dataset.json's `repeats` multiplies it later, in the
    dataset. workers: threads for reading and decoding (default: all cores).
    """
    root = Path(root)
    report = ScanReport(root=str(root), meta=DatasetMeta(), deep=deep)
    if not root.is_dir():
        report.problems.append(
            fatal("root_not_dir", "", f"{root} is a file, not a folder", "give the folder that holds the images")
            if root.exists()
            else fatal(
                "root_missing",
                "",
                f"the folder {root} does not exist",
                "check the path (absolute, or relative to where you run this)",
            )
        )
        return report
    report.meta, problems = read_meta(root)
    files, walk_problems = walk(root)
    images, captions, companion_files = [], {}, []
    for file in files:
        suffix = Path(file.rel).suffix.lower()
        if is_companion(file.rel):  # masks and control images follow their image (companions.py)
            companion_files.append(file.rel)
        elif suffix in IMAGE_EXTENSIONS or suffix in CLIP_FORMATS:  # images and clips alike: "media"
            images.append(file)
        elif suffix == ".txt":
            captions[stem(file.rel)] = file
        elif (problem := _other_file(file, suffix)) is not None:
            problems.append(problem)
    min_area = min(resolutions or report.meta.resolutions or DEFAULT_RESOLUTIONS) ** 2
    frames = (frames or FrameSettings()).with_meta(report.meta)
    checked = _check_media(images, workers, deep, min_side, min_area, frames=frames)
    report.items, item_problems = collect(images, checked, captions)
    report.items, companion_problems = attach(root, report.items, companion_files)
    problems += walk_problems + item_problems + companion_problems
    if not report.items:
        problems.append(
            fatal(
                "no_images",
                "",
                "no usable images in this folder" + (f" ({len(images)} image files, all skipped)" if images else ""),
                "add .png/.jpg/.webp images or .mp4/.webm/.gif clips (with same-name .txt captions), or fix the rest",
            )
        )
    report.problems = sorted(problems, key=lambda p: (p.file != "", p.file.split("/")))
    return report


def _check_media(files: list[FolderFile], workers: int | None, deep: bool, *limits, frames: FrameSettings) -> list:
    """check_image's or check_clip's answer for each file, on worker threads, in file order."""

    def check(file: FolderFile):
        if Path(file.rel).suffix.lower() in CLIP_FORMATS:
            return check_clip(file, deep, *limits, frames)
        return check_image(file, deep, *limits)

    with ThreadPoolExecutor(max(1, workers or os.cpu_count() or 1)) as pool:
        return list(pool.map(check, files))


def _other_file(file: FolderFile, suffix: str) -> Problem | None:
    """Not an image we read and not a caption: skipped if it is an image in another format, else ignored."""
    name = Path(file.rel).name
    if suffix in UNSUPPORTED_IMAGES:
        kind = UNSUPPORTED_IMAGES[suffix]
        return Problem(
            "unsupported_format", file.rel, f"{kind} images are not read", "convert it to PNG or JPEG", "skipped"
        )
    if name == META_FILE and file.rel != META_FILE:
        return Problem(
            "dataset_json_nested",
            file.rel,
            f"only the {META_FILE} at the dataset root is read",
            "move its settings to the root's dataset.json",
            "note",
        )
    if suffix in QUIET_EXTENSIONS or name.lower() in ("thumbs.db", "desktop.ini"):
        return None
    return Problem("ignored_file", file.rel, "not an image or a .txt caption; ignored", NOTE_FIX, "note")
