"""sharding (several ranks): what auto chooses from the memory plan, and what shard refuses. The sharded run's
equality with one process and each rank's half of the blocks: tests/trainer/run/test_distributed.py."""

from __future__ import annotations

import pytest

from trainer.backends.torch_backend import sharding
from trainer.backends.torch_backend.memory_plan import GIB, MemoryPlan
from trainer.config import ConfigError, TrainConfig, from_dict
from trainer.run import distributed

PLAN = MemoryPlan(0, sizes=(4 * GIB,) * 8)  # 32 GiB of blocks, all resident


@pytest.fixture
def two_ranks(monkeypatch):
    monkeypatch.setattr(distributed, "current", lambda: distributed.Group(0, 2))


def test_one_process_never_shards_and_says_nothing():
    for choice in ("auto", "replicate", "shard"):
        assert sharding.decide(TrainConfig(sharding=choice), PLAN.with_stream(3), False) == (False, "")


def test_auto_shards_only_where_the_plan_would_stream(two_ranks):
    shard, note = sharding.decide(TrainConfig(), PLAN, False)
    assert not shard and note.startswith("sharding auto → replicate") and "32.0 GiB" in note
    shard, note = sharding.decide(TrainConfig(), PLAN.with_stream(3), False)
    assert shard and note.startswith("sharding auto → shard (the base does not fit") and "~16.0 GiB each" in note
    assert sharding.decide(TrainConfig(sharding="replicate"), PLAN.with_stream(3), False)[0] is False
    assert sharding.decide(TrainConfig(sharding="shard"), PLAN, False)[0] is True


def test_shard_refuses_a_quantized_base_and_explicit_streaming(two_ranks):
    with pytest.raises(ConfigError, match="base_quantize none and fp8_compute off, or sharding replicate"):
        sharding.decide(TrainConfig(sharding="shard"), PLAN, True)
    with pytest.raises(ConfigError, match="stream_blocks 4 and sharding shard"):
        sharding.decide(TrainConfig(sharding="shard", stream_blocks=4), PLAN, False)
    with pytest.raises(ConfigError, match="turn cuda_graphs off, or set sharding replicate"):
        sharding.decide(TrainConfig(sharding="shard", cuda_graphs=True), PLAN, False)
    assert sharding.decide(TrainConfig(sharding="replicate"), PLAN, True)[0] is False  # replicate: as before


@pytest.mark.parametrize(("size", "mb"), [(0, 1.0), (4 * 2**20, 1.0), (80 * 2**20, 10.0), (2**30, 25.0)])
def test_ddp_buckets_cut_a_lora_gradient_into_several(size, mb):
    assert distributed.bucket_mb(size) == mb


def test_validation_samples_keep_the_base_whole(two_ranks):
    """Rank 0 samples alone, and a sharded block's forward needs every rank: auto replicates (the base streams),
    shard is refused before the run starts."""
    prompts = {"arch": "flux2_klein", "sample_prompts": ["a cat"]}
    shard, note = sharding.decide(TrainConfig(**prompts), PLAN.with_stream(3), False)
    assert not shard and "the base streaming instead" in note
    with pytest.raises(ConfigError, match="sample_prompts with sharding shard"):
        from_dict({**prompts, "sharding": "shard"})
