"""Editing a dataset folder in place, as the frontend's dataset editor does: create one (dataset.json),
list the gallery with each image's problems, edit captions one by one or in bulk, move images to
`.trash/`. Uploads are in uploads.py.

Every name a client sends goes through `inside()`: one or more plain path components (no `..`, no
absolute path, no hidden name, no drive letters or backslashes), and the real path, links followed,
must stay inside the allowed root. Every write is atomic (trainer/atomic.py); nothing is deleted.
Errors are EditError: an HTTP status and a message that names the file and the fix.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from ...atomic import atomic_write_text, fsync_dir
from ...errors import KilnError
from .clips import thumbnail
from .images import CLIP_FORMATS, IMAGE_EXTENSIONS, ImageProblem
from .meta import META_TYPES, meta_value_error
from .report import META_FILE
from .scan import UNSUPPORTED_IMAGES, list_datasets, read_caption, scan

TRASH = ".trash"
MEDIA = IMAGE_EXTENSIONS | set(UNSUPPORTED_IMAGES) | set(CLIP_FORMATS)  # what the gallery shows a card for
MAX_CAPTION_CHARS = 20_000
MAX_NAME_CHARS = 120
# One path component a client may name: no separators, drive colons, wildcards or control characters.
_BAD_CHARACTERS = re.compile(r'[\x00-\x1f\x7f/\\:*?"<>|]')


class EditError(KilnError):
    """A refused edit: `status` is the HTTP status the routes answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def check_component(name: str, what: str) -> str:
    """`name` as one plain path component, or EditError(400) saying why not."""
    if not isinstance(name, str) or not name.strip():
        raise EditError(400, f"{what} is empty; give a name such as 'my_dataset'")
    if name in (".", "..") or name.startswith("."):
        raise EditError(
            400, f"{what} {name!r}: names starting with '.' are hidden or lead out of the folder; give a plain name"
        )
    if _BAD_CHARACTERS.search(name) or name != name.strip() or name.endswith("."):
        raise EditError(
            400,
            f"{what} {name!r} has a character that cannot be in a file name "
            '(/ \\ : * ? " < > | or a control character, or spaces/a dot at an end); rename it',
        )
    if len(name) > MAX_NAME_CHARS:
        raise EditError(400, f"{what} is {len(name)} characters long; keep it under {MAX_NAME_CHARS}")
    return name


def _contains(root: Path, path: Path) -> bool:
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)


def inside(root: str | Path, rel: str, what: str = "path") -> Path:
    """root / rel, where rel is '/'-separated plain components and the real path (links followed)
    stays inside root; EditError(400) otherwise. The path need not exist."""
    if not isinstance(rel, str) or rel.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", rel):
        raise EditError(400, f"{what} {rel!r} must be relative to the dataset (e.g. 'photo.png'), not absolute")
    parts = rel.split("/")
    for part in parts:
        check_component(part, what)
    path = Path(root, *parts)
    if not _contains(Path(root), path):
        raise EditError(
            400,
            f"{what} {rel!r} is a link that leads out of {Path(root).name}/; copy the file in instead of linking it",
        )
    return path


def dataset_folder(root: str | Path, name: str) -> Path:
    """An existing dataset folder directly under root; 404 if there is none of that name."""
    folder = inside(root, check_component(name, "dataset name"), "dataset name")
    if not folder.is_dir():
        raise EditError(404, f"no dataset folder {name!r} in {Path(root).name}/; create it first")
    return folder


def list_folders(root: str | Path) -> list[dict]:
    """Datasets under root: every folder with images (as Load Dataset's picker lists them), and
    folders made by the editor that hold only a dataset.json so far. Folders linked in from elsewhere
    are left out: the editor does not write outside root (Load Dataset still reads them)."""
    root = Path(root)
    found = {f.name: f.describe() for f in list_datasets(root) if _contains(root, root / f.name)}
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if (
            folder.name not in found
            and not folder.name.startswith(".")
            and (folder / META_FILE).is_file()
            and _contains(root, folder)
        ):
            found[folder.name] = "no images yet"
    return [{"name": name, "detail": found[name]} for name in sorted(found)]


def create(root: str | Path, name: str, *, type: str = "", trigger_word: str = "", resolutions=None) -> dict:
    """A new dataset folder with its dataset.json; 409 if the folder exists."""
    folder = inside(root, check_component(name, "dataset name"), "dataset name")
    if folder.exists() or folder.is_symlink():
        raise EditError(409, f"{name!r} already exists in {Path(root).name}/; pick another name or open it")
    meta = {
        "name": name,
        "type": type or "",
        "trigger_word": (trigger_word or "").strip(),
        "resolutions": list(resolutions) if resolutions else None,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    for key, value in meta.items():
        if (error := meta_value_error(key, value)) is not None:
            raise EditError(
                400, f"{key}: {error}" + (f" ({', '.join(t for t in META_TYPES if t)})" if key == "type" else "")
            )
    folder.mkdir()
    atomic_write_text(
        folder / META_FILE, json.dumps({k: v for k, v in meta.items() if v not in (None, "")}, indent=2) + "\n"
    )
    return meta


def gallery(root: str | Path, name: str) -> dict:
    """The dataset as the editor shows it: dataset.json, each image with its caption and its problems,
    the problems of other files and of the dataset as a whole, and how many files are in the trash."""
    folder = dataset_folder(root, name)
    report = scan(folder)
    by_file: dict[str, list[dict]] = {}
    for problem in report.problems:
        by_file.setdefault(problem.file, []).append(asdict(problem))
    images = [
        {
            "path": item.path,
            "width": item.width,
            "height": item.height,
            "caption": item.caption or "",
            "caption_file": item.caption_file,
            "usable": True,
            "problems": by_file.pop(item.path, []) + by_file.pop(item.caption_file or "", []),
            **(_clip(folder, item) if item.is_clip else {}),
        }
        for item in report.items
    ]
    for path in [p for p in by_file if Path(p).suffix.lower() in MEDIA]:
        caption_path = inside(folder, path).with_suffix(".txt")
        caption = read_caption(caption_path, "")[0] if caption_path.is_file() else None
        images.append(
            {
                "path": path,
                "width": None,
                "height": None,
                "caption": caption or "",
                "caption_file": None,
                "usable": False,
                "problems": by_file.pop(path) + by_file.pop(Path(path).with_suffix(".txt").as_posix(), []),
            }
        )
    images.sort(key=lambda image: image["path"].split("/"))
    trash = folder / TRASH
    return {
        "name": name,
        "meta": asdict(report.meta),
        "images": images,
        "problems": [p for problems in by_file.values() for p in problems],
        "trash": sum(len(files) for _, _, files in os.walk(trash)) if trash.is_dir() else 0,
    }


def _clip(folder: Path, item) -> dict:
    """A clip's length and its first frame, a thumbnail the gallery shows (made once per content, in the cache)."""
    from ..dataset import CACHE_FOLDER

    try:
        shown = thumbnail(folder, item.path, item.sha256, folder / CACHE_FOLDER / "thumbnails")
    except ImageProblem:
        shown = None  # the problem shows when the clip is encoded; the card says so without a picture
    return {
        "frames": item.frames,
        "seconds": round(item.frames / item.fps, 2) if item.fps else None,
        "thumbnail": shown,
    }


def _image(folder: Path, rel: str) -> Path:
    path = inside(folder, rel, "image")
    if path.suffix.lower() not in MEDIA or not path.is_file():
        raise EditError(404, f"no image {rel!r} in {folder.name}/ (reload the dataset: it may have changed)")
    return path


def caption_path(image: Path) -> Path:
    """The image's caption file: same stem .txt, or the one that differs only in case (as the scan matches)."""
    exact = image.with_suffix(".txt")
    if exact.exists():
        return exact
    near = [p for p in image.parent.glob("*") if p.name.lower() == exact.name.lower() and p.suffix.lower() == ".txt"]
    return near[0] if len(near) == 1 else exact


def _check_text(text, rel: str) -> str:
    if not isinstance(text, str):
        raise EditError(400, f"caption for {rel}: must be text")
    if any(ord(ch) < 32 and ch not in "\t\n\r" or ord(ch) == 0x7F for ch in text):
        raise EditError(400, f"caption for {rel}: contains control characters; write plain text")
    if len(text) > MAX_CAPTION_CHARS:
        raise EditError(400, f"caption for {rel}: {len(text)} characters; keep it under {MAX_CAPTION_CHARS}")
    return text.strip()


def set_caption(root: str | Path, name: str, rel: str, text: str) -> dict:
    """Write one image's caption (atomically); the caption file is made when there was none."""
    folder = dataset_folder(root, name)
    target = caption_path(_image(folder, rel))
    if not _contains(folder, target):
        raise EditError(400, f"the caption of {rel} is a link that leads out of {name}/; replace it with a file")
    text = _check_text(text, rel)
    atomic_write_text(target, text + "\n" if text else "")
    return {"path": rel, "caption": text, "caption_file": target.relative_to(folder).as_posix()}


def _join(first: str, second: str, joiner: str = ", ") -> str:
    if not first or not second:
        return first or second
    if first[-1] in " ,;:" or second[0] in " ,.;:":
        return first + second
    return first + joiner + second


def _prefix(caption: str, text: str) -> str:
    return caption if caption.startswith(text.strip()) and text.strip() else _join(text, caption)


def _suffix(caption: str, text: str) -> str:
    return caption if caption.endswith(text.strip()) and text.strip() else _join(caption, text)


# Bulk caption edits: op → (what it needs, the edit). Prefix and suffix are not added twice.
BULK_EDITS = {
    "prefix": (("text",), lambda caption, args: _prefix(caption, args["text"])),
    "suffix": (("text",), lambda caption, args: _suffix(caption, args["text"])),
    "replace": (("find", "replace"), lambda caption, args: caption.replace(args["find"], args["replace"])),
}


def bulk(root: str | Path, name: str, op: str, paths: list[str], **args) -> dict:
    """Apply one of BULK_EDITS to the captions of `paths`; returns the captions that changed."""
    if op not in BULK_EDITS:
        raise EditError(400, f"unknown bulk edit {op!r}; use one of {', '.join(BULK_EDITS)}")
    needs, edit = BULK_EDITS[op]
    args = {key: args.get(key) for key in needs}
    if (
        any(not isinstance(value, str) for value in args.values())
        or not args[needs[0]].strip(" ")
        or (op == "replace" and not args["find"])
    ):
        raise EditError(400, f"bulk {op} needs {' and '.join(needs)} as text ({needs[0]} not empty)")
    if not isinstance(paths, list) or not paths:
        raise EditError(400, "select the images to edit (paths: a non-empty list)")
    folder = dataset_folder(root, name)
    targets = [(rel, caption_path(_image(folder, rel))) for rel in paths]  # every path checked first
    changed = {}
    for rel, target in targets:
        old = read_caption(target, rel)[0] or "" if target.is_file() else ""
        new = _check_text(edit(old, args), rel)
        if new != old:
            set_caption(root, name, rel, new)
            changed[rel] = new
    return {"op": op, "changed": changed, "unchanged": len(paths) - len(changed)}


def free_name(path: Path) -> Path:
    """path, or 'name (2).ext', 'name (3).ext', ... when it is taken."""
    candidate, number = path, 2
    while candidate.exists() or candidate.is_symlink():
        candidate, number = path.with_name(f"{path.stem} ({number}){path.suffix}"), number + 1
    return candidate


def trash(root: str | Path, name: str, paths: list[str]) -> dict:
    """Move images (and their captions) to <dataset>/.trash/, keeping their sub-folders; nothing is deleted.
    The scan skips hidden folders, so trashed images no longer train; move them back to restore them."""
    if not isinstance(paths, list) or not paths:
        raise EditError(400, "select the images to remove (paths: a non-empty list)")
    folder = dataset_folder(root, name)
    images = [(rel, _image(folder, rel)) for rel in paths]
    moved = []
    for rel, image in images:
        for source in (image, caption_path(image)):
            if not source.is_file():
                continue
            target = free_name(folder / TRASH / source.relative_to(folder))
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, target)  # a rename on one disk: never half-moved
            fsync_dir(target.parent)
            fsync_dir(source.parent)
            moved.append(target.relative_to(folder).as_posix())
    return {"trashed": [rel for rel, _ in images], "moved_to": moved}


def verdicts(root: str | Path, name: str) -> dict:
    """The quality verdict of each usable image (check-dataset's per-image line), with the bucket at each of
    dataset.json's resolutions (512 when it names none); the measures come from the folder's quality cache."""
    from .quality import verdict_line
    from .review import review

    found = review(dataset_folder(root, name), default_resolutions=(512,))
    return {
        "name": name,
        "verdicts": [
            {**verdict, "line": verdict_line(verdict), "ok": not verdict["problems"]}
            for verdict in found.verdicts or []
        ],
    }
