"""Faults injected into real runs: NaN/inf steps are skipped untouched and named, three in a row stop
with a resumable checkpoint, out of memory saves the last good step and names the fix. Both backends
(MLX where mlx[cpu] is installed)."""

from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer import config as config_module
from trainer.archs import get_arch
from trainer.backends.base import Batch
from trainer.backends.torch_backend.backend import TorchBackend
from trainer.run import faults, state
from trainer.run.loop import train

from helpers.resume import assert_bitwise_resume

BACKENDS = [
    "torch",
    pytest.param(
        "mlx",
        marks=pytest.mark.skipif(
            not __import__("importlib").util.find_spec("mlx"), reason="mlx not installed (pip install 'mlx[cpu]')"
        ),
    ),
]


def model_for(backend: str, make_model):
    if backend == "torch":
        return make_model()
    from trainer.backends.mlx_backend.models.tiny import demo_model

    return demo_model(0, hidden=32, heads=2, double_blocks=1, single_blocks=1, in_channels=16, context_dim=32)


@pytest.fixture
def eager_mlx(monkeypatch):
    """MLX steps run eagerly (the same function, no g++ kernel builds on mlx[cpu]) unless a test says otherwise."""
    if __import__("importlib").util.find_spec("mlx"):
        from trainer.backends.mlx_backend.backend import MlxBackend

        monkeypatch.setattr(MlxBackend, "compile_step", False)


class Poisoned:
    """Wraps a dataset: chosen items' latents become NaN (always, or once `on` is set)."""

    def __init__(self, data, items=(), when_on=()):
        self.data, self.items, self.when_on, self.on = data, set(items), set(when_on), False
        self.buckets, self.skipped = data.buckets, []

    def latent(self, index):
        bad = index in self.items or (self.on and (not self.when_on or index in self.when_on))
        return self.data.latent(index) * np.float32("nan") if bad else self.data.latent(index)

    def __getattr__(self, name):
        return getattr(self.data, name)


def batch(poison: str | None = None, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    latents = rng.standard_normal((2, 16, 4, 4)).astype(np.float32)
    weights = np.ones(2, np.float32)
    if poison == "nan_latent":
        latents[1, 0, 0, 0] = np.nan
    elif poison == "inf_weight":
        weights[0] = np.inf
    return Batch(
        latents=latents,
        noise=rng.standard_normal(latents.shape).astype(np.float32),
        sigmas=np.array([0.3, 0.7], np.float32),
        weights=weights,
        context=rng.standard_normal((2, 8, 32)).astype(np.float32),
        items=["a.png", "b.png"],
    )


def snapshot(backend) -> dict[str, np.ndarray]:
    tensors, meta = backend.optimizer_state()
    out = {f"optim.{k}": np.array(v) for k, v in tensors.items()}
    out.update({f"optim.{k}": np.array(v) for k, v in meta.get("scalars", {}).items()})
    out.update({f"ema.{k}": np.array(v) for k, v in backend.ema_state().items()})
    for path, w in backend.lora_state().items():
        out[f"{path}.A"], out[f"{path}.B"] = w.A, w.B
    return out


def setup_backend(kind: str, make_model, make_config):
    cfg = make_config(ema=True, ema_decay=0.9, max_grad_norm=1.0, backend="mlx" if kind.startswith("mlx") else "torch")
    if kind.startswith("mlx"):
        from trainer.backends.mlx_backend.backend import MlxBackend

        backend = MlxBackend()
        backend.compile_step = kind == "mlx-compiled"
    else:
        backend = TorchBackend()
    backend.setup(model_for(cfg.backend, make_model), cfg, get_arch("demo"))
    if kind == "torch-fused":  # the CUDA default (fused AdamW), run on the CPU's fused kernel
        backend.optimizer = torch.optim.AdamW(list(backend.params.values()), lr=1e-3, fused=True)
    return backend


KINDS = ["torch", "torch-fused", *(pytest.param(k, marks=BACKENDS[1].marks) for k in ("mlx-eager", "mlx-compiled"))]


@pytest.mark.parametrize("poison", ["nan_latent", "inf_weight"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_non_finite_step_changes_nothing(kind, poison, make_model, make_config, monkeypatch):
    backend = setup_backend(kind, make_model, make_config)
    try:
        for seed in (0, 1):  # two good steps: moments, step count and EMA all non-trivial
            assert backend.scalars([backend.step([batch(seed=seed)], 1e-3).finite]) == [1.0]
            backend.update_ema()
        before = snapshot(backend)
        reads = []
        if kind == "torch-fused":  # the fused path must not read the flag on the host
            real_item = torch.Tensor.item
            monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(t) or real_item(t))
        stats = backend.step([batch(poison, seed=2)], 1e-3)
        backend.update_ema()
        monkeypatch.undo()
        assert reads == []
        loss, finite = backend.scalars([stats.loss, stats.finite])
        assert finite == 0.0 and not np.isfinite(loss)
        after = snapshot(backend)
        assert set(after) == set(before)
        for key in before:
            assert np.array_equal(before[key], after[key]), key
        backend.step([batch(seed=3)], 1e-3)  # a good step after it trains again
        backend.update_ema()
        moved = snapshot(backend)
        assert any(not np.array_equal(before[k], moved[k]) for k in before if ".B" in k or "ema." in k)
    finally:
        backend.teardown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_skipped_steps_name_their_images_and_resume_exactly(
    backend, tmp_path, make_model, make_data, make_config, eager_mlx
):
    """One image's latent is NaN: every batch holding it is skipped and names it; the rest trains; a run
    stopped at step 5 and resumed equals the uninterrupted one bit for bit, skip records included."""
    cfg = make_config(backend=backend, steps=10, checkpoint_every=3, log_every=4, ema=True, ema_decay=0.9)

    def run(name, stop_at=None, resume=False):
        reports = []
        result = train(
            cfg,
            model_for(backend, make_model),
            Poisoned(make_data(count=8), items={1}),
            run_dir=tmp_path / name,
            on_step=reports.append,
            resume=tmp_path / name if resume else None,
            should_stop=(lambda: len(reports) >= stop_at) if stop_at else None,
        )
        return result, reports

    straight, reports = run("straight")
    skipped = straight.history.skipped
    assert skipped and all("img_1.png" in entry["items"] for entry in skipped)
    assert [i + 1 for i, v in enumerate(straight.history.loss) if not np.isfinite(v)] == [e["step"] for e in skipped]
    assert reports[-1].skipped_steps == len(skipped) and all(r.loss is None or np.isfinite(r.loss) for r in reports)
    assert all(np.isfinite(w.B).all() and np.isfinite(w.A).all() for w in straight.lora.values())
    run("stopped", stop_at=5)
    resumed, _ = run("stopped", resume=True)
    assert_bitwise_resume(straight, resumed)
    assert resumed.history.skipped == skipped
    assert state.checkpoint_history(state.load_checkpoint(resumed.checkpoint)).skipped == skipped


@pytest.mark.parametrize("log_every,stops_at", [(1, 7), (4, 8)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_three_bad_steps_in_a_row_stop_with_a_resumable_checkpoint(
    backend, log_every, stops_at, tmp_path, make_model, make_data, make_config, eager_mlx
):
    """From step 5 every latent is NaN. Read every step, the run stops at step 7 (5, 6, 7 skipped); read
    every 4 steps (no host sync in between), at the read after the third (step 8). The checkpoint holds the
    weights of step 4 exactly, and a resume with the data fixed trains on to the end."""
    cfg = make_config(backend=backend, steps=10, checkpoint_every=4, log_every=log_every, ema=True, ema_decay=0.9)
    data = Poisoned(make_data(count=8))

    def on_step(report):
        data.on = report.step >= 4

    with pytest.raises(faults.NonFiniteLoss) as caught:
        train(cfg, model_for(backend, make_model), data, run_dir=tmp_path, on_step=on_step)
    message = str(caught.value)
    assert f"steps 5–{stops_at}" in message and "img_" in message and "learning_rate" in message
    assert f"step-{stops_at:06d}" in message and "resumable" in message
    stopped = state.load_checkpoint(tmp_path)
    assert stopped.step == stops_at and len(stopped.info["history"]["skipped"]) == stops_at - 4
    good = state.load_checkpoint(tmp_path / "step-000004")
    for key, value in good.tensors.items():
        if not key.startswith("rng."):
            assert np.array_equal(value, stopped.tensors[key]), key
    data.on = False
    resumed = train(cfg, model_for(backend, make_model), data, run_dir=tmp_path, resume=tmp_path)
    assert resumed.step == 10 and not resumed.stopped and len(resumed.history.skipped) == stops_at - 4


def _oom_forward(backend: str, fail_at: int, error: BaseException):
    calls = {"n": 0}

    def forward(model, x_t, sigmas, context, extras):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise error
        return model(x_t, sigmas, context, **extras)

    return forward


@pytest.mark.parametrize(
    "backend,error",
    [
        ("torch", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")),
        pytest.param(
            "mlx", RuntimeError("[metal::malloc] Attempting to allocate 9663676416 bytes"), marks=BACKENDS[1].marks
        ),
    ],
)
def test_out_of_memory_saves_the_last_good_step_and_names_the_fixes(
    backend, error, tmp_path, make_model, make_data, make_config, eager_mlx
):
    """A step fails with OOM at step 4: the checkpoint is step 3 exactly (draws put back), the message
    names what to change, the model is restored, and resuming equals a run that never failed."""
    cfg = make_config(
        backend=backend,
        steps=6,
        caption_dropout=0.3,
        lora_dropout=0.1 if backend == "torch" else 0.0,
        ema=True,
        ema_decay=0.9,
        log_every=2,
    )
    model = model_for(backend, make_model)
    flags = [p.requires_grad for p in model.parameters()] if backend == "torch" else None
    with pytest.raises(faults.OutOfMemory) as caught:
        train(cfg, model, make_data(), run_dir=tmp_path / "oom", forward=_oom_forward(backend, 4, error))
    message = str(caught.value)
    assert "out of memory at step 4" in message and "step-000003" in message and "img_" in message
    assert "resolutions" in message and "gradient_checkpointing" in message
    assert ("fp8" in message) if backend == "torch" else ("base_quantize" in message)
    assert caught.value.__cause__ is error
    if backend == "torch":
        assert all("forward" not in m.__dict__ for m in model.modules())  # LoRA gone with the run
        assert [p.requires_grad for p in model.parameters()] == flags and all(
            p.grad is None for p in model.parameters()
        )
    resumed = train(cfg, model_for(backend, make_model), make_data(), run_dir=tmp_path / "oom", resume=tmp_path / "oom")
    straight = train(cfg, model_for(backend, make_model), make_data(), run_dir=tmp_path / "straight")
    assert_bitwise_resume(straight, resumed)


def test_out_of_memory_names_the_speed_settings_that_hold_memory_first():
    """A set checkpoint_budget, kept blocks, fp8 copies or recorded graphs cost memory for speed alone: the message
    names them before the fixes that change what trains; at the defaults (auto: fits what is free, steps back
    on its own) it names none of them."""
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    fast = config_module.from_dict(
        {
            "arch": "zimage",
            "compile_blocks": True,
            "checkpoint_budget": 0.7,
            "skip_checkpoint_blocks": 3,
            "fp8_compute": True,
            "step_graphs": True,
        }
    )
    message = faults.out_of_memory_message(fast, error, 4, ["a.png"], None)
    fixes = message.split("To fit: ")[1]
    order = [
        fixes.index(text)
        for text in (
            "checkpoint_budget (now 0.7",
            "skip_checkpoint_blocks to 0 (now 3",
            "fp8_compute to auto or off",
            "step_graphs to auto or off",
            "lower resolutions",
        )
    ]
    assert order == sorted(order)
    graphs = config_module.from_dict(
        {"arch": "zimage", "compile_blocks": True, "cuda_graphs": True, "step_graphs": False}
    )
    assert "turn cuda_graphs off" in faults.out_of_memory_message(graphs, error, 4, [], None)
    plain = faults.out_of_memory_message(config_module.from_dict({"arch": "zimage"}), RuntimeError(""), 4, [], None)
    assert not any(
        name in plain
        for name in ("checkpoint_budget", "skip_checkpoint_blocks", "fp8_compute", "step_graphs", "cuda_graphs")
    )
    assert "step 5 (batch: (unnamed)): RuntimeError." in plain  # an empty message names the error's type


def test_out_of_memory_on_the_first_step_saves_nothing_and_sampling_oom_keeps_the_step(
    tmp_path, make_model, make_data, make_config
):
    oom = torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(faults.OutOfMemory, match="nothing new to save"):
        train(
            make_config(steps=3),
            make_model(),
            make_data(),
            run_dir=tmp_path / "first",
            forward=_oom_forward("torch", 1, oom),
        )
    assert state.list_checkpoints(tmp_path / "first") == []

    def validate(step, lora):
        raise torch.OutOfMemoryError("CUDA out of memory (sampling)")

    with pytest.raises(faults.OutOfMemory, match="lower width/height"):
        train(
            make_config(steps=4),
            make_model(),
            make_data(),
            run_dir=tmp_path / "val",
            validate=validate,
            validate_every=2,
        )
    assert state.load_checkpoint(tmp_path / "val").step == 2


def test_what_counts_as_out_of_memory():
    assert faults.is_out_of_memory(torch.OutOfMemoryError("x")) and faults.is_out_of_memory(MemoryError())
    assert faults.is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert faults.is_out_of_memory(RuntimeError("[METAL] Command buffer execution failed: Insufficient Memory"))
    assert not faults.is_out_of_memory(RuntimeError("shape mismatch")) and not faults.is_out_of_memory(
        ValueError("out of memory")
    )


# ---------------------------------------------------------------- the loop's fault pieces, alone


class RngBackend:
    """Only what faults.Draws asks of a backend: an RNG state out and in."""

    def __init__(self):
        self.key = np.arange(4, dtype=np.uint32)

    def rng_state(self):
        return {"key": self.key.copy()}

    def load_rng_state(self, tensors):
        self.key = tensors["key"].copy()


def _draws():
    from trainer.data.sampler import BucketSampler

    rng, sampler, backend = np.random.default_rng(0), BucketSampler({"64x64": [0, 1, 2, 3]}, 1, seed=0), RngBackend()
    return rng, sampler, backend, faults.Draws(rng, sampler, backend)


class Activations:
    """What a failed step's frames hold on to."""


def _failing_step(error):
    """A step that raises `error`, and weak references to the activations its frame held."""
    held = []

    def step():
        activations = Activations()
        held.append(weakref.ref(activations))
        raise error

    return step, held


def test_out_of_memory_puts_the_draws_back_saves_the_last_good_step_and_lets_the_frames_go(make_config):
    rng, sampler, backend, draws = _draws()
    expected = (rng.random(), sampler.next(), backend.key.copy())
    rng.random(), sampler.next()  # the failed step's draws
    backend.key += 1
    saved, error = [], torch.OutOfMemoryError("CUDA out of memory")
    step, held = _failing_step(error)

    def save(done):
        saved.append(done)
        return Path(f"step-{done:06d}")

    with (
        pytest.raises(faults.OutOfMemory, match="out of memory at step 8 .*step-000007") as caught,
        faults.out_of_memory_rewinds(make_config(), 7, ["a.png"], draws, save),
    ):
        step()
    assert caught.value.__cause__ is error and saved == [7]
    assert held[0]() is None  # traceback.clear_frames: activations freed
    assert (rng.random(), sampler.next()) == expected[:2] and np.array_equal(backend.key, expected[2])
    with (
        pytest.raises(faults.OutOfMemory, match="nothing new to save"),
        faults.out_of_memory_rewinds(make_config(), 0, [], draws, None),
    ):
        raise MemoryError


def test_other_errors_pass_the_out_of_memory_rewind_untouched(make_config):
    rng, _, _, draws = _draws()
    rng.random()
    after = rng.bit_generator.state
    error = ValueError("shape mismatch")
    with (
        pytest.raises(ValueError) as caught,
        faults.out_of_memory_rewinds(make_config(), 3, [], draws, lambda s: pytest.fail("saved")),
    ):
        raise error
    assert caught.value is error and rng.bit_generator.state == after  # no rewind, no save


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("stop pressed")])
def test_an_error_in_on_step_saves_that_step_then_goes_on(error):
    saved = []
    with pytest.raises(type(error)) as caught, faults.saves_on_error(saved.append, 5):
        raise error
    assert caught.value is error and saved == [5]
    with faults.saves_on_error(saved.append, 6):
        pass
    assert saved == [5]  # no error: nothing saved


def test_validation_errors_save_the_step_and_out_of_memory_names_the_validation_settings():
    events = []

    def save(step):
        events.append(("saved", step))

    error = torch.OutOfMemoryError("CUDA out of memory (sampling)")
    with (
        pytest.raises(faults.OutOfMemory, match="validation images at step 4.*lower width/height") as caught,
        faults.validation_saves_on_error(save, 4),
    ):
        raise error
    assert caught.value.__cause__ is error and events == [("saved", 4)]
    stop = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt) as caught, faults.validation_saves_on_error(save, 6):
        raise stop
    assert caught.value is stop and events[-1] == ("saved", 6)
