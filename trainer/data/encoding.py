"""Encode Images' pass over a dataset: each image decoded once (on worker threads) for all its bucket
entries, cropped, and encoded by the VAE in batches of one bucket; a latent cached per entry."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from . import DatasetError
from .buckets import Entry
from .companions import Sample, entry_sample, start_pixels
from .folder.clips import read_frames
from .folder.images import ImageProblem, load_rgb
from .folder.report import Problem
from .prefetch import in_order

ImageEncoder = Callable[[np.ndarray], np.ndarray]
Progress = Callable[[int, int], None]


def encode_latents(
    ds, encode: ImageEncoder, *, batch_size: int, progress: Progress | None, vision: ImageEncoder | None = None
) -> tuple[set[int], list[Problem]]:
    """Cache the latents `ds` (a Dataset) still lacks; the items that failed to decode so far, and why. `vision`:
    start images [B,H,W,3] → their CLIP vision features [B,T,D], cached beside each clip's start image."""
    entries = ds.plan.entries
    todo = [n for n in ds.usable_entries() if not ds.cache.has("latents", ds.entry_key(entries[n]))]
    failed, problems = set(ds.failed_items), list(ds.encode_problems)
    by_item: dict[int, list[int]] = {}
    for n in sorted(todo, key=lambda n: entries[n].item):
        if entries[n].item not in failed:
            by_item.setdefault(entries[n].item, []).append(n)
    batches, done = _Batches(ds, encode, batch_size, vision), 0
    for index, samples, problem in in_order(by_item.items(), _decoder(ds)):
        for n, sample in samples:
            batches.add(n, sample)
            done += 1
            if progress is not None:
                progress(done, len(todo))
        if problem is not None:
            failed.add(index)
            problems.append(problem)
    batches.flush_all()
    return failed, problems


def _decoder(ds):
    """job (item index, its entries) → (index, [(entry, Sample)], the Problem that left it out or None)."""
    root, entries = Path(ds.report.root), ds.plan.entries

    def decode(job):  # on a worker thread: each image (or clip) decoded once for all its entries
        index, ns = job
        item, samples = ds.report.items[index], []
        try:
            if item.is_clip:
                return index, clip_samples(root / item.path, [(n, entries[n]) for n in ns], ds.start_images), None
            image = Image.fromarray(load_rgb(root / item.path))
            for n in ns:
                samples.append((n, entry_sample(root, item, image, entries[n], crop_pixels)))
        except ImageProblem as err:  # the image, a mask or a control: the image is left out from here
            return index, samples, Problem(err.code, item.path, err.message, err.fix, "skipped")
        return index, samples, None

    return decode


class _Batches:
    """Decoded samples waiting per bucket; a full bucket goes to the encoder and into the cache."""

    def __init__(self, ds, encode: ImageEncoder, batch_size: int, vision: ImageEncoder | None = None):
        self.ds, self.encode, self.batch_size, self.vision = ds, encode, batch_size, vision
        self.pending: dict[tuple[int, int], list] = {}

    def add(self, n: int, sample) -> None:
        bucket = self.ds.plan.entries[n].key  # size, and a clip's frame count: one encoder call stacks alike
        self.pending.setdefault(bucket, []).append((n, sample))
        if len(self.pending[bucket]) >= self.batch_size:
            self.flush(bucket)

    def flush_all(self) -> None:
        for bucket in list(self.pending):
            self.flush(bucket)

    def flush(self, bucket) -> None:
        rows, entries = self.pending.pop(bucket, []), self.ds.plan.entries
        if not rows:
            return
        # One encoder call for the images and their control images (all cropped to this bucket).
        stack = [pixels for _, sample in rows for pixels in sample.stack()]
        pixels = np.stack(stack)  # images [B,H,W,3], clips [B,T,H,W,3]
        latents = np.asarray(self.encode(pixels), dtype=np.float32)
        if latents.ndim != pixels.ndim or latents.shape[0] != len(stack):
            expected = "[B,C,h,w]" if pixels.ndim == 4 else "[B,C,t,h,w] (clips need a video VAE, e.g. Wan's)"
            raise DatasetError(
                f"the VAE returned shape {list(latents.shape)} for pixels {list(pixels.shape)}; expected {expected}"
            )
        features, start = self.features(rows), 0
        for n, sample in rows:
            count = len(sample.stack())
            self.ds.cache.put(
                "latents",
                self.ds.entry_key(entries[n]),
                sample.tensors(latents[start : start + count], features.get(n)),
                {"image": self.ds.report.items[entries[n].item].path, "bucket": entries[n].key},
            )
            start += count

    def features(self, rows) -> dict[int, np.ndarray]:
        """The CLIP vision features of the rows' start images (their first frames), {} without a vision encoder."""
        starts = [(n, sample.start[0]) for n, sample in rows if sample.start is not None]
        if self.vision is None or not starts:
            return {}
        out = np.asarray(self.vision(np.stack([frame for _, frame in starts])), dtype=np.float32)
        if out.ndim != 3 or out.shape[0] != len(starts):
            raise DatasetError(
                f"the CLIP vision encoder returned shape {list(out.shape)} for {len(starts)} start images; "
                "expected [B,tokens,dim] (its penultimate hidden states)"
            )
        return {n: out[row] for row, (n, _) in enumerate(starts)}


def clip_samples(path: Path, entries: list[tuple[int, Entry]], start: bool = False) -> list[tuple[int, Sample]]:
    """A clip's entries: each window's frames decoded once, resized and cropped like an image → [T,H,W,3]; with
    `start`, each window's start image beside it (its first frame, then grey: companions.start_pixels)."""
    frames = read_frames(path, sorted({index for _, entry in entries for index in entry.frames}))
    images = {index: Image.fromarray(frame) for index, frame in frames.items()}
    samples = []
    for n, entry in entries:
        pixels = np.stack([crop_pixels(images[i], entry) for i in entry.frames])
        samples.append((n, Sample(pixels, start=start_pixels(pixels) if start else None)))
    return samples


def crop_pixels(image: Image.Image, entry: Entry) -> np.ndarray:
    """Resize to cover the bucket (Lanczos), crop at the entry's offset → float32 [H,W,3] in 0..1."""
    resized = image.resize(entry.resized, Image.Resampling.LANCZOS) if image.size != entry.resized else image
    x, y = entry.offset
    box = resized.crop((x, y, x + entry.bucket[0], y + entry.bucket[1]))
    return np.asarray(box, dtype=np.float32) / 255.0
