"""Dataset scan speed: the fast scan of many small captioned images, and the deep scan of 1-MP JPEGs.

    python bench/scan_bench.py [--small 10000] [--large 200]

Images are generated in a temporary folder first (not timed), so the files are
in the page cache when the scans run: this measures the scanner, not the disk.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.data.folder.scan import scan


def photo_like(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """Gradients, a few blurred blobs and mild noise: compresses like a photo, unlike pure noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    colour = rng.uniform(0, 255, (2, 3))
    ramp = (x / width)[..., None]
    pixels = colour[0] * (1 - ramp) + colour[1] * ramp
    for _ in range(4):
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(0.05, 0.3) * width
        pixels[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    pixels += rng.normal(0, 5, pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).filter(ImageFilter.GaussianBlur(1))


def make_small(folder: Path, count: int, seed: int = 0) -> None:
    """count images of 64–128 px, half PNG and half JPEG, in folders of 500, each with a caption."""
    rng = np.random.default_rng(seed)
    for index in range(count):
        sub = folder / f"{1 + index % 3}_part{index // 500:02d}"
        sub.mkdir(parents=True, exist_ok=True)
        width, height = (int(v) for v in rng.integers(64, 129, 2))
        image = photo_like(rng, width, height)
        suffix = ".png" if index % 2 else ".jpg"
        image.save(sub / f"img_{index:05d}{suffix}", quality=90)
        (sub / f"img_{index:05d}.txt").write_text(f"photo {index}, a test image, soft light\n", encoding="utf-8")


def make_large(folder: Path, count: int, seed: int = 1) -> None:
    """count distinct JPEGs of 1024×1024 (1 MP), quality 90: a few base photos, each copy with its own patch."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    bases = [np.asarray(photo_like(rng, 1024, 1024)) for _ in range(8)]
    for index in range(count):
        pixels = bases[index % len(bases)].copy()
        x, y = (int(v) for v in rng.integers(0, 1024 - 96, 2))
        pixels[y : y + 96, x : x + 96] = rng.uniform(0, 255, 3).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"big_{index:04d}.jpg", quality=90)
        (folder / f"big_{index:04d}.txt").write_text("a large photo", encoding="utf-8")


def timed(label: str, count: int, run, repeat: int = 3) -> float:
    """Best of `repeat` runs, in images per second."""
    best = min(_seconds(run) for _ in range(repeat))
    print(f"{label:<42} {best:7.2f} s  {count / best:9.0f} images/s")
    return count / best


def _seconds(run) -> float:
    started = time.perf_counter()
    report = run()
    elapsed = time.perf_counter() - started
    assert report.ok and not report.skipped, report.problems[:3]
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=10_000, help="small images for the fast scan")
    parser.add_argument("--large", type=int, default=200, help="1-MP JPEGs for the deep scan")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    print(
        f"{platform.processor() or platform.machine()}, {cores} cores, Python {platform.python_version()}, "
        f"Pillow {Image.__version__}"
    )
    with tempfile.TemporaryDirectory() as temp:
        small, large = Path(temp) / "small", Path(temp) / "large"
        started = time.perf_counter()
        make_small(small, args.small)
        make_large(large, args.large)
        print(f"generated {args.small} small and {args.large} large images in {time.perf_counter() - started:.1f} s")
        timed(f"fast scan, {args.small} small, 1 worker", args.small, lambda: scan(small, resolutions=[64], workers=1))
        timed(f"fast scan, {args.small} small, {cores} workers", args.small, lambda: scan(small, resolutions=[64]))
        timed(
            f"deep scan, {args.small} small, {cores} workers",
            args.small,
            lambda: scan(small, deep=True, resolutions=[64]),
        )
        one = timed(
            f"deep scan, {args.large} × 1 MP JPEG, 1 worker", args.large, lambda: scan(large, deep=True, workers=1)
        )
        every = timed(
            f"deep scan, {args.large} × 1 MP JPEG, {cores} workers", args.large, lambda: scan(large, deep=True)
        )
        print(
            f"deep scan: {one:.0f} images/s on one core; {every / cores:.0f} per core with all {cores} "
            f"({every / one:.2f}× from {cores} threads)"
        )


if __name__ == "__main__":
    main()
