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
"""
from __future__ import annotations

import codecs
import errno
import hashlib
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ...config import BOUNDS
from ..companions import attach, is_companion
from .images import (
    EXTENSION_FORMATS,
    IMAGE_EXTENSIONS,
    ImageInfo,
    ImageProblem,
    probe,
    sniff,
    verify,
)
from .meta import META_FILE, read_meta
from .report import DatasetMeta, Item, Problem, ScanReport, fatal

REPEAT_FOLDER = re.compile(r"^(\d+)_(.+)$")
DEFAULT_RESOLUTIONS = (512,)
# Image formats people drop into datasets that we do not decode: skipped, with a fix.
UNSUPPORTED_IMAGES = {".gif": "GIF", ".heic": "HEIC", ".heif": "HEIF", ".avif": "AVIF", ".jxl": "JPEG XL",
                      ".svg": "SVG", ".psd": "Photoshop", ".tga": "TGA", ".ico": "ICO", ".jp2": "JPEG 2000",
                      ".dng": "camera raw", ".cr2": "camera raw",
                      ".cr3": "camera raw", ".nef": "camera raw", ".arw": "camera raw", ".raf": "camera raw",
                      ".orf": "camera raw", ".rw2": "camera raw"}
# Files that belong in or near a dataset (caches, configs, notes): ignored without a word.
# .bak: captions Kiln Caption Images replaced (photo.txt.bak).
QUIET_EXTENSIONS = {".npz", ".npy", ".safetensors", ".pt", ".pth", ".ckpt", ".json", ".jsonl", ".toml", ".yaml",
                    ".yml", ".md", ".log", ".ini", ".db", ".csv", ".bak"}
NOTE_FIX = "none needed"
EXTENSION_OF = {"PNG": "png", "WEBP": "webp", "BMP": "bmp", "TIFF": "tif"}   # JPEG and MPO: jpg


@dataclass(frozen=True)
class _File:
    rel: str        # relative to the root, '/'-separated
    path: Path
    repeats: int


def scan(root: str | Path, *, deep: bool = False, resolutions: Sequence[int] | None = None, min_side: int = 64,
         workers: int | None = None) -> ScanReport:
    """Scan `root`; see the module docstring for what the fast and deep scans catch.

    resolutions: the bucket resolutions, to warn about images that would train
    smaller (default: dataset.json's, else 512). Item.repeats comes from the
    `N_name/` folders only; dataset.json's `repeats` multiplies it later, in the
    dataset. workers: threads for reading and decoding (default: all cores).
    """
    root = Path(root)
    report = ScanReport(root=str(root), meta=DatasetMeta(), deep=deep)
    if not root.is_dir():
        report.problems.append(
            fatal("root_not_dir", "", f"{root} is a file, not a folder", "give the folder that holds the images")
            if root.exists() else
            fatal("root_missing", "", f"the folder {root} does not exist",
                   "check the path (absolute, or relative to where you run this)"))
        return report
    report.meta, problems = read_meta(root)
    files, walk_problems = _walk(root)
    images, captions, companion_files = [], {}, []
    for file in files:
        suffix = Path(file.rel).suffix.lower()
        if is_companion(file.rel):       # masks and control images follow their image (companions.py)
            companion_files.append(file.rel)
        elif suffix in IMAGE_EXTENSIONS:
            images.append(file)
        elif suffix == ".txt":
            captions[_stem(file.rel)] = file
        elif (problem := _other_file(file, suffix)) is not None:
            problems.append(problem)
    min_area = min(resolutions or report.meta.resolutions or DEFAULT_RESOLUTIONS) ** 2
    with ThreadPoolExecutor(max(1, workers or os.cpu_count() or 1)) as pool:
        checked = list(pool.map(lambda file: _check_image(file, deep, min_side, min_area), images))
    report.items, item_problems = _collect(images, checked, captions)
    report.items, companion_problems = attach(root, report.items, companion_files)
    problems += walk_problems + item_problems + companion_problems
    if not report.items:
        problems.append(fatal("no_images", "", "no usable images in this folder"
                               + (f" ({len(images)} image files, all skipped)" if images else ""),
                               "add .png/.jpg/.webp images (with same-name .txt captions), or fix the skipped ones"))
    report.problems = sorted(problems, key=lambda p: (p.file != "", p.file.split("/")))
    return report


def _collect(images: list[_File], checked: list, captions: dict[str, _File]) -> tuple[list[Item], list[Problem]]:
    """Items in file order, captions read, duplicates dropped (_keep_among_copies decides), leftover captions named."""
    problems, read, unused = [], {}, {}
    caption_for = _caption_matcher(captions, images)
    for index, (file, (info, _, image_problems)) in enumerate(zip(images, checked)):
        problems += image_problems
        caption_file = caption_for(_stem(file.rel))
        if info is None:
            if caption_file is not None:
                unused.setdefault(caption_file.rel, file.rel)
        elif caption_file is not None:
            read[index] = read_caption(caption_file.path, caption_file.rel)
    kept_copy = _keep_among_copies(images, checked, {index: caption for index, (caption, _) in read.items()})
    items, duplicate_captions = [], {}
    for index, (file, (info, sha256, _)) in enumerate(zip(images, checked)):
        if info is None:
            continue
        caption_file, (caption, caption_problems) = caption_for(_stem(file.rel)), read.get(index, (None, []))
        if (kept := kept_copy[sha256]) != index:
            kept_file, kept_caption = images[kept], caption_for(_stem(images[kept].rel))
            problems.append(Problem("duplicate", file.rel, f"a byte-identical copy of {kept_file.rel}",
                                    f"delete one of the two; {kept_file.rel} is used, "
                                    + (f"with its caption {kept_caption.rel}" if kept_caption else "without a caption")
                                    + " (to weight an image, use an N_name/ repeat folder)", "skipped"))
            if caption_file is not None:
                duplicate_captions.setdefault(caption_file.rel, _duplicate_caption(
                    caption_file.rel, file.rel, caption, kept_file.rel, kept_caption, read.get(kept, (None,))[0]))
            continue
        problems += caption_problems
        if caption_file is None:
            problems.append(Problem("caption_missing", file.rel, f"no caption file {_stem(file.rel)}.txt",
                                    "write one; until then it trains with dataset.json's default_caption "
                                    "or the trigger word", "warning"))
        items.append(Item(path=file.rel, width=info.width, height=info.height, sha256=sha256, caption=caption,
                          caption_file=caption_file.rel if caption_file else None, repeats=file.repeats,
                          image_format=info.format, mode=info.mode, notes=list(info.notes)))
    used = {item.caption_file for item in items}
    for caption_file in captions.values():
        if caption_file.rel in used:
            continue
        if caption_file.rel in duplicate_captions:
            problems.append(duplicate_captions[caption_file.rel])
        elif caption_file.rel in unused:
            problems.append(Problem("caption_unused", caption_file.rel, f"not used: its image "
                                    f"{unused[caption_file.rel]} was skipped", "fix or replace the image", "note"))
        else:
            problems.append(Problem("caption_orphan", caption_file.rel, "a caption with no image of the same name",
                                    "rename it to match its image, or delete it", "warning"))
    return items, problems


def _keep_among_copies(images: list[_File], checked: list, caption_of: dict[int, str | None]) -> dict[str, int]:
    """sha256 → the index of the one byte-identical copy that trains: a copy with caption text over one
    without, then the shortest path (the original, not "photo copy.png" or "photo (1).png"), then the
    first in file order (sorted paths). The scan, and so the dataset and training, take the rule from here."""
    def rank(index: int) -> tuple:
        return not caption_of.get(index), len(images[index].rel), index

    kept: dict[str, int] = {}
    for index, (info, sha256, _) in enumerate(checked):
        if info is not None and (sha256 not in kept or rank(index) < rank(kept[sha256])):
            kept[sha256] = index
    return kept


def _duplicate_caption(rel: str, image: str, caption: str | None, kept: str, kept_caption: _File | None,
                       kept_text: str | None) -> Problem:
    """The caption of a duplicate that does not train: a note, or a warning when its text is lost."""
    if not caption or caption == kept_text or kept_caption is None:
        return Problem("duplicate_caption", rel, f"not used: the caption of {image}, a duplicate of {kept} "
                       "that is not used", "none needed; delete it with its image", "note")
    return Problem("duplicate_caption", rel, f"not used: the caption of {image}, a duplicate of {kept}, and it "
                   f"differs from {kept_caption.rel}: {kept} trains with {kept_caption.rel}'s text",
                   f"merge the two captions into {kept_caption.rel}, then delete {image} and {rel}", "warning")


def _check_image(file: _File, deep: bool, min_side: int, min_area: int) -> tuple[ImageInfo | None, str, list[Problem]]:
    """One image: (info or None when skipped, sha256 of the bytes, problems). Runs in a worker thread."""
    def skipped(code: str, message: str, fix: str) -> tuple[None, str, list[Problem]]:
        return None, sha256, [Problem(code, file.rel, message, fix, "skipped")]

    try:
        data = file.path.read_bytes()
    except OSError:
        data = None                        # probe reads it again and names the error
    sha256 = hashlib.sha256(data or b"").hexdigest()
    try:
        complete = data is not None and _ends_complete(data)
        info = verify(file.path, data) if deep or not complete else probe(file.path, data)
    except ImageProblem as problem:
        return skipped(problem.code, problem.message, problem.fix)
    if min(info.width, info.height) < min_side:
        return skipped("too_small", f"{info.width}×{info.height} px: a side is under {min_side} px",
                       "use a larger version of the image, or delete it")
    problems = []
    if info.width * info.height < min_area:
        side = int(min_area ** 0.5)
        problems.append(Problem("below_resolution", file.rel,
                                f"{info.width}×{info.height} px is under {side}×{side}: it trains at a lower "
                                "resolution (images are never upscaled)",
                                "use a larger version, or accept it as a low-resolution sample", "warning"))
    suffix = Path(file.rel).suffix.lower()
    if info.format not in EXTENSION_FORMATS[suffix]:
        problems.append(Problem("mislabelled", file.rel, f"a {info.format} file named {suffix}; read as {info.format}",
                                f"optional: rename it to .{EXTENSION_OF.get(info.format, 'jpg')}", "note"))
    if info.conversions:
        problems.append(Problem("converted", file.rel, "; ".join(info.conversions),
                                f"{NOTE_FIX}: converted when loaded", "note"))
    if info.rotation:
        problems.append(Problem("exif_rotated", file.rel, f"{info.rotation}: used as {info.width}×{info.height}",
                                f"{NOTE_FIX}: turned upright when loaded", "note"))
    return info, sha256, problems


def _caption_matcher(captions: dict[str, _File], images: list[_File]):
    """stem → its .txt; failing that, the one .txt that differs only in case (Windows and macOS match so)."""
    folded: dict[str, list[str]] = {}
    for stem in captions:
        folded.setdefault(stem.lower(), []).append(stem)
    image_stems = {_stem(image.rel) for image in images}

    def caption_for(stem: str) -> _File | None:
        if stem in captions:
            return captions[stem]
        near = folded.get(stem.lower(), [])
        return captions[near[0]] if len(near) == 1 and near[0] not in image_stems else None
    return caption_for


def _ends_complete(data: bytes) -> bool:
    """Does the file end where its format says it should? (False sends it to a full decode.)"""
    kind, tail = sniff(data[:16]), data[-64:]
    if kind == "JPEG":
        return b"\xff\xd9" in tail
    if kind == "PNG":
        return b"IEND" in tail
    if kind == "WEBP":
        return len(data) >= int.from_bytes(data[4:8], "little") + 8
    return True


def read_caption(path: Path, rel: str) -> tuple[str | None, list[Problem]]:
    """A caption's text, stripped; None when it cannot be used. Never raises.

    UTF-8 (with or without a BOM) and UTF-16 with a BOM are read as they are.
    Anything else is read as Windows-1252 (the usual non-UTF-8 caption) with a
    warning naming the first bad byte. A file with control bytes is not text:
    it gives None (the dataset then falls back as for a missing caption).
    """
    def problem(code: str, message: str, fix: str, severity: str = "warning") -> Problem:
        return Problem(code, rel, message, fix, severity)

    try:
        raw = path.read_bytes()
    except OSError as err:
        return None, [problem("caption_unreadable", f"cannot read the caption: {err.strerror or err}",
                              "check the file's permissions")]
    problems = []
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):     # Notepad's "Unicode"
        text = raw.decode("utf-16", errors="replace")
    else:
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as err:
            text = raw.decode("cp1252", errors="replace")
            problems.append(problem("caption_not_utf8", f"not UTF-8 (byte 0x{raw[err.start]:02X} at offset "
                                    f"{err.start}); read as Windows-1252: {text.strip()[:60]!r}",
                                    "if that reads wrong, re-save the file as UTF-8 "
                                    "(most editors: Save As → Encoding: UTF-8)"))
    if any(ord(ch) < 32 and ch not in "\t\n\r" or 0x7F <= ord(ch) < 0xA0 for ch in text):
        return None, [problem("caption_not_text", "contains control bytes: not a text file; caption not used",
                              "write the caption as plain UTF-8 text")]
    text = text.strip()
    if not text:
        problems.append(problem("caption_empty", "the caption file is empty: the image trains with "
                                "dataset.json's default_caption or the trigger word", "write a caption in it"))
    return text, problems


def _walk(root: Path) -> tuple[list[_File], list[Problem]]:
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
            problems.append(Problem("unreadable_folder", rel, f"cannot list this folder: {err.strerror or err}",
                                    "check its permissions", "warning"))
            continue
        for entry in entries:
            if entry.name.startswith("."):        # .kiln_cache, .git, .DS_Store, macOS "._" files
                continue
            child, kind = f"{rel}/{entry.name}" if rel else entry.name, _entry_kind(entry)
            if kind == "dir":
                real = os.path.realpath(entry.path)
                if real in seen:
                    problems.append(Problem("symlink_loop", child, f"links to {real}, which is already scanned; "
                                            "not followed again", "remove the link if it is a loop", "warning"))
                    continue
                seen.add(real)
                child_repeats, problem = _folder_repeats(entry.name, child, repeats)
                problems += [problem] if problem else []
                stack.append((Path(entry.path), child, child_repeats))
            elif kind == "file":
                files.append(_File(child, Path(entry.path), repeats))
            elif kind == "broken":
                problems.append(Problem("broken_link", child, "a link whose target does not exist",
                                        "point it at the file, or delete it", "skipped"))
            elif kind == "loop":
                problems.append(Problem("symlink_loop", child, "a link that leads back to itself; not followed",
                                        "point it at a real file or folder, or delete it", "skipped"))
    files.sort(key=lambda file: file.rel.split("/"))
    return files, problems


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
    return inherited, Problem("repeats_out_of_range", rel, f"the folder name asks for {count} repeats, outside "
                              f"{low:g}..{high:g}; its images use {inherited}",
                              "rename it (e.g. 'photos_2024' if the number is a date, or '10_name' for 10 "
                              "repeats)", "warning")


def _other_file(file: _File, suffix: str) -> Problem | None:
    """Not an image we read and not a caption: skipped if it is an image in another format, else ignored."""
    name = Path(file.rel).name
    if suffix in UNSUPPORTED_IMAGES:
        kind = UNSUPPORTED_IMAGES[suffix]
        return Problem("unsupported_format", file.rel, f"{kind} images are not read", "convert it to PNG or JPEG",
                       "skipped")
    if name == META_FILE and file.rel != META_FILE:
        return Problem("dataset_json_nested", file.rel, f"only the {META_FILE} at the dataset root is read",
                       "move its settings to the root's dataset.json", "note")
    if suffix in QUIET_EXTENSIONS or name.lower() in ("thumbs.db", "desktop.ini"):
        return None
    return Problem("ignored_file", file.rel, "not an image or a .txt caption; ignored", NOTE_FIX, "note")


def _stem(rel: str) -> str:
    return rel.rsplit(".", 1)[0]


@dataclass(frozen=True)
class FolderSummary:
    """A candidate dataset folder, as Load Dataset's picker lists it (names and counts, no reading)."""
    name: str
    images: int
    captions: int

    def describe(self) -> str:
        return f"{self.images} image{'s' * (self.images != 1)}, {self.captions} caption{'s' * (self.captions != 1)}"


def list_datasets(root: str | Path, most_files: int = 100_000) -> list[FolderSummary]:
    """Each folder directly under root that holds images (at any depth, as `N_name/` sub-folders do),
    by name; hidden folders (.kiln_cache, .trash) are left out. Only names are listed, nothing is read;
    at most `most_files` entries are counted per folder, so a huge input/ cannot stall the page."""
    root = Path(root)
    found = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        images = captions = seen = 0
        for where, dirs, files in os.walk(folder, followlinks=False):
            top = where == str(folder)   # control/ folders and name.mask.png files are no training images
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not (top and is_companion(f"{d}/x")))
            for name in files:
                suffix = os.path.splitext(name)[1].lower()
                images += suffix in IMAGE_EXTENSIONS and not name.startswith(".") and not is_companion(name)
                captions += suffix == ".txt" and not name.startswith(".")
            seen += len(files)
            if seen >= most_files:
                break
        if images:
            found.append(FolderSummary(folder.name, images, captions))
    return found
