"""Seeded batch order over buckets and epochs, with a cursor a run can save and restore.

Each epoch's plan is a pure function of (seed, epoch): shuffle every bucket,
cut it into batches (a short last batch is kept, never mixed with another
bucket), then shuffle the batches. The cursor is (epoch, position), so a
resumed run draws exactly the batch it would have drawn next.
"""
from __future__ import annotations

import numpy as np

_STREAM = 0x5EED  # separates this stream from the noise generator seeded with the same seed


class BucketSampler:
    def __init__(self, buckets: dict[str, list[int]], batch_size: int, seed: int):
        self.buckets = {key: list(indices) for key, indices in sorted(buckets.items()) if indices}
        if not self.buckets:
            raise ValueError("no training items: every bucket is empty")
        self.batch_size, self.seed = batch_size, seed
        self.epoch, self.position = 0, 0
        self._plan = self.epoch_plan(0)

    def epoch_plan(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, _STREAM, epoch])
        batches = []
        for indices in self.buckets.values():
            order = rng.permutation(indices).tolist()
            batches += [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
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
