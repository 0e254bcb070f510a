"""The seeded bucket sampler: one bucket per batch, short last batches, an exact cursor."""

from __future__ import annotations

import pytest

from trainer.data.sampler import BATCHING, BucketSampler

BUCKETS = {"64x64": [0, 1, 2, 3, 4], "64x48": [5, 6, 7], "48x64": [8]}


def bucket_of(index):
    return next(key for key, members in BUCKETS.items() if index in members)


def test_each_epoch_covers_every_item_once_one_bucket_per_batch():
    sampler = BucketSampler(BUCKETS, batch_size=2, seed=7)
    batches = [sampler.next() for _ in range(len(sampler.epoch_plan(0)))]
    assert sorted(i for b in batches for i in b) == list(range(9))
    assert all(len({bucket_of(i) for i in batch}) == 1 for batch in batches)
    assert sorted(len(b) for b in batches) == [1, 1, 1, 2, 2, 2]  # short last batches kept, never mixed


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


def test_batch_by_tokens_gives_small_buckets_as_many_tokens_never_more():
    tokens = {"1024x1024": 4096 + 512, "512x512": 1024 + 512, "768x512": 1536 + 512, "1024x768": 3072 + 512}
    assert BATCHING["images"](tokens, 2) == dict.fromkeys(tokens, 2)
    sizes = BATCHING["tokens"](tokens, 1)
    assert sizes == {"1024x1024": 1, "512x512": 3, "768x512": 2, "1024x768": 1}  # 4608 // 1536, // 2048, // 3584
    for key, size in BATCHING["tokens"](tokens, 3).items():
        assert size * tokens[key] <= 3 * tokens["1024x1024"] < (size + 1) * tokens[key] or size == 3


def test_per_bucket_batch_sizes_still_show_every_item_once_an_epoch_and_resume_exactly():
    sizes = {"64x64": 1, "64x48": 2, "48x64": 4}
    sampler = BucketSampler(BUCKETS, sizes, seed=5)
    batches = [sampler.next() for _ in range(len(sampler.epoch_plan(0)))]
    assert sorted(i for b in batches for i in b) == list(range(9))
    assert sorted(len(b) for b in batches) == [1] * 7 + [2]  # 5 × 1; 3 as 2 + 1; the lone 48x64
    assert all(len(b) <= sizes[bucket_of(b[0])] and len({bucket_of(i) for i in b}) == 1 for b in batches)
    expected = [sampler.next() for _ in range(15)]
    restored = BucketSampler(BUCKETS, sizes, seed=5)
    restored.load_state({"epoch": 1, "position": 0})
    assert [restored.next() for _ in range(15)] == expected
