"""Checking one image file: read once, hashed, its header parsed (or every pixel decoded, deep), and the
notes a usable image still earns (low resolution, mislabelled, converted, EXIF-rotated)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from .images import EXTENSION_FORMATS, ImageInfo, ImageProblem, probe, sniff, verify
from .report import Problem
from .walk import FolderFile

NOTE_FIX = "none needed"
EXTENSION_OF = {"PNG": "png", "WEBP": "webp", "BMP": "bmp", "TIFF": "tif"}  # JPEG and MPO: jpg


def check_image(
    file: FolderFile, deep: bool, min_side: int, min_area: int
) -> tuple[ImageInfo | None, str, list[Problem]]:
    """One image: (info or None when skipped, sha256 of the bytes, problems). Runs in a worker thread."""

    def skipped(code: str, message: str, fix: str) -> tuple[None, str, list[Problem]]:
        return None, sha256, [Problem(code, file.rel, message, fix, "skipped")]

    try:
        data = file.path.read_bytes()
    except OSError:
        data = None  # probe reads it again and names the error
    sha256 = hashlib.sha256(data or b"").hexdigest()
    try:
        complete = data is not None and _ends_complete(data)
        info = verify(file.path, data) if deep or not complete else probe(file.path, data)
    except ImageProblem as problem:
        return skipped(problem.code, problem.message, problem.fix)
    if min(info.width, info.height) < min_side:
        return skipped(
            "too_small",
            f"{info.width}×{info.height} px: a side is under {min_side} px",
            "use a larger version of the image, or delete it",
        )
    return info, sha256, _notes(file.rel, info, min_area)


def _notes(rel: str, info: ImageInfo, min_area: int) -> list[Problem]:
    """What a usable image is told: it trains smaller, its name lies about its format, or it was converted."""
    problems = []
    if info.width * info.height < min_area:
        side = int(min_area**0.5)
        problems.append(
            Problem(
                "below_resolution",
                rel,
                f"{info.width}×{info.height} px is under {side}×{side}: it trains at a lower "
                "resolution (images are never upscaled)",
                "use a larger version, or accept it as a low-resolution sample",
                "warning",
            )
        )
    suffix = Path(rel).suffix.lower()
    if info.format not in EXTENSION_FORMATS[suffix]:
        problems.append(
            Problem(
                "mislabelled",
                rel,
                f"a {info.format} file named {suffix}; read as {info.format}",
                f"optional: rename it to .{EXTENSION_OF.get(info.format, 'jpg')}",
                "note",
            )
        )
    if info.conversions:
        problems.append(
            Problem("converted", rel, "; ".join(info.conversions), f"{NOTE_FIX}: converted when loaded", "note")
        )
    if info.rotation:
        problems.append(
            Problem(
                "exif_rotated",
                rel,
                f"{info.rotation}: used as {info.width}×{info.height}",
                f"{NOTE_FIX}: turned upright when loaded",
                "note",
            )
        )
    return problems


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
