"""What the photos are worth: near-duplicates, blur and over-long captions, and one verdict line per image.

A pass after the scan (scan.py), on its usable items; its findings are warnings
in the same ScanReport, so check-dataset, Load Dataset and the editor show
them as they show the scan's. Each image is decoded once, as grey, at most
SHARPNESS_SIDE px a side (a JPEG at a reduced scale), for two measures:

- dHash (the difference hash): the grey image shrunk to 9×8, one bit per
  horizontal neighbour pair (right brighter than left), 64 bits. A resized,
  re-encoded or lightly edited copy stays within a few bits; unrelated photos
  differ in about half of them. Two images at most NEAR_DUPLICATE_BITS apart are
  near-duplicates (byte-identical copies are the scan's `duplicate`).
- Sharpness: the variance of the 4-neighbour Laplacian of the grey image at
  SHARPNESS_SIDE px. An image is blurry under BLURRY_ABSOLUTE, or, in a
  dataset of at least RELATIVE_MIN_IMAGES, under BLURRY_RELATIVE × the
  dataset's median (soft among sharp ones). A flat image (a plain backdrop,
  a logo) also measures low: the warning says "or flat".

Caption length is an estimate without the tokenizer: about 1.15 tokens per
word or punctuation mark, one per CJK character (Qwen's tokenizer on English
captions: 1.0-1.3 per such piece), checked against each family's
`Arch.caption_token_limit`. Images below the smallest resolution are the
scan's `below_resolution`; their buckets show in the verdict line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .images import ImageProblem, load_grey
from .report import Problem, ScanReport

HASH_SIDE = 8  # dHash of 8 rows × 8 neighbour pairs: 64 bits
# Calibrated on real photos (scikit-image's chelsea, coffee, astronaut, rocket, camera and motorcycle, at
# their 300-740 px and scaled to 256 px; tests/trainer/data/folder/test_quality_photos.py keeps four): a
# resized (3/4) and re-encoded (JPEG 70) copy hashes 0-1 bits from its original, two different photos 21-40 bits apart.
# Sharp photos measure 400-3,000; a Gaussian blur of radius 2 px 4-44, of radius 1 px 22-290.
NEAR_DUPLICATE_BITS = 6  # Hamming distance up to which two images are near-duplicates
SHARPNESS_SIDE = 512  # grey image size the Laplacian is measured at
BLURRY_ABSOLUTE = 50.0  # Laplacian variance under this: blurry whatever the rest of the dataset (8× under
# the softest sharp photo; was 20, which a radius-2 blur of a busy photo passed)
BLURRY_RELATIVE = 0.2  # ...or under this share of the dataset's median
RELATIVE_MIN_IMAGES = 5  # the median means something from this many images on
TOKENS_PER_PIECE = 1.15
QUALITY_CODES = ("near_duplicate", "blurry", "caption_long")
CACHE_FILE = "quality.json"  # in the dataset's cache folder: measures by image content hash
_PIECES = re.compile(
    r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af\uf900-\ufaff]|"
    r"[^\W\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af\uf900-\ufaff]+|[^\w\s]"
)


@dataclass(frozen=True)
class Measure:
    dhash: int  # 64-bit difference hash
    sharpness: float  # variance of the Laplacian at SHARPNESS_SIDE px


def dhash(grey: np.ndarray) -> int:
    """Difference hash of a grey image [H,W]: shrink to (HASH_SIDE+1)×HASH_SIDE, compare neighbours."""
    from PIL import Image

    small = Image.fromarray(np.asarray(grey, dtype=np.float32), mode="F").resize(
        (HASH_SIDE + 1, HASH_SIDE), Image.Resampling.BOX
    )
    pixels = np.asarray(small)
    bits = (pixels[:, 1:] > pixels[:, :-1]).ravel()  # right brighter than left: 1 (imagehash's order)
    return int.from_bytes(np.packbits(bits).tobytes(), "big")


def sharpness(grey: np.ndarray) -> float:
    """Variance of the 4-neighbour Laplacian (0..255 grey): high for crisp edges, low for blur."""
    g = np.asarray(grey, dtype=np.float32)
    if min(g.shape) < 3:
        return 0.0
    laplacian = g[1:-1, :-2] + g[1:-1, 2:] + g[:-2, 1:-1] + g[2:, 1:-1] - 4 * g[1:-1, 1:-1]
    return float(laplacian.var())


def measure(path: str | Path) -> Measure:
    grey = load_grey(path, SHARPNESS_SIDE)
    return Measure(dhash(grey), sharpness(grey))


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bits that differ between uint64 hashes a [N] and b [M] → [N,M]."""
    diff = (a[:, None] ^ b[None, :]).view(np.uint8).reshape(len(a), len(b), 8)
    return np.unpackbits(diff, axis=-1).sum(axis=-1, dtype=np.int64)


def near_duplicate_groups(hashes: Sequence[int], bits: int = NEAR_DUPLICATE_BITS) -> list[list[int]]:
    """Indices of images within `bits` of another (linked transitively), each group in index order."""
    values = np.asarray(hashes, dtype=np.uint64)
    parent = list(range(len(values)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for start in range(0, len(values), 256):  # rows in chunks: [256, N] at a time
        near = np.argwhere(hamming(values[start : start + 256], values) <= bits)
        for i, j in near:
            if start + i < j:
                parent[root(int(j))] = root(start + int(i))
    groups: dict[int, list[int]] = {}
    for i in range(len(values)):
        groups.setdefault(root(i), []).append(i)
    return [group for group in groups.values() if len(group) > 1]


def estimate_tokens(text: str) -> int:
    """About how many tokens a text encoder's tokenizer makes of `text` (see the module docstring)."""
    return math.ceil(len(_PIECES.findall(text or "")) * TOKENS_PER_PIECE)


def token_limits(archs) -> dict[str, int]:
    """arch name → caption token limit, for the archs that have one."""
    return {arch.name: arch.caption_token_limit for arch in archs if arch.caption_token_limit}


def assess(
    report: ScanReport,
    captions: Sequence[str] | None = None,
    limits: dict[str, int] | None = None,
    *,
    cache_file: str | Path | None = None,
    workers: int | None = None,
) -> list[Problem]:
    """The quality warnings of a scan's usable items, added to report.problems and returned.

    captions: per item, the text it trains with (default: its caption file's); limits: arch → caption
    token limit (token_limits); cache_file: a JSON file of the measures by image content hash, so an
    unchanged image is not decoded again (a re-run over 1000 images takes well under a second)."""
    import os

    items, root = report.items, Path(report.root)
    cached = _read_cache(cache_file)

    def one(item) -> Measure | ImageProblem:
        if item.sha256 in cached:
            return cached[item.sha256]
        try:
            return measure(root / item.path)
        except ImageProblem as problem:  # the encoders name it again when they decode it
            return problem

    with ThreadPoolExecutor(max(1, workers or os.cpu_count() or 1)) as pool:
        measures = list(pool.map(one, items))
    problems = _duplicates(report, measures) + _blurry(report, measures)
    texts = captions if captions is not None else [item.caption or "" for item in items]
    problems += _long_captions(report, texts, limits or {})
    fresh = {item.sha256: m for item, m in zip(items, measures) if isinstance(m, Measure)}
    if cache_file is not None and fresh != cached:
        problems += _write_cache(Path(cache_file), fresh)
    report.problems = sorted(report.problems + problems, key=lambda p: (p.file != "", p.file.split("/")))
    return problems


_CACHE_VERSION = f"dhash{HASH_SIDE}-laplacian{SHARPNESS_SIDE}"


def _read_cache(path: str | Path | None) -> dict[str, Measure]:
    """sha256 → Measure from an earlier pass; empty when absent, unreadable or made by other settings."""
    import json

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8")) if path else {}
        if data.get("version") != _CACHE_VERSION:
            return {}
        return {sha: Measure(int(h, 16), float(v)) for sha, (h, v) in data["measures"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # a missing or damaged cache only costs the decode it would have saved


def _write_cache(path: Path, measures: dict[str, Measure]) -> list[Problem]:
    """The measures of the images now in the folder (others dropped), written atomically."""
    import json

    from ...atomic import atomic_write_text

    blob = {
        "version": _CACHE_VERSION,
        "measures": {sha: [f"{m.dhash:016x}", round(m.sharpness, 3)] for sha, m in sorted(measures.items())},
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(blob))
    except OSError as err:
        return [
            Problem(
                "quality_cache",
                "",
                f"cannot write {path}: {err.strerror or err}; every image is decoded again next time",
                "make the dataset folder writable (or ignore this)",
                "note",
            )
        ]
    return []


def _duplicates(report: ScanReport, measures: list) -> list[Problem]:
    ok = [n for n, m in enumerate(measures) if isinstance(m, Measure)]
    out = []
    for group in near_duplicate_groups([measures[n].dhash for n in ok]):
        # The sharpest of a group is the one to keep; the others carry the warning.
        first, *rest = sorted((ok[n] for n in group), key=lambda k: -measures[k].sharpness)
        for n in rest:
            bits = int(
                hamming(np.asarray([measures[first].dhash], np.uint64), np.asarray([measures[n].dhash], np.uint64))[
                    0, 0
                ]
            )
            others = [report.items[k].path for k in [first, *rest] if k not in (first, n)]
            also = f" (and of {', '.join(others)})" if others else ""
            out.append(
                Problem(
                    "near_duplicate",
                    report.items[n].path,
                    f"looks like a resized or re-encoded copy of {report.items[first].path}{also}: "
                    f"perceptual hashes {bits}/64 bits apart",
                    f"delete it (the sharper {report.items[first].path} stays), or keep both if they "
                    "differ in a way you want learnt: as a pair they weigh double",
                    "warning",
                )
            )
        # ...and the one to keep names its copies, so a pair names each other wherever it is shown.
        copies = ", ".join(report.items[n].path for n in rest)
        out.append(
            Problem(
                "near_duplicate_kept",
                report.items[first].path,
                f"near-duplicate of {copies}; this one is the sharpest, the one to keep",
                f"delete {copies}, or keep both if they differ in a way you want learnt",
                "note",
            )
        )
    return out


def _blurry(report: ScanReport, measures: list) -> list[Problem]:
    values = [m.sharpness for m in measures if isinstance(m, Measure)]
    median = float(np.median(values)) if len(values) >= RELATIVE_MIN_IMAGES else 0.0
    out = []
    for item, m in zip(report.items, measures):
        if not isinstance(m, Measure):
            continue
        if m.sharpness < BLURRY_ABSOLUTE:
            why = f"under {BLURRY_ABSOLUTE:g}"
        elif m.sharpness < BLURRY_RELATIVE * median:
            why = f"under {BLURRY_RELATIVE:g} × this dataset's median {median:.0f}"
        else:
            continue
        out.append(
            Problem(
                "blurry",
                item.path,
                f"blurry or flat: sharpness {m.sharpness:.1f} (variance of the "
                f"Laplacian at {SHARPNESS_SIDE} px), {why}",
                "replace it with a sharper version, or delete it: the LoRA learns the blur too",
                "warning",
            )
        )
    return out


def _long_captions(report: ScanReport, texts: Sequence[str], limits: dict[str, int]) -> list[Problem]:
    if not limits:
        return []
    out = []
    for item, text in zip(report.items, texts):
        tokens = estimate_tokens(text)
        over = {name: limit for name, limit in limits.items() if tokens > limit}
        if over:
            names = ", ".join(f"{name}'s {limit}" for name, limit in over.items())
            out.append(
                Problem(
                    "caption_long",
                    item.caption_file or item.path,
                    f"about {tokens} tokens, over {names} (the text encoder's length in the "
                    "family's reference pipeline: the model never saw longer prompts, and diffusers "
                    "cuts the rest)",
                    f"shorten it to under {min(over.values())} tokens "
                    f"(about {int(min(over.values()) / TOKENS_PER_PIECE)} words)",
                    "warning",
                )
            )
    return out


def verdicts(report: ScanReport, buckets: list[dict] | None = None) -> list[dict]:
    """Per usable item: its path, its bucket at each resolution with the crop (from describe_plan's list),
    and its problems (the scan's and the quality pass's warnings; notes need nothing done)."""
    by_file: dict[str, list[Problem]] = {}
    for problem in report.warnings:
        by_file.setdefault(problem.file, []).append(problem)
    kept = {p.file: p.message for p in report.of("note") if p.code == "near_duplicate_kept"}
    placed: dict[str, list[str]] = {}
    for resolution in buckets or []:
        for bucket in resolution["buckets"]:
            for image in bucket["images"]:
                crop = " crop {}x{}".format(*image["cropped"]) if any(image["cropped"]) else ""
                placed.setdefault(image["path"], []).append(f"{resolution['resolution']}: {bucket['bucket']}{crop}")
        for path in resolution["smaller"]:  # never upscaled: it trains at a lower resolution only
            placed.setdefault(path, []).append(f"{resolution['resolution']}: none, too small")
    out = []
    for item in report.items:
        problems = by_file.get(item.path, []) + (by_file.get(item.caption_file, []) if item.caption_file else [])
        out.append(
            {
                "path": item.path,
                "size": [item.width, item.height],
                "buckets": placed.get(item.path, []),
                "problems": [p.code for p in problems],
                "fixes": [p.fix for p in problems],
                "messages": [p.message for p in problems],
                "note": kept.get(item.path, ""),
            }
        )
    return out


def verdict_line(verdict: dict) -> str:
    """`photo.jpg 1200x800 [512: 624x416, 768: 944x624 crop 0x4] ok` (then ` — near-duplicate of ...` for the one
    of a near-duplicate group to keep), or the problems with their fixes."""
    where = f" [{', '.join(verdict['buckets'])}]" if verdict["buckets"] else ""
    head = f"{verdict['path']} {verdict['size'][0]}x{verdict['size'][1]}{where}"
    note = f" — {verdict['note']}" if verdict.get("note") else ""
    if not verdict["problems"]:
        return f"{head} ok{note}"
    return f"{head} {', '.join(verdict['problems'])} — fix: {'; '.join(dict.fromkeys(verdict['fixes']))}{note}"
