"""Seeded batch order over buckets and epochs, with a cursor a run can save and restore.

Each epoch's plan is a pure function of (seed, epoch, batch sizes): shuffle
every bucket, cut it into batches of that bucket's size (a short last batch is
kept, never mixed with another bucket), then shuffle the batches. The cursor is
(epoch, position), so a resumed run draws exactly the batch it would have drawn
next. Every image is drawn once per epoch (times its repeats) whatever the sizes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

_STREAM = 0x5EED  # separates this stream from the noise generator seeded with the same seed


def _same_images(tokens: dict[str, int], batch_size: int) -> dict[str, int]:
    return {key: batch_size for key in tokens}


def _same_tokens(tokens: dict[str, int], batch_size: int) -> dict[str, int]:
    """The largest bucket takes batch_size images; a smaller one as many as carry no more tokens than that
    (at least batch_size). A 512 px step then fills the GPU like a 1024 px one (bench/RESULTS.md: alone, a
    512 px image leaves it waiting for the host two thirds of the step), and memory stays the largest's."""
    most = max(tokens.values())
    return {key: max(batch_size, batch_size * most // count) for key, count in tokens.items()}


# batch_by: how many images a batch of each bucket holds, from each bucket's tokens per image.
BATCHING: dict[str, Callable[[dict[str, int], int], dict[str, int]]] = {
    "images": _same_images,
    "tokens": _same_tokens,
}


class BucketSampler:
    def __init__(self, buckets: dict[str, list[int]], batch_size: int | dict[str, int], seed: int):
        self.buckets = {key: list(indices) for key, indices in sorted(buckets.items()) if indices}
        if not self.buckets:
            raise ValueError("no training items: every bucket is empty")
        sizes = batch_size if isinstance(batch_size, dict) else dict.fromkeys(self.buckets, batch_size)
        self.batch_sizes, self.seed = {key: int(sizes[key]) for key in self.buckets}, seed
        self.epoch, self.position = 0, 0
        self._plan = self.epoch_plan(0)

    def epoch_plan(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, _STREAM, epoch])
        batches = []
        for key, indices in self.buckets.items():
            order, size = rng.permutation(indices).tolist(), self.batch_sizes[key]
            batches += [order[i : i + size] for i in range(0, len(order), size)]
        return [batches[i] for i in rng.permutation(len(batches))]

    def next(self) -> list[int]:
        if self.position >= len(self._plan):
            self.epoch, self.position = self.epoch + 1, 0
            self._plan = self.epoch_plan(self.epoch)
        batch = self._plan[self.position]
        self.position += 1
        return batch

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._plan = self.epoch_plan(self.epoch)
