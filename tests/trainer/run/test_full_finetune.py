"""Full fine-tune (adapter "full"): every block weight trains, resume is bitwise exact, the model goes back as it
came, the run writes a diffusion-model file, and extract turns it into a LoRA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer import config as config
from trainer import safetensors_io
from trainer.config import ConfigError
from trainer.lora.extract import extract
from trainer.lora.model_file import RUN_FILE, run_model_file, save_diffusion_model
from trainer.lora.tools import RankRule

from helpers.resume import assert_bitwise_resume
from helpers.tiny_runs import train_until


@pytest.fixture
def full_config(make_config):
    return make_config(
        adapter="full",
        steps=8,
        checkpoint_every=4,
        caption_dropout=0.3,
        ema=True,
        ema_decay=0.9,
        grad_accum=2,
        lr_schedule="cosine_with_warmup",
        warmup_steps=2,
        gradient_checkpointing=True,
        learning_rate=1e-3,
    )


def test_every_weight_trains_and_the_model_comes_back(tmp_path, make_model, make_data, full_config):
    model = make_model().requires_grad_(False)  # frozen, as a ComfyUI MODEL is
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train_until(tmp_path / "full", model, make_data(), full_config)
    assert result.trainable_parameters == sum(p.numel() for p in model.parameters())
    assert result.lora == {} and result.model is not None and set(result.model) == set(before)
    for name in before:  # blocks, embedders and final layer alike (EMA weights in the result)
        assert not np.array_equal(result.model[name], before[name].numpy()), name
    for name, tensor in model.state_dict().items():  # the model handed back is the base, bit for bit
        assert torch.equal(tensor, before[name]), name
    assert not any(p.requires_grad for p in model.parameters())  # and frozen again: a LoRA run may follow
    state, _ = safetensors_io.read(result.checkpoint / "state.safetensors")
    assert {f"full.{n}" for n in before} == {k for k in state if k.startswith("full.")}


def test_resume_is_bitwise_exact(tmp_path, make_model, make_data, full_config):
    straight = train_until(tmp_path / "straight", make_model(), make_data(), full_config)
    first = train_until(tmp_path / "stopped", make_model(), make_data(), full_config, stop_at=3)
    assert first.stopped and first.step == 3
    resumed = train_until(tmp_path / "stopped", make_model(), make_data(), full_config, resume=True)
    assert resumed.step == 8
    assert_bitwise_resume(straight, resumed, holds=("full.", "ema.", "optim."))
    assert all(np.array_equal(straight.model[k], resumed.model[k]) for k in straight.model)


def test_bf16_weights_are_checkpointed_as_bf16_and_resume_bitwise(tmp_path, make_model, make_data, full_config):
    """A bf16 model's weights go into the checkpoint as their own bits (BF16: half of fp32's bytes, as a 6B model's
    12 GB against 24), and a resume from it equals the run that never stopped."""
    cfg = config.replace(full_config, ema=False, mixed_precision="no")

    def bf16_model():
        return make_model().to(torch.bfloat16)

    straight = train_until(tmp_path / "straight", bf16_model(), make_data(), cfg)
    first = train_until(tmp_path / "stopped", bf16_model(), make_data(), cfg, stop_at=3)
    entries, _ = safetensors_io.read_header(first.checkpoint / "state.safetensors")
    full_entries = {k: e["dtype"] for k, e in entries.items() if k.startswith("full.")}
    assert full_entries and set(full_entries.values()) == {"BF16"}
    resumed = train_until(tmp_path / "stopped", bf16_model(), make_data(), cfg, resume=True)
    assert resumed.step == 8
    assert_bitwise_resume(straight, resumed, holds=("full.", "optim."))
    assert all(np.array_equal(straight.model[k], resumed.model[k]) for k in straight.model)


def test_extract_at_full_rank_reproduces_the_delta(tmp_path, make_model, make_data, full_config):
    base_model = make_model()
    base = {k: v.float().numpy() for k, v in base_model.state_dict().items()}
    result = train_until(tmp_path / "full", base_model, make_data(), config.replace(full_config, ema=False, steps=4))
    path = tmp_path / "tuned.safetensors"
    save_diffusion_model(path, result.model, dtype="fp32", metadata={})
    tuned, metadata = safetensors_io.read(path)
    assert metadata["kiln.kind"] == "diffusion_model"
    assert all(np.array_equal(tuned[k], result.model[k]) for k in result.model)
    lora, _ = extract(base, tuned, RankRule(rank=4096), svd="full")
    assert lora
    for path_, weights in lora.items():
        delta = tuned[f"{path_}.weight"] - base[f"{path_}.weight"]
        rebuilt = weights.B @ weights.A * (weights.alpha / weights.A.shape[0])
        assert np.allclose(rebuilt, delta, atol=1e-5 * max(1.0, float(np.abs(delta).max()))), path_


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"backend": "mlx"}, "backend 'torch' only"),
        ({"preservation_weight": 0.5, "preservation_class": "person"}, "preservation_weight to 0"),
        ({"base_quantize": "int8"}, "base_quantize to none"),
    ],
)
def test_full_refuses_what_it_cannot_train_with(make_config, overrides, named):
    with pytest.raises(ConfigError, match=named):
        make_config(adapter="full", **overrides)


def test_bf16_updates_round_stochastically():
    """An update below bf16's resolution still moves the weight on average (round-to-nearest would drop it)."""
    from trainer.backends.torch_backend.full import round_bf16_updates

    weight = torch.nn.Parameter(torch.ones(8192, dtype=torch.bfloat16))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    round_bf16_updates(optimizer, [weight])
    weight.grad = torch.full_like(weight, 5e-4)  # 1 − 5e-4: nearest is 1.0; the next bf16 below is 1 − 2⁻⁸
    torch.manual_seed(0)
    optimizer.step()
    assert weight.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert set(weight.detach().float().unique().tolist()) == {1 - 2**-8, 1.0}
    assert abs(float(weight.detach().float().mean()) - (1 - 5e-4)) < 1e-4


def _bf16_steps(name, monkeypatch, chunk=None, steps=3, optimizer="adamw"):
    """Three steps of a few bf16 weights through round_bf16_updates (chunked as `name` says); the weights, the
    optimizer's state, and the most entries the optimizer was handed in one call."""
    from trainer.backends.torch_backend.full import round_bf16_updates
    from trainer.backends.torch_backend.optim import build_optimizer, optimizer_arrays
    from trainer.estimate import full_step

    if chunk:
        monkeypatch.setattr(full_step, "STEP_CHUNK_WEIGHTS", chunk)
    generator = torch.Generator().manual_seed(0)
    shapes = [(64, 64), (32,), (128, 64), (16, 16), (4096,)]  # three reach torchao's 4096 entries (8-bit moments)
    weights = [torch.nn.Parameter(torch.randn(s, generator=generator).bfloat16()) for s in shapes]
    built = build_optimizer(
        weights, optimizer, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, device=torch.device("cpu")
    )
    held, step = [], built.step
    built.step = lambda: (held.append(sum(p.numel() for g in built.param_groups for p in g["params"])), step())
    round_bf16_updates(built, weights, name)
    torch.manual_seed(1)
    for _ in range(steps):
        for w in weights:
            w.grad = torch.randn(w.shape, generator=generator).bfloat16() * 1e-3
        built.step()
    state = optimizer_arrays(built, [str(i) for i in range(len(weights))])[0]
    return [w.detach().float().numpy() for w in weights], state, max(held)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit_torchao"])
def test_bf16_steps_a_chunk_at_a_time_and_end_the_same(monkeypatch, optimizer):
    """An optimizer that steps each weight alone steps the fp32 copies a chunk at a time (so a 6 B-weight model holds
    ~2.5 GiB of them at once, not ~57), and the weights and moments equal the all-at-once step's bit for bit."""
    whole, whole_state, whole_held = _bf16_steps(None, monkeypatch, optimizer=optimizer)
    chunked, chunked_state, chunked_held = _bf16_steps(optimizer, monkeypatch, chunk=6000, optimizer=optimizer)
    assert whole_held == 64 * 64 + 32 + 128 * 64 + 16 * 16 + 4096 and chunked_held <= 6000 + 128 * 64
    assert chunked_held < whole_held
    for a, b in zip(whole, chunked):
        np.testing.assert_array_equal(a, b)
    assert whole_state.keys() == chunked_state.keys() and len(whole_state) >= 2 * len(whole)
    for key in whole_state:
        np.testing.assert_array_equal(whole_state[key], chunked_state[key], err_msg=key)


def test_optimizers_that_read_every_weight_step_whole(monkeypatch):
    """Prodigy's step size and schedule-free's averaging read every weight in one step: never a chunk at a time."""
    from trainer.estimate.full_step import WHOLE_STEP

    assert set(WHOLE_STEP) == {"prodigy", "schedulefree"}
    assert _bf16_steps("prodigy", monkeypatch, chunk=6000)[2] == 64 * 64 + 32 + 128 * 64 + 16 * 16 + 4096


def test_headless_train_writes_the_model_file_and_extract_reads_it(tmp_path):
    from trainer.cli.main import main
    from trainer.demo.run import demo_config, make_dataset, model_for

    make_dataset(tmp_path / "data", seed=0)
    config = tmp_path / "run.toml"
    config.write_text(
        f'arch = "demo"\ndevice = "cpu"\nmixed_precision = "no"\nsteps = 2\nadapter = "full"\nsave_dtype = "fp32"\n'
        f'dataset_dir = "{tmp_path / "data"}"\noutput_dir = "{tmp_path / "runs"}"\n'
        f'run_name = "mine"\nresolutions = [128]\ncheckpoint_every = 0\n'
    )
    assert main(["train", str(config)]) == 0
    tuned_path = tmp_path / "runs" / "mine" / "mine.safetensors"
    tuned, metadata = safetensors_io.read(tuned_path)
    assert metadata["kiln.kind"] == "diffusion_model"
    base = {k: v.numpy() for k, v in model_for(demo_config()).state_dict().items()}
    assert set(tuned) == set(base) and any(not np.array_equal(tuned[k], base[k]) for k in base)
    base_path = tmp_path / "base.safetensors"
    save_diffusion_model(base_path, base, dtype="fp32", metadata={})
    out = tmp_path / "extracted.safetensors"
    assert main(["extract", str(base_path), str(tuned_path), str(out), "--rank", "4"]) == 0
    from trainer.lora.files import load_lora

    lora, _ = load_lora(out, arch="demo")
    assert lora and all(w.A.shape[0] <= 4 for w in lora.values())


def test_the_run_folders_model_file_is_found_under_either_name(tmp_path, make_model, make_data, full_config):
    """Load Run's state carries a full run's model file: a node run's diffusion_model.safetensors, or the
    `<name>.safetensors` a headless run writes (kiln.kind diffusion_model); a LoRA beside it is not the model."""
    run = tmp_path / "run"
    result = train_until(run, make_model(), make_data(), config.replace(full_config, ema=False, steps=3))
    assert run_model_file(run) == ""  # the checkpoint alone: no model file yet
    safetensors_io.write(run / "notes.safetensors", {"x": np.zeros(2, np.float32)}, {"kiln.kind": "lora"})
    (run / "broken.safetensors").write_bytes(b"not a safetensors file")
    headless = run / "run.safetensors"
    save_diffusion_model(headless, result.model, dtype="fp32", metadata={})
    assert run_model_file(run) == str(headless)
    save_diffusion_model(run / RUN_FILE, result.model, dtype="fp32", metadata={})
    assert run_model_file(run) == str(run / RUN_FILE)


def test_flat_copies_step_as_the_copies_per_weight_do(monkeypatch):
    """AdamW (FLAT_STEP) steps a chunk's fp32 copies as views of one flat buffer, rounded in place in slices; the
    weights and moments equal those of one fp32 copy per weight, rounded one by one, bit for bit (CPU)."""
    from trainer.backends.torch_backend import full

    monkeypatch.setattr(full, "ROUND_SLICE", 1000)  # several slices, one of them across two weights
    rounded, round_flat = [], full.round_flat_
    monkeypatch.setattr(full, "round_flat_", lambda flat: (rounded.append(flat.numel()), round_flat(flat)))
    flat, flat_state, _ = _bf16_steps("adamw", monkeypatch, chunk=6000)
    assert len(rounded) >= 3 * 2 and max(rounded) > 4096  # each step's chunks, a buffer over several weights
    flat_buffers = len(rounded)
    monkeypatch.setattr(full, "FLAT_STEP", frozenset())
    each, each_state, _ = _bf16_steps("adamw", monkeypatch, chunk=6000)
    assert len(rounded) == flat_buffers  # the per-weight path rounds no buffer
    assert all(np.array_equal(a, b) for a, b in zip(flat, each))
    assert flat_state.keys() == each_state.keys()
    assert all(np.array_equal(flat_state[k], each_state[k]) for k in flat_state)


def test_fp32_copies_are_views_of_one_buffer():
    """fp32_copies: exact fp32 values of the bf16 tensors, each a view of one flat buffer (what round_flat_ rounds)."""
    from trainer.backends.torch_backend.full import fp32_copies

    tensors = [torch.randn(s).bfloat16() for s in [(3, 5), (7,), (2, 2, 2)]]
    flats, views = fp32_copies(tensors)
    assert len(flats) == 1 and flats[0].numel() == 15 + 7 + 8 and flats[0].dtype == torch.float32
    assert all(v.shape == t.shape and torch.equal(v, t.float()) for v, t in zip(views, tensors))
    assert all(v.untyped_storage().data_ptr() == flats[0].untyped_storage().data_ptr() for v in views)
    flats[0].zero_()
    assert all(float(v.abs().sum()) == 0 for v in views)
