"""What a dataset scan finds: usable items, skipped files, warnings, each named with a fix.

Shared by the scanner (scan.py), the encoders (dataset.py), the CLI
(`check-dataset`) and the Load Dataset node, so a problem reads the same
everywhere it is shown.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

SEVERITIES = ("fatal", "skipped", "warning", "note")


@dataclass(frozen=True)
class Problem:
    code: str          # stable id, e.g. "zero_byte", "truncated", "caption_not_utf8"
    file: str          # path relative to the dataset root ("" for the dataset as a whole)
    message: str       # what is wrong, in a user's words
    fix: str           # what to do about it
    severity: str = "warning"  # one of SEVERITIES

    def line(self) -> str:
        where = self.file or "dataset"
        return f"[{self.code}] {where}: {self.message} — fix: {self.fix}"


def fatal(code: str, file: str, message: str, fix: str) -> Problem:
    """A problem that stops the dataset from training until fixed."""
    return Problem(code, file, message, fix, "fatal")


@dataclass
class Item:
    """One usable image. Sizes are after EXIF orientation."""

    path: str                      # relative to the dataset root, '/'-separated
    width: int
    height: int
    sha256: str                    # content hash of the image file's bytes
    caption: str | None            # the .txt text as read (stripped); None when there is no caption file
    caption_file: str | None       # relative path of the caption file, if any
    repeats: int = 1               # from a kohya-style "N_name/" folder (the dataset multiplies in its own repeats)
    image_format: str = ""         # PIL format name, e.g. "JPEG"
    mode: str = ""                 # PIL mode before conversion, e.g. "CMYK"
    notes: list[str] = field(default_factory=list)  # conversions that will be applied ("CMYK → RGB", ...)


@dataclass
class DatasetMeta:
    """dataset.json, all optional. Node and config values override these."""

    name: str = ""
    type: str = ""                 # "character" | "style" | "concept" | ""
    trigger_word: str = ""
    caption_prefix: str = ""
    caption_suffix: str = ""
    default_caption: str = ""
    resolutions: list[int] | None = None
    repeats: int | None = None
    description: str = ""
    created: str = ""


@dataclass
class ScanReport:
    root: str
    meta: DatasetMeta
    items: list[Item] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    deep: bool = False

    def of(self, severity: str) -> list[Problem]:
        return [p for p in self.problems if p.severity == severity]

    @property
    def skipped(self) -> list[Problem]:
        return self.of("skipped")

    @property
    def warnings(self) -> list[Problem]:
        return self.of("warning")

    @property
    def fatal(self) -> list[Problem]:
        return self.of("fatal")

    @property
    def ok(self) -> bool:
        """At least one usable item and nothing fatal: `check-dataset` exits 0."""
        return bool(self.items) and not self.fatal

    def to_dict(self) -> dict:
        return {"root": self.root, "ok": self.ok, "deep": self.deep, "meta": asdict(self.meta),
                "usable": len(self.items), "items": [asdict(i) for i in self.items],
                "skipped": [asdict(p) for p in self.skipped], "warnings": [asdict(p) for p in self.warnings],
                "notes": [asdict(p) for p in self.of("note")], "fatal": [asdict(p) for p in self.fatal]}
