"""What a dataset scan finds: usable items, skipped files, warnings, each named with a fix.

Shared by the scanner (scan.py), the encoders (dataset.py), the CLI
(`check-dataset`) and the Load Dataset node, so a problem reads the same
everywhere it is shown. format_report is how a person reads it, with the bucket
plan (BucketPlan.describe) when there is one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SEVERITIES = ("fatal", "skipped", "warning", "note")
META_FILE = "dataset.json"


@dataclass(frozen=True)
class Problem:
    code: str  # stable id, e.g. "zero_byte", "truncated", "caption_not_utf8"
    file: str  # path relative to the dataset root ("" for the dataset as a whole)
    message: str  # what is wrong, in a user's words
    fix: str  # what to do about it
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

    path: str  # relative to the dataset root, '/'-separated
    width: int
    height: int
    sha256: str  # content hash of the image file's bytes
    caption: str | None  # the .txt text as read (stripped); None when there is no caption file
    caption_file: str | None  # relative path of the caption file, if any
    repeats: int = 1  # from a kohya-style "N_name/" folder (the dataset multiplies in its own repeats)
    image_format: str = ""  # PIL format name, e.g. "JPEG"
    mode: str = ""  # PIL mode before conversion, e.g. "CMYK"
    notes: list[str] = field(default_factory=list)  # conversions that will be applied ("CMYK → RGB", ...)
    # Companion files that follow the image through crop, bucket and cache (companions.py).
    mask_file: str | None = None  # "<stem>.mask.png" beside it; None: the alpha channel, if any, is the mask
    controls: tuple[str, ...] = ()  # edit datasets: control/<same path>, control_2/<same path>, ...
    companions_sha256: str = ""  # hash of the companion files' hashes ("" without any): part of the latent key
    frames: int = 0  # a clip's frame count (0: an image); clips.py
    fps: float = 0.0  # a clip's frame rate

    @property
    def is_clip(self) -> bool:
        return self.frames > 0


@dataclass
class DatasetMeta:
    """dataset.json, all optional. Node and config values override these."""

    name: str = ""
    type: str = ""  # "character" | "style" | "concept" | ""
    trigger_word: str = ""
    caption_prefix: str = ""
    caption_suffix: str = ""
    default_caption: str = ""
    resolutions: list[int] | None = None
    repeats: int | None = None
    description: str = ""
    created: str = ""
    frames: int | None = None  # clips (data/frames.py): target frame count, fps, how frames are taken
    fps: float | None = None
    frame_extraction: str | None = None
    frame_windows: int | None = None


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
        return {
            "root": self.root,
            "ok": self.ok,
            "deep": self.deep,
            "meta": asdict(self.meta),
            "usable": len(self.items),
            "items": [asdict(i) for i in self.items],
            "skipped": [asdict(p) for p in self.skipped],
            "warnings": [asdict(p) for p in self.warnings],
            "notes": [asdict(p) for p in self.of("note")],
            "fatal": [asdict(p) for p in self.fatal],
        }


def format_report(
    report: ScanReport,
    buckets: list[dict] | None = None,
    *,
    per_code: int = 10,
    per_bucket: int = 8,
    verdicts: list[str] | None = None,
) -> str:
    """The report as a person reads it: counts, usable images per folder, the buckets (BucketPlan.describe's
    list, when given), then problems grouped by code, then one verdict line per image (quality.verdict_line's,
    when given)."""
    repeats_total = sum(item.repeats for item in report.items) * (report.meta.repeats or 1)
    lines = [
        f"{'Deep' if report.deep else 'Fast'} scan of {report.root}",
        (
            f"  {_usable(report.items)} ({repeats_total} per epoch with repeats), "
            f"{len(report.skipped)} skipped, {len(report.warnings)} warnings, {len(report.of('note'))} notes"
        ),
    ]
    meta = {k: v for k, v in asdict(report.meta).items() if v not in ("", None)}
    if meta:
        lines.append(f"  {META_FILE}: " + ", ".join(f"{k}={v!r}" for k, v in meta.items()))
    folders: dict[tuple[str, int], int] = {}
    for item in report.items:
        key = (item.path.rpartition("/")[0] or ".", item.repeats)
        folders[key] = folders.get(key, 0) + 1
    if folders:
        lines.append("Usable:")
        lines += [
            f"  {folder}/: {count} image{'s' * (count != 1)} × {repeats} repeat{'s' * (repeats != 1)}"
            for (folder, repeats), count in folders.items()
        ]
    for resolution in buckets or []:
        lines += format_buckets(resolution, per_bucket)
    for title, severity in (("Fatal", "fatal"), ("Skipped", "skipped"), ("Warnings", "warning"), ("Notes", "note")):
        problems = report.of(severity)
        if not problems:
            continue
        lines.append(f"{title} ({len(problems)}):")
        by_code: dict[str, list[Problem]] = {}
        for problem in problems:
            by_code.setdefault(problem.code, []).append(problem)
        for code, group in by_code.items():
            lines += [f"  {problem.line()}" for problem in group[:per_code]]
            if len(group) > per_code:
                lines.append(f"  … and {len(group) - per_code} more [{code}]")
    if verdicts:
        lines.append(
            f"Per image ({sum(line.endswith(' ok') or ' ok — ' in line for line in verdicts)} of {len(verdicts)} ok):"
        )
        lines += [f"  {line}" for line in verdicts]
    lines.append("OK: ready to train" if report.ok else "NOT READY: fix the fatal problems above")
    return "\n".join(lines)


def format_buckets(resolution: dict, per_bucket: int = 8) -> list[str]:
    """One resolution of BucketPlan.describe(): each bucket with its images, and the crop of each that loses pixels."""

    def some(names: list[str]) -> str:
        more = f", … and {len(names) - per_bucket} more" if len(names) > per_bucket else ""
        return ", ".join(names[:per_bucket]) + more

    res, count, buckets = resolution["resolution"], resolution["images"], resolution["buckets"]
    crop = "centre crop" if resolution["crop"] == "center" else f"{resolution['crop']} crop"
    lines = [
        (
            f"Buckets at {res} px ({crop}, sides multiples of {resolution['divisor']}): "
            f"{_count(count, 'image')} in {_count(len(buckets), 'bucket')}"
        )
    ]
    for bucket in buckets:
        images = bucket["images"]
        lines.append(f"  {bucket['bucket']}: {_count(len(images), 'image')}: {some([i['path'] for i in images])}")
        cropped = [i for i in images if any(i["cropped"])]
        lines += [
            f"    {i['path']} {i['size'][0]}x{i['size'][1]} → {i['resized'][0]}x{i['resized'][1]}, "
            f"crop {i['cropped'][0]} px x {i['cropped'][1]} px at ({i['offset'][0]}, {i['offset'][1]})"
            for i in cropped[:per_bucket]
        ]
        if len(cropped) > per_bucket:
            lines.append(f"    … and {len(cropped) - per_bucket} more cropped")
    if resolution["smaller"]:
        lines.append(
            f"  no {res} px bucket (smaller than {res}x{res}; it trains at a smaller resolution only): "
            f"{some(resolution['smaller'])}"
        )
    return lines


def _usable(items: list[Item]) -> str:
    """'12 usable images', or with clips '3 usable images and 4 clips (5.5 s)': an image-only set reads as before."""
    clips = [item for item in items if item.is_clip]
    if not clips:
        return f"{len(items)} usable images"
    seconds = sum(item.frames / item.fps for item in clips if item.fps)
    return f"{len(items) - len(clips)} usable images and {_count(len(clips), 'clip')} ({seconds:.1f} s)"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"
