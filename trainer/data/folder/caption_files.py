"""Caption files: reading one `.txt` whatever its encoding, and finding an image's caption by name."""

from __future__ import annotations

import codecs
from pathlib import Path

from .report import Problem
from .walk import FolderFile, stem


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
        return None, [
            problem(
                "caption_unreadable", f"cannot read the caption: {err.strerror or err}", "check the file's permissions"
            )
        ]
    problems = []
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):  # Notepad's "Unicode"
        text = raw.decode("utf-16", errors="replace")
    else:
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as err:
            text = raw.decode("cp1252", errors="replace")
            problems.append(
                problem(
                    "caption_not_utf8",
                    f"not UTF-8 (byte 0x{raw[err.start]:02X} at offset "
                    f"{err.start}); read as Windows-1252: {text.strip()[:60]!r}",
                    "if that reads wrong, re-save the file as UTF-8 (most editors: Save As → Encoding: UTF-8)",
                )
            )
    if any(ord(ch) < 32 and ch not in "\t\n\r" or 0x7F <= ord(ch) < 0xA0 for ch in text):
        return None, [
            problem(
                "caption_not_text",
                "contains control bytes: not a text file; caption not used",
                "write the caption as plain UTF-8 text",
            )
        ]
    text = text.strip()
    if not text:
        problems.append(
            problem(
                "caption_empty",
                "the caption file is empty: the image trains with dataset.json's default_caption or the trigger word",
                "write a caption in it",
            )
        )
    return text, problems


def caption_matcher(captions: dict[str, FolderFile], images: list[FolderFile]):
    """stem → its .txt; failing that, the one .txt that differs only in case (Windows and macOS match so)."""
    folded: dict[str, list[str]] = {}
    for caption_stem in captions:
        folded.setdefault(caption_stem.lower(), []).append(caption_stem)
    image_stems = {stem(image.rel) for image in images}

    def caption_for(image_stem: str) -> FolderFile | None:
        if image_stem in captions:
            return captions[image_stem]
        near = folded.get(image_stem.lower(), [])
        return captions[near[0]] if len(near) == 1 and near[0] not in image_stems else None

    return caption_for
