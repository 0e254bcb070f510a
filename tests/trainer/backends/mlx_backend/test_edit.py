"""Edit training on the MLX backend: the Flux2 port with reference latents against ComfyUI's golden
(1 and 2 references), the backend's steps against torch's with references, a compiled step fed batches
with and without references, and an MLX edit run stopped and resumed bitwise."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
torch = pytest.importorskip("torch")

from trainer import safetensors_io
from trainer.archs import ARCHS, get_arch
from trainer.backends.base import Batch
from trainer.backends.mlx_backend.backend import MlxBackend
from trainer.backends.mlx_backend.models import build
from trainer.backends.mlx_backend.models.flux2 import rope_tables
from trainer.backends.mlx_backend.models.tiny import demo_model
from trainer.demo import tiny_weights
from trainer.run.loop import train

from helpers.resume import assert_bitwise_resume
from helpers.tiny_runs import companion_data

GOLDEN = Path(__file__).resolve().parents[3] / "goldens" / "flux2_klein_edit.safetensors"
TOLERANCE = 1e-4  # max |MLX − ComfyUI| / max |ComfyUI|, both float32 (as test_flux2.py)
TINY_SIZES = {
    "hidden": 32,
    "heads": 2,
    "double_blocks": 1,
    "single_blocks": 1,
    "in_channels": 16,
    "context_dim": 32,
}  # conftest's tiny DiT


@pytest.fixture
def edit_arch(monkeypatch):
    """The demo arch with Flux2's reference-latent extra, so the loop hands control latents to the model."""
    monkeypatch.setitem(ARCHS, "demo", dataclasses.replace(ARCHS["demo"], reference_latents="reference_latents"))


def read_golden() -> tuple[dict[str, np.ndarray], object]:
    """The golden's tensors and the MLX Flux2 (float32) built from the seeded weights it was made from."""
    tensors, metadata = safetensors_io.read(GOLDEN)
    spec = json.loads(metadata["kiln.weights"])
    weights = getattr(tiny_weights, spec["function"])(spec["seed"], **spec["kwargs"])
    return tensors, build("flux2_klein", weights, dtype="float32")


def relative_error(out: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(out - expected).max() / np.abs(expected).max())


def tiny_flux2(seed: int = 0):
    """The MLX Flux2 port at the demo data's sizes (16 latent channels, 32-wide context), float32."""
    weights = tiny_weights.flux2_weights(seed, hidden=128, double=1, single=1, context_dim=32, in_channels=16)
    return build("flux2_klein", weights, dtype="float32")


# ---------------------------------------------------------------- the forward against ComfyUI


@pytest.mark.parametrize("count", [1, 2])
def test_edit_forward_matches_comfyui_golden(count):
    """scripts/make_goldens.py flux2_klein_edit: ComfyUI's Flux2 with ref_latents (index method, scale 10);
    the second reference is 3×5 beside the 4×6 target, so its own position grid is checked too."""
    golden, model = read_golden()
    references = [golden[f"reference_{i}"] for i in range(count)]
    out = np.array(model(golden["x"], golden["timestep"], golden["context"], reference_latents=references))
    assert out.shape == golden["x"].shape  # the target's tokens only
    assert relative_error(out, golden[f"output_{count}"]) <= TOLERANCE
    plain = np.array(model(golden["x"], golden["timestep"], golden["context"]))
    assert relative_error(plain, golden[f"output_{count}"]) > 100 * TOLERANCE  # the references mattered


def test_reference_positions_are_comfyuis_ids():
    """Text (0,0,0,t), target (0,r,c,0), reference i (10·i,r,c,0): the angles of axis 0 give the index."""
    cos, _ = rope_tables(((2, 3, 0.0), (2, 2, 10.0), (1, 2, 20.0)), 4)
    assert cos.shape == (1, 1, 4 + 6 + 4 + 2, 64)
    axis0 = np.array(cos)[0, 0, :, 0]  # cos(index · omega_0), omega_0 = 1
    np.testing.assert_allclose(axis0, np.cos([0.0] * 10 + [10.0] * 4 + [20.0] * 2).astype(np.float32))


def test_a_reference_of_batch_one_serves_every_row():
    golden, model = read_golden()
    first = golden["reference_0"][:1]
    shared = np.array(model(golden["x"], golden["timestep"], golden["context"], reference_latents=[first]))
    repeated = np.array(
        model(golden["x"], golden["timestep"], golden["context"], reference_latents=[np.repeat(first, 2, axis=0)])
    )
    np.testing.assert_array_equal(shared, repeated)
    with pytest.raises(ValueError, match="reference latent of batch 3 for a batch of 2"):
        model(golden["x"], golden["timestep"], golden["context"], reference_latents=[np.zeros((3, 128, 2, 2))])


# ---------------------------------------------------------------- the backend's steps


def referencing(add):
    """The demo model with each reference latent added into its input, on either backend (a stand-in for
    Flux2's reference tokens that both backends' demo models can run)."""

    def forward(model, x_t, sigmas, context, extras):
        extras = dict(extras)
        for reference in extras.pop("reference_latents", []):
            x_t = add(x_t, reference)
        return model(x_t, sigmas, context, **extras)

    return forward


def test_edit_training_steps_match_torch(tmp_path, make_model, make_config, edit_arch, monkeypatch):
    """The loop on an edit dataset (one control per target), torch and MLX: the references travel through
    the MLX step as its inputs and give torch's losses and weights step for step."""
    monkeypatch.setattr(MlxBackend, "compile_step", False)  # eager: no g++ kernel builds on CPU
    forwards = {
        "torch": referencing(lambda x, r: x + 0.5 * r.to(x.dtype)),
        "mlx": referencing(lambda x, r: x + 0.5 * r.astype(x.dtype)),
    }
    results = {}
    for name, model in (("torch", make_model()), ("mlx", demo_model(0, **TINY_SIZES))):
        cfg = make_config(backend=name, steps=6, grad_accum=2, max_grad_norm=0.01)
        results[name] = train(
            cfg, model, companion_data(masks=False, controls=True), run_dir=tmp_path / name, forward=forwards[name]
        )
    ref, ours = results["torch"], results["mlx"]
    np.testing.assert_allclose(ours.history.loss, ref.history.loss, rtol=1e-3)
    for path, weights in ref.lora.items():
        np.testing.assert_allclose(ours.lora[path].B, weights.B, atol=1e-5)
    plain = train(
        make_config(backend="mlx", steps=6, grad_accum=2, max_grad_norm=0.01),
        demo_model(0, **TINY_SIZES),
        companion_data(masks=False),
        run_dir=tmp_path / "plain",
        forward=forwards["mlx"],
    )
    assert plain.history.loss != ours.history.loss  # the controls were trained on


def edit_batch(references: int, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    shape = (2, 16, 4, 6)
    controls = [[rng.standard_normal(shape[1:]).astype(np.float32) for _ in range(references)] for _ in range(2)]
    extras = (
        {"reference_latents": [np.stack([c[i] for c in controls]) for i in range(references)]} if references else {}
    )
    return Batch(
        latents=rng.standard_normal(shape).astype(np.float32),
        noise=rng.standard_normal(shape).astype(np.float32),
        sigmas=rng.uniform(0.2, 0.8, 2).astype(np.float32),
        weights=np.ones(2, np.float32),
        context=rng.standard_normal((2, 8, 32)).astype(np.float32),
        extras=extras,
    )


def test_compiled_step_takes_batches_with_and_without_references(make_config):
    """One compiled graph per reference count (the references' shapes are in the step's signature), each
    equal to the eager step: a batch without references after one with them neither breaks nor reuses it."""
    batches = [edit_batch(1, 0), edit_batch(0, 1), edit_batch(2, 2), edit_batch(1, 3)]
    runs = {}
    for compiled in (True, False):
        backend = MlxBackend()
        backend.compile_step = compiled
        backend.setup(tiny_flux2(), make_config(backend="mlx", max_grad_norm=0.01), get_arch("flux2_klein"))
        runs[compiled] = (
            [backend.scalars([backend.step([batch], 1e-3).loss])[0] for batch in batches],
            backend.lora_state(),
            len(backend.compiled),
        )
        backend.teardown()
    (losses, lora, graphs), (eager_losses, eager_lora, _) = runs[True], runs[False]
    assert graphs == 3  # 1, 0 and 2 references
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-6)
    for path, weights in lora.items():
        np.testing.assert_allclose(weights.B, eager_lora[path].B, atol=1e-7)
    assert len(set(losses)) == len(losses)


def test_mlx_edit_run_resumes_bitwise(tmp_path, make_config, edit_arch):
    """The MLX Flux2 port, compiled and checkpointed, on an edit dataset with everything random on: stopped after 3
    steps and resumed, its state equals an uninterrupted run's bit for bit."""
    cfg = make_config(
        backend="mlx",
        steps=6,
        checkpoint_every=3,
        caption_dropout=0.3,
        lora_dropout=0.1,
        ema=True,
        ema_decay=0.9,
        grad_accum=2,
        max_grad_norm=0.01,
        log_every=3,
        gradient_checkpointing=True,
    )
    seen = []

    def forward(model, x_t, sigmas, context, extras):
        seen.append(len(extras.get("reference_latents", [])))
        return model(x_t, sigmas, context, **extras)

    def run(name, stop_at=None, resume=False):
        steps = []
        return train(
            cfg,
            tiny_flux2(),
            companion_data(masks=False, controls=True),
            run_dir=tmp_path / name,
            forward=forward,
            on_step=steps.append,
            resume=tmp_path / name if resume else None,
            should_stop=(lambda: len(steps) >= stop_at) if stop_at else None,
        )

    straight = run("straight")
    assert run("stopped", stop_at=3).stopped
    resumed = run("stopped", resume=True)
    assert "rng.mlx_key" in assert_bitwise_resume(straight, resumed, holds=("ema.",))
    assert straight.history.loss == resumed.history.loss
    assert set(seen) == {1}  # every trace had its reference


def test_held_out_loss_takes_the_references(make_config):
    """eval_loss (the held-out loss) hands the model the batch's references as the step does: equal to the
    flow-matching loss of the port's own forward with them, and unlike the loss without them."""
    backend = MlxBackend()
    backend.setup(tiny_flux2(), make_config(backend="mlx"), get_arch("flux2_klein"))
    try:
        batch = edit_batch(2, seed=5)
        x_t = (1 - batch.sigmas[:, None, None, None]) * batch.latents + batch.sigmas[:, None, None, None] * batch.noise
        prediction = np.array(
            backend.model(x_t, batch.sigmas, batch.context, reference_latents=batch.extras["reference_latents"])
        )
        per_sample = ((prediction - (batch.noise - batch.latents)) ** 2).reshape(2, -1).mean(axis=1)
        expected = float((per_sample * batch.weights).mean())
        assert backend.eval_loss([batch]) == pytest.approx(expected, rel=1e-5)
        assert backend.eval_loss([dataclasses.replace(batch, extras={})]) != pytest.approx(expected, rel=1e-3)
    finally:
        backend.teardown()
