"""Multi-resolution aspect buckets: one bucket per image and resolution, batches from one bucket.

For each resolution R an image of w×h gets the bucket that keeps its aspect
ratio, has an area of at most R², is never larger than the image (no upscaling)
and has sides that are multiples of the family's divisor (16 for Flux2 and
Z-Image). The image is resized to cover the bucket and cropped to it, at the
centre or at a seeded random offset fixed per image (a fixed offset keeps the
latent cache valid; a new crop every epoch would need a new VAE pass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

CROPS = ("center", "random")


@dataclass(frozen=True)
class Entry:
    """One (image, resolution) the model trains on: resize to `resized`, crop `bucket` at `offset`."""

    item: int  # index into ScanReport.items
    resolution: int
    bucket: tuple[int, int]  # (width, height) in pixels
    resized: tuple[int, int]  # (width, height) the image is resized to before the crop
    offset: tuple[int, int]  # (x, y) of the crop in the resized image
    frames: tuple[int, ...] = ()  # a clip's window: its source frame indices (data/frames.py); () for an image

    @property
    def key(self) -> str:
        """The bucket a batch is drawn from: size, and for a clip its frame count (rows share both)."""
        return f"{self.bucket[0]}x{self.bucket[1]}" + (f"x{len(self.frames)}f" if self.frames else "")


def bucket_size(width: int, height: int, resolution: int, divisor: int) -> tuple[int, int]:
    """Aspect kept, area ≤ resolution², never upscaled, sides floored to the divisor (at least one divisor)."""
    scale = min(1.0, resolution / math.sqrt(width * height))
    return (
        max(divisor, int(width * scale) // divisor * divisor),
        max(divisor, int(height * scale) // divisor * divisor),
    )


def cover(width: int, height: int, bucket: tuple[int, int]) -> tuple[int, int]:
    """The size the image is resized to so that it covers the bucket with its aspect kept."""
    scale = max(bucket[0] / width, bucket[1] / height)
    return max(bucket[0], round(width * scale)), max(bucket[1], round(height * scale))


def crop_offset(
    resized: tuple[int, int], bucket: tuple[int, int], mode: str, rng: np.random.Generator | None = None
) -> tuple[int, int]:
    spare_x, spare_y = resized[0] - bucket[0], resized[1] - bucket[1]
    if mode == "center":
        return spare_x // 2, spare_y // 2
    if mode == "random":
        if rng is None:
            raise ValueError("random crop needs a generator")
        return int(rng.integers(0, spare_x + 1)), int(rng.integers(0, spare_y + 1))
    raise ValueError(f"crop must be one of {CROPS}, got {mode!r}")


@dataclass
class BucketPlan:
    entries: list[Entry]
    smallest_side: int = 0  # an image below this cannot be bucketed (the divisor)
    crop: str = "center"  # how each entry's offset was chosen (CROPS)

    def buckets(self, repeats: list[int] | None = None) -> dict[str, list[int]]:
        """Bucket key → entry indices, each repeated `repeats[entry.item]` times (the sampler's input)."""
        out: dict[str, list[int]] = {}
        for index, entry in enumerate(self.entries):
            times = repeats[entry.item] if repeats is not None else 1
            out.setdefault(entry.key, []).extend([index] * times)
        return out

    def report(self) -> dict[str, int]:
        """Images per bucket, largest buckets first within each resolution."""
        counts: dict[str, int] = {}
        for entry in sorted(self.entries, key=lambda e: (e.resolution, -e.bucket[0] * e.bucket[1], e.key)):
            counts[entry.key] = counts.get(entry.key, 0) + 1
        return counts

    def by_resolution(self) -> dict[int, dict[str, list[Entry]]]:
        """Resolution (ascending) → bucket key → its entries; the fullest buckets first, then the larger."""
        groups: dict[int, dict[str, list[Entry]]] = {}
        for entry in self.entries:
            groups.setdefault(entry.resolution, {}).setdefault(entry.key, []).append(entry)
        return {
            res: dict(
                sorted(
                    groups[res].items(), key=lambda kv: (-len(kv[1]), -kv[1][0].bucket[0] * kv[1][0].bucket[1], kv[0])
                )
            )
            for res in sorted(groups)
        }

    def format_report(self) -> str:
        lines = [f"{len(self.entries)} training entries in {len(self.report())} buckets"]
        for res, buckets in self.by_resolution().items():
            lines.append(f"  {res}px: " + ", ".join(f"{key}: {len(entries)}" for key, entries in buckets.items()))
        return "\n".join(lines)

    def describe(self, paths: list[str], sizes: list[tuple[int, int]], resolutions: list[int]) -> list[dict]:
        """Per resolution, each bucket with its images and the resize and crop each gets (JSON-ready).

        paths and sizes are per item (the plan's `Entry.item` indexes them); an item with no entry
        at a resolution has the same bucket at a smaller one (never upscaled) and is listed as `smaller`.
        """
        groups, out = self.by_resolution(), []
        for res in sorted(resolutions):
            buckets = groups.get(res, {})
            placed = {entry.item for entries in buckets.values() for entry in entries}
            out.append(
                {
                    "resolution": res,
                    "divisor": self.smallest_side,
                    "crop": self.crop,
                    "images": len(placed),
                    "buckets": [
                        {
                            "bucket": key,
                            "size": list(entries[0].bucket),
                            "images": [_placement(entry, paths, sizes) for entry in entries],
                        }
                        for key, entries in buckets.items()
                    ],
                    "smaller": [paths[item] for item in range(len(paths)) if item not in placed],
                }
            )
        return out


def _placement(entry: Entry, paths: list[str], sizes: list[tuple[int, int]]) -> dict:
    """One image in its bucket: original size, resized size, crop offset and the pixels cropped off (x, y)."""
    return {
        "path": paths[entry.item],
        "size": list(sizes[entry.item]),
        "resized": list(entry.resized),
        "offset": list(entry.offset),
        "cropped": [entry.resized[0] - entry.bucket[0], entry.resized[1] - entry.bucket[1]],
    }


def plan_buckets(
    sizes: list[tuple[int, int]],
    resolutions: list[int],
    divisor: int,
    *,
    crop: str = "center",
    seed: int = 0,
    hashes: list[str] | None = None,
    windows: list[list[tuple[int, ...]]] | None = None,
) -> BucketPlan:
    """One entry per image and resolution; a resolution that gives an image the same bucket as a
    smaller one (a small image is never upscaled) adds no second entry. windows: per item, a clip's frame
    windows (data/frames.py; empty for an image): a clip has an entry per window and resolution."""
    if crop not in CROPS:
        raise ValueError(f"crop must be one of {CROPS}, got {crop!r}")
    entries = []
    for item, (width, height) in enumerate(sizes):
        seen = set()
        for resolution in sorted(resolutions):
            bucket = bucket_size(width, height, resolution, divisor)
            if bucket in seen:
                continue
            seen.add(bucket)
            resized = cover(width, height, bucket)
            # Random crops are seeded by the image's content, so the same image crops the same
            # way in every run with this seed, whatever its position in the folder.
            token = int((hashes[item] if hashes else f"{item:x}")[:15], 16)
            rng = np.random.default_rng([seed, token, resolution]) if crop == "random" else None
            offset = crop_offset(resized, bucket, crop, rng)
            for frames in windows[item] if windows and windows[item] else [()]:  # a clip's windows share a crop
                entries.append(Entry(item, resolution, bucket, resized, offset, tuple(frames)))
    return BucketPlan(entries, smallest_side=divisor, crop=crop)
