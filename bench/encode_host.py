"""Encode Images' host work on phone-size photos: decoding, resizing to each bucket, cropping, cache writes.

    python bench/encode_host.py [--images 24] [--res 512,768,1024] [--runs 2]

24 photo-like JPEGs of 12 MP (4032x3024 and six other shapes; quality 92) are made in a temporary folder
(not timed, then in the page cache), loaded as a Kiln dataset at the resolutions, and encoded with a stand-in
VAE (an 8x8 mean pool: the host's work, not the GPU's) into a fresh cache, with one decoding thread and with
the default (`trainer.data.prefetch.workers()`), alternating, `--runs` times each; the encoder's inputs must
be equal bit for bit. Appends one record to bench/results_cpu.json (`"kind": "encode_host"`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import append  # noqa: E402
from scan_bench import photo_like  # noqa: E402

from trainer.data import prefetch  # noqa: E402
from trainer.data.dataset import Dataset, DataSettings  # noqa: E402

SHAPES = [(4032, 3024), (3024, 4032), (4000, 3000), (3000, 4000), (4032, 2268), (2268, 4032), (3024, 3024)]


def make_photos(folder: Path, count: int) -> None:
    rng = np.random.default_rng(0)
    for index in range(count):
        width, height = SHAPES[index % len(SHAPES)]
        photo_like(rng, width, height).save(folder / f"{index:02d}.jpg", quality=92)
        (folder / f"{index:02d}.txt").write_text(f"a photo, number {index}", encoding="utf-8")


def encode_once(folder: Path, resolutions, threads: int, cache: Path) -> tuple[float, str, int]:
    digest, calls = hashlib.sha256(), [0]

    def vae(pixels: np.ndarray) -> np.ndarray:
        digest.update(pixels.tobytes())
        calls[0] += 1
        b, h, w, _ = pixels.shape
        return pixels.reshape(b, h // 8, 8, w // 8, 8, 3).mean(axis=(2, 4)).transpose(0, 3, 1, 2)

    original = prefetch.workers
    prefetch.workers = lambda: threads
    try:
        dataset = Dataset.load(folder, DataSettings(resolutions=tuple(resolutions)), cache_dir=cache)
        started = time.perf_counter()
        dataset.encode_images(vae, "stand-in", batch_size=1)
        return time.perf_counter() - started, digest.hexdigest(), calls[0]
    finally:
        prefetch.workers = original


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--res", default="512,768,1024")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args(argv)
    resolutions = [int(r) for r in args.res.split(",")]
    threads = prefetch.workers()
    with tempfile.TemporaryDirectory(prefix="kiln_encode_") as tmp:
        folder = Path(tmp) / "photos"
        folder.mkdir()
        make_photos(folder, args.images)
        megabytes = sum(f.stat().st_size for f in folder.glob("*.jpg")) / 1e6
        seconds: dict[int, list[float]] = {1: [], threads: []}
        digests, entries = set(), 0
        for run in range(args.runs):
            for n in (1, threads) if run % 2 == 0 else (threads, 1):
                took, digest, entries = encode_once(folder, resolutions, n, Path(tmp) / f"cache_{run}_{n}")
                seconds[n].append(took)
                digests.add(digest)
                print(f"[encode_host] {n} thread(s): {took:.2f} s", flush=True)
    if len(digests) != 1:
        raise SystemExit("the encoder's inputs differed between thread counts")
    one, many = statistics.median(seconds[1]), statistics.median(seconds[threads])
    record = {
        "kind": "encode_host",
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.node(),
        "cpu": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "images": args.images,
        "megapixels": 12.2,
        "jpeg_mb": round(megabytes, 1),
        "resolutions": resolutions,
        "entries": entries,
        "threads": threads,
        "one_thread_s": round(one, 2),
        "threads_s": round(many, 2),
        "speedup": round(one / many, 2),
        "runs": args.runs,
        "inputs_equal": True,
        "seconds": {str(k): [round(v, 2) for v in vs] for k, vs in seconds.items()},
    }
    append(record)
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
