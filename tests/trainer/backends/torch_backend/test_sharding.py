"""sharding (several ranks): what auto chooses from the memory plan, and what shard refuses. The sharded run's
equality with one process and each rank's half of the blocks: tests/trainer/run/test_distributed.py."""

from __future__ import annotations

from dataclasses import replace

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
    # auto with a quantized base (an fp8 checkpoint under fp8_compute auto, base_quantize auto → int8) that streams:
    # it replicates and streams, as one card would, instead of refusing a choice the user did not make
    shard, note = sharding.decide(TrainConfig(), PLAN.with_stream(3), True)
    assert not shard and note.startswith("sharding auto → replicate, the base streaming instead: it is quantized")


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


def test_a_sharded_plan_counts_a_ranks_share_of_the_base_arriving():
    """note27: the memory plan counted the whole base arriving on each GPU under shard; a rank holds 1/N."""
    host = MemoryPlan(0, sizes=(4 * GIB,) * 8, on_device=(0,) * 8, free_and_total=(100 * GIB, 141 * GIB))
    assert host.after == (100 * GIB - 32 * GIB, 141 * GIB)  # one process: the whole base arrives
    assert replace(host, shards=2).after == (100 * GIB - 16 * GIB, 141 * GIB)
    whole = replace(host, on_device=(4 * GIB,) * 8, shards=4)  # loaded whole on the GPU, then sharded: 3/4 freed
    assert whole.after == (100 * GIB + 24 * GIB, 141 * GIB)
    assert "1/4 on each of 4 ranks" in whole.summary()
    # a full fine-tune freezes nothing: the line said "frozen base on the GPU (0.0 GiB of block weights ...)"
    trained = replace(host, sizes=(0,) * 8, shards=2).summary()
    assert trained.startswith("no frozen block weights (every weight trains, 1/2 on each of 2 ranks)"), trained


def test_a_full_run_shards_where_its_training_state_does_not_fit_the_card(two_ranks):
    need = 60 * GIB  # weights, gradients, optimizer state, EMA
    card = replace(PLAN, free_and_total=(50 * GIB, 80 * GIB))
    full = TrainConfig(adapter="full")
    shard, note = sharding.decide(full, card, False, need)
    assert shard and "full fine-tune, it does not fit one card" in note and "~30.0 GiB each" in note
    assert not sharding.decide(full, replace(card, free_and_total=(70 * GIB, 80 * GIB)), False, need)[0]
    assert not sharding.decide(full, PLAN, False, need)[0]  # off CUDA (no free memory known): replicate
    assert sharding.decide(TrainConfig(adapter="full", sharding="shard"), PLAN, False, need)[0]
    assert not sharding.decide(TrainConfig(adapter="full", sharding="replicate"), card, False, need)[0]


def test_a_full_runs_training_state_by_hand():
    """bf16 weights: 2 B + a 2 B gradient each; AdamW 8 B, adamw8bit 2 B; EMA's fp32 shadow 4 B."""
    import torch

    params = [torch.nn.Parameter(torch.zeros(10, 3, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(5))]
    # 30 bf16 + 5 fp32 weights: weights 60 + 20 B, gradients the same
    assert sharding.full_bytes(params, TrainConfig(adapter="full", ema=False)) == 2 * 80 + 35 * 8
    assert sharding.full_bytes(params, TrainConfig(adapter="full", ema=True)) == 2 * 80 + 35 * (8 + 4)
    assert sharding.full_bytes(params, TrainConfig(adapter="full", optimizer="adamw8bit")) == 2 * 80 + 35 * 2
    # torchao's 8-bit AdamW as bitsandbytes' (the table once misspelt its name and counted 8 B); prodigy 16 B;
    # adafactor factors the 10x3 weight (row and column statistics: 4 B x 13) and the 5-vector (4 B x 6)
    assert sharding.full_bytes(params, TrainConfig(adapter="full", optimizer="adamw8bit_torchao")) == 2 * 80 + 35 * 2
    assert sharding.full_bytes(params, TrainConfig(adapter="full", optimizer="prodigy")) == 2 * 80 + 35 * 16
    assert sharding.full_bytes(params, TrainConfig(adapter="full", optimizer="adafactor")) == 2 * 80 + 4 * (13 + 6)


HOST = MemoryPlan(0, sizes=(4 * GIB,) * 8, on_device=(0,) * 8, slot_sizes=(4 * GIB,) * 8)


def test_a_sharded_plan_leaves_room_for_the_block_fsdp_gathers_whole():
    """The 2026-11-29 two-H200 run: Qwen-Image sharded over two 24 GB caps ran out of memory at step 1. A rank
    holds 1/N of each block and, while a block runs, the block gathered whole and its all-gather buffer."""
    plan = replace(HOST, free_and_total=(100 * GIB, 141 * GIB), shards=2)
    assert plan.after == (100 * GIB - 16 * GIB - 2 * 4 * GIB, 141 * GIB)
    assert replace(plan, shards=1).after == (100 * GIB - 32 * GIB, 141 * GIB)  # one process: no gather


@pytest.fixture
def step(monkeypatch):
    from trainer.backends.torch_backend import levers, memory_plan

    need = {"bytes": 6 * GIB}
    monkeypatch.setattr(levers, "estimated_step_bytes", lambda *a, **k: need["bytes"])
    monkeypatch.setattr(memory_plan, "host_available_bytes", lambda: 256 * GIB)
    return need


def test_a_sharded_base_keeps_the_fewest_blocks_shards_on_the_host_where_the_step_needs_it(step):
    """Each rank: 16 GiB of shards + 8 GiB gathered + the step (6 GiB, with the estimate's margin) against a
    24 GiB card. The fewest blocks whose shards wait on the host, spread over the model; none on a large card,
    none off CUDA, none with stream_blocks 0."""
    from trainer.backends.torch_backend import memory_plan

    card = replace(HOST, free_and_total=(24 * GIB, 24 * GIB))
    plan = memory_plan.split(None, TrainConfig(), card, 2, "sharding shard (as set)")
    assert 0 < plan.stream < plan.blocks and plan.shards == 2 and plan.fits
    assert step_fits_after(plan, step["bytes"]) and not step_fits_after(
        plan.with_stream(plan.stream - 1), step["bytes"]
    )
    assert f"{plan.stream} of 8 blocks' shards in pinned host memory" in plan.note
    assert "blocks' shards in pinned host memory" in plan.summary() and "1/2 on each of 2 ranks" in plan.summary()
    assert plan.host_new_bytes == plan.stream * 4 * GIB  # the ranks' halves together: each block once
    large = memory_plan.split(None, TrainConfig(), replace(HOST, free_and_total=(100 * GIB, 141 * GIB)), 2, "n")
    assert large.stream == 0 and large.note == "n"
    assert memory_plan.split(None, TrainConfig(), HOST, 2, "n").stream == 0  # off CUDA: nothing known
    assert memory_plan.split(None, TrainConfig(stream_blocks=0), card, 2, "n").stream == 0
    step["bytes"] = 40 * GIB
    none = memory_plan.split(None, TrainConfig(), card, 2, "n")
    assert none.stream == 8 and not none.fits and "may still not fit" in none.note


def step_fits_after(plan, need):
    from trainer.estimate.torch_step import step_fits

    return step_fits(need, *plan.after)


def test_the_host_must_hold_the_shards_it_is_given(step, monkeypatch):
    from trainer.backends.torch_backend import memory_plan

    monkeypatch.setattr(memory_plan, "host_available_bytes", lambda: 6 * GIB)
    with pytest.raises(ConfigError, match="GiB of pinned host memory"):
        memory_plan.split(None, TrainConfig(), replace(HOST, free_and_total=(24 * GIB, 24 * GIB)), 2, "n")


def test_place_offloads_the_chosen_blocks_shards_and_a_full_run_none(two_ranks, step, monkeypatch):
    import torch

    from trainer.backends.torch_backend import full

    calls = []
    monkeypatch.setattr(sharding, "shard_blocks", lambda blocks, device, root, on_host, loaded: calls.append(on_host))
    card = replace(HOST, free_and_total=(24 * GIB, 24 * GIB))
    plan = sharding.place(TrainConfig(sharding="shard"), card, [], None, False, object(), object())
    assert calls[-1] == tuple(plan.chosen) and plan.stream > 0
    monkeypatch.setattr(sharding, "full_bytes", lambda params, cfg: 0)
    trained = full.FullSet(torch.nn.Linear(2, 2), [])
    plan = sharding.place(TrainConfig(sharding="shard", adapter="full"), card, [], None, False, trained, object())
    assert calls[-1] == () and plan.stream == 0 and plan.shards == 2


def test_shard_blocks_gives_the_host_blocks_fsdps_cpu_offload(two_ranks, monkeypatch):
    """FSDP2's CPU offload (pinned: a GPU copies from it) for the blocks the plan puts on the host; the blocks a
    loader left on the GPU are cut first, so the GPU never holds the host blocks whole beside them."""
    import torch
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.fsdp as fsdp

    policies = []
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda *a, **k: "mesh")
    monkeypatch.setattr(
        fsdp,
        "fully_shard",
        lambda block, mesh, reshard_after_forward, offload_policy: policies.append((block, offload_policy)),
    )
    blocks = [torch.nn.Linear(2, 2) for _ in range(4)]
    loaded = (0, 0, 8, 8)  # ComfyUI's partial load put the last two on the GPU (the plan's on_device)
    sharding.shard_blocks(blocks, torch.device("cuda"), on_host=(1, 3), loaded=loaded)
    assert [blocks.index(block) for block, _ in policies] == [2, 3, 0, 1]  # those on the GPU cut first
    assert [type(p).__name__ for _, p in policies] == ["OffloadPolicy", "CPUOffloadPolicy"] * 2
    assert policies[1][1].pin_memory


def test_fsdps_own_shards_are_not_moved_to_the_gpu():
    """memory_plan.arrive moves what a loader left on the host; a DTensor shard (on the host by FSDP2's CPU
    offload) is FSDP2's to place."""
    import torch

    from trainer.backends.torch_backend import memory_plan

    layer = torch.nn.Linear(2, 2)
    for p in layer.parameters():
        p.device_mesh = "mesh"
    assert memory_plan.arrive([layer], torch.device("cuda")) == []  # nothing touched CUDA (none here)


def test_ddp_keeps_each_compiled_block_one_graph(two_ranks, monkeypatch):
    """The 2026-11-29 two-H200 run: Klein 4B under DDP failed at step 1 ("modified by an inplace operation ...
    output 2 of CompiledFunctionBackward") where dynamo's DDPOptimizer cut Flux2's compiled blocks, which write into
    their inputs, at bucket boundaries. DDP is built with the cut off."""
    import torch
    import torch.nn.parallel

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", lambda module, **options: (module, options))
    # torch's own patch, which gives the setting back after (pytest 9.2's monkeypatch deletes a config module's entry)
    with torch._dynamo.config.patch(optimize_ddp=True):
        module, options = distributed.data_parallel(lambda x: x, [torch.nn.Linear(4, 4)])
        assert torch._dynamo.config.optimize_ddp is False and options["gradient_as_bucket_view"]
