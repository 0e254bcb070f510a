"""trainer/backends/torch_backend/memory_plan.py: stream_blocks auto streams the fewest blocks that make the
estimated step fit, an explicit count stands, a host without the RAM for the pinned copies is refused before
the first step with the model given back, and an out-of-memory step streams more without losing the step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.backends.torch_backend import levers, memory_plan
from trainer.config import ConfigError
from trainer.estimate.torch_step import AUTO_SAFETY, stream_margin

GIB = 2**30


@pytest.fixture
def cpu_as_gpu(monkeypatch):
    """The CPU stands in for a GPU whose memory the plan counts (its free memory is given to decide)."""
    monkeypatch.setattr(memory_plan, "STREAMS_ON", ("cuda", "cpu"))


def plan_for(
    make_model, make_config, monkeypatch, *, need, free, total=8 * GIB, host=64 * GIB, offloaded=None, **settings
):
    """The plan for eight alike frozen blocks (a Linear each), the step's estimate `need` bytes (`offloaded` with
    the kept block inputs on the host; default: the same)."""
    blocks = [torch.nn.Linear(16, 16).requires_grad_(False) for _ in range(8)]
    monkeypatch.setattr(
        levers, "estimated_step_bytes", lambda *a, offload=None: offloaded if offload and offloaded else need
    )
    cfg = make_config(**settings)
    return memory_plan.decide(
        torch.nn.ModuleList(blocks), cfg, torch.device("cpu"), blocks, (free, total), host
    ), blocks


def test_auto_streams_the_fewest_blocks_that_make_the_step_fit(make_model, make_config, monkeypatch, cpu_as_gpu):
    probe, blocks = plan_for(make_model, make_config, monkeypatch, need=0, free=0)
    size, count = probe.sizes[0], probe.blocks
    assert count == 8 and all(s == size for s in probe.sizes)
    margin = stream_margin(8 * GIB)
    # free memory short by 1.5 blocks' weights beyond the ring: 2 + ring blocks' worth must stream
    need = 1000
    free = int(AUTO_SAFETY * need) + margin - int(1.5 * size)
    plan, _ = plan_for(make_model, make_config, monkeypatch, need=need, free=free)
    slot = probe.slot_sizes[0]  # a ring slot holds a block with its weights aligned: a little more
    expected = next(k for k in range(count + 1) if k * size - min(3, k) * slot >= 1.5 * size)
    assert plan.stream == expected
    assert plan.note.startswith(f"stream_blocks auto → {expected} of {count}")
    assert plan.after[0] == free + plan.streamed_bytes - plan.ring_bytes  # every weight was on the "GPU"
    assert plan.host_new_bytes == plan.streamed_bytes
    assert f"{count - expected} of {count} blocks on the GPU" in plan.summary()


def test_auto_streams_nothing_where_the_step_fits(make_model, make_config, monkeypatch, cpu_as_gpu):
    plan, _ = plan_for(make_model, make_config, monkeypatch, need=1000, free=4 * GIB)
    assert plan.stream == 0 and "fits beside the base" in plan.note
    assert plan.summary().endswith("nothing streams")


def test_auto_streams_everything_and_says_so_where_nothing_fits(make_model, make_config, monkeypatch, cpu_as_gpu):
    plan, _ = plan_for(make_model, make_config, monkeypatch, need=64 * GIB, free=GIB)
    assert plan.stream == plan.blocks and "may still not fit" in plan.note and "base_quantize int8" in plan.note


def test_offload_activations_auto_turns_on_only_where_nothing_else_fits(
    make_model, make_config, monkeypatch, cpu_as_gpu
):
    """Streaming every block cannot make a 64 GiB step fit; with the kept inputs on the host it needs 1000 bytes:
    auto moves them, says so, and streams as few blocks as then fit. Where streaming alone fits, it stays off."""
    checkpointed = {"gradient_checkpointing": True}
    plan, _ = plan_for(
        make_model, make_config, monkeypatch, need=64 * GIB, offloaded=1000, free=4 * GIB, **checkpointed
    )
    assert plan.offload and plan.fits and plan.stream == 0
    assert "offload_activations auto → on" in plan.note and "kept inputs in pinned host memory" in plan.summary()
    plan, _ = plan_for(make_model, make_config, monkeypatch, need=1000, offloaded=10, free=4 * GIB, **checkpointed)
    assert not plan.offload and "offload_activations" not in plan.note
    for settings in ({"offload_activations": False, **checkpointed}, {"gradient_checkpointing": False}):
        plan, _ = plan_for(make_model, make_config, monkeypatch, need=64 * GIB, offloaded=1000, free=GIB, **settings)
        assert not plan.offload and not plan.fits  # never where the setting or checkpointing says no
    plan, _ = plan_for(
        make_model,
        make_config,
        monkeypatch,
        need=1000,
        free=4 * GIB,
        stream_blocks=2,
        offload_activations=True,
        **checkpointed,
    )
    assert plan.offload and plan.stream == 2  # true stands beside an explicit count


def test_a_model_without_an_estimate_streams_nothing(make_model, make_config, monkeypatch, cpu_as_gpu):
    plan, _ = plan_for(make_model, make_config, monkeypatch, need=None, free=0)
    assert plan.stream == 0 and "no memory estimate" in plan.note


def test_an_explicit_count_stands(make_model, make_config, monkeypatch, cpu_as_gpu):
    plan, _ = plan_for(make_model, make_config, monkeypatch, need=1000, free=4 * GIB, stream_blocks=2)
    assert plan.stream == 2 and plan.note == ""
    plan, _ = plan_for(make_model, make_config, monkeypatch, need=1000, free=4 * GIB, stream_blocks=99)
    assert plan.stream == 8  # no more than the model has


def test_off_a_gpu_auto_plans_nothing(make_model, make_config, monkeypatch):
    plan, _ = plan_for(make_model, make_config, monkeypatch, need=64 * GIB, free=0)
    assert plan.stream == 0 and plan.note == "" and plan.after is None


def test_a_host_without_the_ram_for_the_pinned_copies_is_refused(make_model, make_config, monkeypatch, cpu_as_gpu):
    with pytest.raises(ConfigError) as error:
        plan_for(make_model, make_config, monkeypatch, need=1000, free=4 * GIB, host=GIB, stream_blocks=2)
    message = str(error.value)
    assert "pinned host memory" in message and "GiB available" in message
    assert "base_quantize int8" in message and "estimate" in message


def test_a_refused_plan_gives_the_model_back(tmp_path, make_model, make_data, make_config, monkeypatch, cpu_as_gpu):
    """Set-up fails before the first step: no LoRA or wrapper is left on the model (ComfyUI uses it again)."""
    from trainer.run.loop import train

    monkeypatch.setattr(memory_plan, "host_available_bytes", lambda: 0)
    monkeypatch.setattr(levers, "free_bytes", lambda device: (8 * GIB, 8 * GIB))
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match="pinned host memory"):
        train(make_config(steps=2, stream_blocks=2), model, make_data(), run_dir=tmp_path / "run")
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert {k: v.clone() for k, v in model.state_dict().items()}.keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert [p.requires_grad for p in model.parameters()] == [p.requires_grad for p in make_model().parameters()]


def test_out_of_memory_streams_more_and_redoes_the_step(
    tmp_path, make_model, make_data, make_config, monkeypatch, cpu_as_gpu
):
    """stream_blocks auto: a step that runs out of GPU memory is redone with a quarter of the blocks more
    streamed; the run's LoRA is bitwise the one of a run that never ran out, and the plan says what changed."""
    from trainer.backends.torch_backend.backend import TorchBackend
    from trainer.run.loop import train

    from trainer.run.callbacks import Callbacks

    plans, real_loss = [], TorchBackend._loss
    monkeypatch.setattr(levers, "free_bytes", lambda device: (64 * GIB, 64 * GIB))

    def loss(self, inputs):
        if self.memory.stream == 0:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_loss(self, inputs)

    class Front(Callbacks):
        def on_start(self, plan):
            plans.append(plan)

    results = []
    for failing in (False, True):
        if failing:
            monkeypatch.setattr(TorchBackend, "_loss", loss)
        cfg = make_config(steps=3) if failing else make_config(steps=3, stream_blocks=1)
        model = make_model()
        results.append(train(cfg, model, make_data(), run_dir=tmp_path / f"r{failing}", callbacks=Front()))
        assert all("forward" not in m.__dict__ for m in model.modules())
    assert plans[0][0].startswith("memory plan: ") and "1 streamed" in plans[0][0]
    assert plans[1][0].endswith("nothing streams")  # auto on the CPU: the step-down came later
    for key, weights in results[0].lora.items():
        assert np.array_equal(weights.A, results[1].lora[key].A), key
        assert np.array_equal(weights.B, results[1].lora[key].B), key


def storage_for(make_config, monkeypatch, *, need, free, host=64 * GIB, **settings):
    """base_quantize as `storage` decides it for eight alike frozen blocks, the step's estimate `need` bytes."""
    blocks = [torch.nn.Linear(16, 16).requires_grad_(False) for _ in range(8)]
    monkeypatch.setattr(levers, "estimated_step_bytes", lambda *a: need)
    monkeypatch.setattr(levers, "free_bytes", lambda device: (free, 8 * GIB))
    monkeypatch.setattr(memory_plan, "host_available_bytes", lambda: host)
    cfg, note = memory_plan.storage(torch.nn.ModuleList(blocks), make_config(**settings), torch.device("cpu"), blocks)
    return cfg.base_quantize, note


def test_base_quantize_auto_keeps_the_base_as_stored_where_streaming_makes_it_fit(make_config, monkeypatch, cpu_as_gpu):
    assert make_config().base_quantize == "auto"  # the default
    assert storage_for(make_config, monkeypatch, need=1000, free=4 * GIB) == ("none", "")  # resident
    size = 16 * 16 * 4 + 16 * 4  # a block's frozen bytes; short by 1.5 blocks: streaming some makes it fit
    free = int(AUTO_SAFETY * 1000) + stream_margin(8 * GIB) - int(1.5 * size)
    assert storage_for(make_config, monkeypatch, need=1000, free=free) == ("none", "")


def test_base_quantize_auto_picks_int8_where_the_run_cannot_fit_otherwise(make_config, monkeypatch, cpu_as_gpu):
    quantize, note = storage_for(make_config, monkeypatch, need=64 * GIB, free=GIB)
    assert quantize == "int8" and "base_quantize auto → int8" in note and "streaming every block" in note
    quantize, note = storage_for(make_config, monkeypatch, need=1000, free=4 * GIB, host=0, stream_blocks=2)
    assert quantize == "int8" and "lacks the RAM" in note


@pytest.mark.parametrize(
    "settings",
    [
        {"base_quantize": "none"},
        {"adapter": "dora"},
        {"adapter": "full"},
        {"fp8_compute": True, "mixed_precision": "bf16"},
        {"sharding": "shard"},
    ],
)
def test_base_quantize_auto_never_overrides_a_choice_or_what_int8_cannot_serve(
    make_config, monkeypatch, cpu_as_gpu, settings
):
    assert storage_for(make_config, monkeypatch, need=64 * GIB, free=GIB, **settings) == ("none", "")


def test_base_quantize_auto_is_none_off_a_gpu(make_config, monkeypatch):
    assert storage_for(make_config, monkeypatch, need=64 * GIB, free=GIB) == ("none", "")
