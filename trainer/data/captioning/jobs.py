"""Caption a dataset folder: a `.txt` beside each image that has none (or every image, with overwrite).

The engine is a plain function `caption(image, prompt) -> str`: a PIL RGB image (EXIF turned upright,
any mode converted, as training reads it) and the prompt in, the model's text out. Engines: ComfyUI's
own vision-language text encoders (nodes/comfy/captioning.py) and transformers captioners
(trainer/data/captioning/models.py).

Files. Images are taken from the same scan as check-dataset, so what it rejects (corrupt, unsupported,
too small, duplicates) is skipped and reported, never captioned. Every caption is written atomically
(temp file, fsync, rename): a crash or a stop leaves each caption whole or absent. An existing caption
that is overwritten is kept first as `<name>.txt.bak` (then `<name>.txt.2.bak`, ...; never replaced).

`only` restricts a run to some images (the dataset editor's selection); a name that is not in the folder
is an error, not skipped silently.

Resume. Without overwrite a re-run skips the images that have a caption, so it continues where it
stopped. With overwrite, `.kiln_captioning.json` in the folder lists the images done with these
settings; a re-run with the same settings continues, and a finished run removes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...atomic import atomic_write_bytes, atomic_write_text
from ..captions import CaptionSettings, finish
from ..folder.images import IMAGE_EXTENSIONS, ImageProblem, load_rgb
from ..folder.report import Item, Problem
from ..folder.scan import scan

Captioner = Callable[..., str]  # caption(image: PIL.Image.Image, prompt: str) -> str
JOURNAL = ".kiln_captioning.json"


def _sentences(text: str) -> str:
    """One paragraph: whitespace and line breaks collapsed, wrapping quotes and a 'Caption:' label dropped."""
    text = re.sub(r"\s+", " ", text).strip()
    text = re.sub(r"^(caption|description)\s*:\s*", "", text, flags=re.IGNORECASE)
    return text.strip("\"'` ")


def _tags(text: str) -> str:
    """Comma-separated tags: split on commas, semicolons and lines, bullets and numbering dropped, repeats
    dropped (case-insensitively, first kept)."""
    tags, seen = [], set()
    for part in re.split(r"[,;\n]", text):
        tag = re.sub(r"^\s*(?:[-*•]+|\d+[.)])\s*", "", part).strip(" \t\"'`.")
        tag = re.sub(r"\s+", " ", tag)
        if tag and tag.lower() not in seen:
            seen.add(tag.lower())
            tags.append(tag)
    return ", ".join(tags)


@dataclass(frozen=True)
class Style:
    prompt: str  # the default prompt (the user's own prompt replaces it)
    clean: Callable[[str], str]  # the model's text → the caption as written
    description: str


STYLES = {
    "short": Style(
        "Write a one-sentence caption for this image, as a prompt for a text-to-image model: the "
        "main subject, what it is doing, the setting and the medium (photo, painting, 3D render...). "
        "Write only the caption.",
        _sentences,
        "one sentence",
    ),
    "detailed": Style(
        "Describe this image in detail, as a prompt for a text-to-image model: the subject and "
        "its appearance, clothing or materials, pose or action, the background and setting, the "
        "lighting, colours, composition and the medium or art style. Write one paragraph of plain "
        "sentences, without a preamble.",
        _sentences,
        "one paragraph",
    ),
    "tags": Style(
        "List tags for this image, as a caption for a text-to-image model: subject, features, "
        "clothing, action, setting, lighting, colours and style. Write only the tags, separated by "
        "commas.",
        _tags,
        "comma-separated tags",
    ),
}


@dataclass(frozen=True)
class CaptionJob:
    style: str = "short"  # one of STYLES
    prompt: str = ""  # empty: the style's default prompt
    trigger_word: str = ""  # put in front of each caption unless the caption already has it
    overwrite: bool = False  # caption every image (old captions kept as .bak), not only those without
    deep: bool = False  # decode every image fully when scanning (catches corrupt data)
    engine: str = ""  # what captions (engine and model): part of the resume key with overwrite
    only: tuple[str, ...] = ()  # these images (paths relative to the folder) and no others; empty: all

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"caption style {self.style!r} is not one of {list(STYLES)}")

    @property
    def text_prompt(self) -> str:
        return self.prompt.strip() or STYLES[self.style].prompt

    def key(self) -> str:
        facts = (self.style, self.text_prompt, self.trigger_word.strip(), self.engine) + (
            (sorted(self.only),) if self.only else ()
        )
        return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]


@dataclass
class CaptionReport:
    root: str
    written: list[str] = field(default_factory=list)  # captions written this run (relative .txt paths)
    backups: list[str] = field(default_factory=list)  # old captions kept (relative .bak paths)
    kept: list[str] = field(default_factory=list)  # images left alone: they have a caption
    resumed: list[str] = field(default_factory=list)  # images done by an earlier run of this overwrite
    problems: list[Problem] = field(default_factory=list)  # images skipped (by the scan, or while captioning)
    samples: list[str] = field(default_factory=list)  # the first few captions, to show

    def text(self) -> str:
        lines = [
            f"{self.root}: {len(self.written)} caption{'s' * (len(self.written) != 1)} written"
            + (f", {len(self.backups)} old caption(s) kept as .bak" if self.backups else "")
            + (f", {len(self.kept)} image(s) already captioned (left alone; overwrite to redo)" if self.kept else "")
            + (f", {len(self.resumed)} done by the earlier run (resumed)" if self.resumed else "")
        ]
        lines += [f"  {sample}" for sample in self.samples]
        if self.problems:
            lines.append(f"{len(self.problems)} file(s) not captioned:")
            lines += [f"  {problem.line()}" for problem in self.problems]
        return "\n".join(lines)


def folder_state(root: str | Path) -> str:
    """Changes when an image is added, removed or edited, or a caption added or removed, but not when a
    caption's text changes (so a node that wrote the captions is not re-run by its own writes)."""
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            suffix, path = os.path.splitext(name)[1].lower(), os.path.join(folder, name)
            if suffix in IMAGE_EXTENSIONS:
                try:
                    stat = os.stat(path)
                except OSError:
                    continue
                digest.update(
                    f"{os.path.relpath(path, root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode(
                        "utf-8", "surrogateescape"
                    )
                )
            elif suffix == ".txt":
                digest.update(f"{os.path.relpath(path, root)}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def plan(root: str | Path, job: CaptionJob) -> tuple[list[Item], CaptionReport]:
    """(images to caption, the report so far): the scan's usable images less those done or kept."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root} is not a folder; give the dataset folder that holds the images")
    scanned = scan(root, deep=job.deep)
    items, skipped = scanned.items, [p for p in scanned.skipped if p.file]
    if job.only:
        items, skipped = _restrict(root, job.only, items, skipped)
    report = CaptionReport(root=str(root), problems=skipped)
    done = _read_journal(root, job) if job.overwrite else set()
    todo = []
    for item in items:
        if not job.overwrite and item.caption:
            report.kept.append(item.path)
        elif item.path in done:
            report.resumed.append(item.path)
        else:
            todo.append(item)
    return todo, report


def _restrict(root: Path, only, items: list[Item], skipped: list[Problem]) -> tuple[list[Item], list[Problem]]:
    """The items and skipped files that `only` names; a ValueError naming any name that is neither."""
    wanted = set(only)
    unknown = wanted - {item.path for item in items} - {problem.file for problem in skipped}
    if unknown:
        raise ValueError(
            f"{root}: no image {', '.join(sorted(unknown))} in this folder (moved or renamed?); "
            "give paths relative to the folder, one a line, or leave `only` empty for every image"
        )
    return [i for i in items if i.path in wanted], [p for p in skipped if p.file in wanted]


def parse_only(text: str) -> tuple[str, ...]:
    """Caption Images' `only`: one path a line (blank lines and surrounding spaces ignored, '\\' read as '/')."""
    return tuple(dict.fromkeys(line.strip().replace("\\", "/") for line in (text or "").splitlines() if line.strip()))


def caption_folder(
    root: str | Path, engine: Captioner, job: CaptionJob, progress: Callable[[int, int], None] | None = None
) -> CaptionReport:
    """Caption what `plan` finds; progress(done, total) runs before each image (raise from it to stop)."""
    root = Path(root)
    todo, report = plan(root, job)
    done = sorted(report.resumed)
    for index, item in enumerate(todo):
        if progress is not None:
            progress(index, len(todo))
        caption = _caption_one(root, item, engine, job, report)
        if caption is None:
            continue
        _write(root, item, caption, report)
        if job.overwrite:
            done.append(item.path)
            atomic_write_text(root / JOURNAL, json.dumps({"key": job.key(), "done": done}))
    if progress is not None:
        progress(len(todo), len(todo))
    if job.overwrite:
        (root / JOURNAL).unlink(missing_ok=True)
    return report


def _caption_one(root: Path, item: Item, engine: Captioner, job: CaptionJob, report: CaptionReport) -> str | None:
    """The finished caption for one image, or None (the problem recorded) when it gives none."""
    from PIL import Image

    try:
        image = Image.fromarray(load_rgb(root / item.path))
    except ImageProblem as problem:  # damage the fast scan could not see
        report.problems.append(Problem(problem.code, item.path, problem.message, problem.fix, "skipped"))
        return None
    try:
        raw = engine(image, job.text_prompt)
    except Exception as err:
        _add_note(
            err,
            f"while captioning {item.path} ({len(report.written)} caption(s) written before it, "
            "all complete): run again to continue from this image",
        )
        raise
    caption = STYLES[job.style].clean(raw if isinstance(raw, str) else "")
    if not caption:
        report.problems.append(
            Problem(
                "caption_not_generated",
                item.path,
                f"the captioner gave no text ({raw!r:.80})",
                "run again, raise max tokens, or edit the prompt",
                "skipped",
            )
        )
        return None
    return finish(caption, None, CaptionSettings(trigger_word=job.trigger_word))


def _write(root: Path, item: Item, caption: str, report: CaptionReport) -> None:
    """The caption beside its image (an existing one kept first as .bak, unless it held nothing)."""
    rel = item.caption_file or f"{item.path.rsplit('.', 1)[0]}.txt"
    path = root / rel
    if path.exists():
        old = path.read_bytes()
        if old.strip():
            backup = _backup_path(path, old)
            if backup is not None:
                atomic_write_bytes(backup, old)
                report.backups.append(backup.relative_to(root).as_posix())
    atomic_write_text(path, caption + "\n")
    report.written.append(rel)
    if len(report.samples) < 5:
        report.samples.append(f"{rel}: {caption[:200]}")


def _backup_path(path: Path, old: bytes) -> Path | None:
    """photo.txt.bak, else photo.txt.2.bak, ...; None when a backup already holds these exact bytes
    (a run stopped between the backup and the caption)."""
    for number in range(1, 10_000):
        backup = path.with_name(f"{path.name}.bak" if number == 1 else f"{path.name}.{number}.bak")
        if not backup.exists():
            return backup
        if backup.read_bytes() == old:
            return None
    raise OSError(f"{path}: 9,999 backups of this caption exist; delete the old {path.name}.*.bak files")


def _read_journal(root: Path, job: CaptionJob) -> set[str]:
    """The images an earlier overwrite run with the same settings finished (none if the settings differ)."""
    try:
        journal = json.loads((root / JOURNAL).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    if not isinstance(journal, dict) or journal.get("key") != job.key():
        return set()
    return {name for name in journal.get("done", []) if isinstance(name, str)}


def _add_note(err: BaseException, note: str) -> None:
    if hasattr(err, "add_note"):  # Python 3.11+
        err.add_note(note)
