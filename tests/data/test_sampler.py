"""The seeded bucket sampler: one bucket per batch, short last batches, an exact cursor."""
from __future__ import annotations

import pytest

from trainer.data.sampler import BucketSampler

BUCKETS = {"64x64": [0, 1, 2, 3, 4], "64x48": [5, 6, 7], "48x64": [8]}


def bucket_of(index):
    return next(key for key, members in BUCKETS.items() if index in members)


def test_each_epoch_covers_every_item_once_one_bucket_per_batch():
    sampler = BucketSampler(BUCKETS, batch_size=2, seed=7)
    batches = [sampler.next() for _ in range(len(sampler.epoch_plan(0)))]
    assert sorted(i for b in batches for i in b) == list(range(9))
    assert all(len({bucket_of(i) for i in batch}) == 1 for batch in batches)
    assert sorted(len(b) for b in batches) == [1, 1, 1, 2, 2, 2]   # short last batches kept, never mixed


def test_epochs_differ_and_seeds_differ():
    a = BucketSampler(BUCKETS, 2, seed=1)
    first = [a.next() for _ in range(6)]
    second = [a.next() for _ in range(6)]
    assert first != second and a.epoch == 1
    b = BucketSampler(BUCKETS, 2, seed=2)
    assert [b.next() for _ in range(6)] != first


def test_cursor_restores_exactly_across_epochs():
    reference = BucketSampler(BUCKETS, 2, seed=3)
    expected = [reference.next() for _ in range(20)]
    for cut in (0, 4, 6, 13):
        sampler = BucketSampler(BUCKETS, 2, seed=3)
        for _ in range(cut):
            sampler.next()
        restored = BucketSampler(BUCKETS, 2, seed=3)
        restored.load_state(sampler.state())
        assert [restored.next() for _ in range(20 - cut)] == expected[cut:]


def test_empty_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="no training items"):
        BucketSampler({"64x64": []}, 2, seed=0)
