"""Masked and edit training on the tiny DiT: the masked loss and its gradient against their closed forms
(PyTorch and MLX), control latents reaching the model, exact resume, and the refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from trainer.archs import ARCHS, get_arch
from trainer.backends.base import Batch
from trainer.backends.torch_backend.backend import TorchBackend, default_forward
from trainer.config import ConfigError
from trainer.data import companion_batch
from trainer.run.loop import train

from helpers.tiny_runs import companion_data
from helpers.resume import assert_bitwise_resume


def masked_batch(unmasked_weight, batch_size=2, seed=0) -> tuple[Batch, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (batch_size, 16, 4, 6)
    mask = (rng.random((batch_size, 1, 4, 6)) > 0.5).astype(np.float32)
    mask[0, 0, 0, :3] = [0.25, 0.5, 0.75]  # grey levels too
    batch = Batch(
        latents=rng.standard_normal(shape).astype(np.float32),
        noise=rng.standard_normal(shape).astype(np.float32),
        sigmas=rng.uniform(0.2, 0.8, batch_size).astype(np.float32),
        weights=rng.uniform(0.5, 1.5, batch_size).astype(np.float32),
        context=rng.standard_normal((batch_size, 8, 32)).astype(np.float32),
        mask=companion_batch.mask_weights(list(mask), shape, unmasked_weight),
    )
    return batch, mask


def test_mask_weights_clamp_to_the_floor_and_fill_unmasked_rows():
    masks = [np.array([[[0.0, 0.05, 0.5, 1.0]]], np.float32), None]
    weights = companion_batch.mask_weights(masks, (2, 16, 1, 4), 0.1)
    np.testing.assert_array_equal(weights[0, 0, 0], np.array([0.1, 0.1, 0.5, 1.0], np.float32))
    np.testing.assert_array_equal(weights[1], np.ones((1, 1, 4), np.float32))
    assert companion_batch.mask_weights([None, None], (2, 16, 1, 4), 0.1) is None
    with pytest.raises(ValueError, match="Encode Images again"):
        companion_batch.mask_weights([np.ones((1, 2, 2))], (1, 16, 1, 4), 0.1)


@pytest.mark.parametrize("unmasked_weight", [0.0, 0.1])
def test_masked_loss_and_its_gradient_equal_the_closed_form(make_model, make_config, unmasked_weight):
    batch, mask = masked_batch(unmasked_weight)
    outputs = []

    def forward(model, x_t, sigmas, context, extras):
        out = default_forward(model, x_t, sigmas, context, extras)
        out.retain_grad()
        outputs.append(out)
        return out

    backend = TorchBackend()
    backend.setup(make_model(), make_config(unmasked_weight=unmasked_weight), get_arch("demo"), forward=forward)
    stats = backend.step([batch], 1e-3)
    loss = backend.scalars([stats.loss])[0]
    prediction, gradient = outputs[0].detach().double().numpy(), outputs[0].grad.double().numpy()
    target = (batch.noise - batch.latents).astype(np.float64)
    w = np.clip(mask, unmasked_weight, 1.0)  # [B,1,H,W]
    per_sample = (w * (prediction - target) ** 2).reshape(2, -1).mean(axis=1)
    assert loss == pytest.approx(float((per_sample * batch.weights).mean()), rel=1e-5)
    cells = prediction[0].size
    expected = 2 * w * (prediction - target) * batch.weights.reshape(-1, 1, 1, 1) / (cells * 2)
    np.testing.assert_allclose(gradient, expected, rtol=1e-4, atol=1e-10)
    black = np.broadcast_to(mask == 0, gradient.shape)
    if unmasked_weight == 0:
        assert np.all(gradient[black] == 0)  # a black region teaches nothing
    else:
        assert np.all(np.abs(gradient[black]) > 0)  # ... but trains at the floor


def test_a_full_mask_equals_the_unmasked_loss(make_model, make_config):
    batch, _ = masked_batch(0.1)
    losses = []
    for mask in (np.ones_like(batch.mask), None):
        backend = TorchBackend()
        backend.setup(make_model(), make_config(), get_arch("demo"))
        losses.append(backend.scalars([backend.step([dataclasses.replace(batch, mask=mask)], 1e-3).loss])[0])
    assert losses[0] == losses[1]


def test_mlx_masked_loss_equals_torch(make_model, make_config):
    pytest.importorskip("mlx.core")
    from trainer.backends.mlx_backend.backend import MlxBackend
    from trainer.backends.mlx_backend.models.tiny import demo_model

    batch, _ = masked_batch(0.1)
    losses = {}
    for masked in (batch, dataclasses.replace(batch, mask=None)):
        torch_backend, mlx_backend = TorchBackend(), MlxBackend()
        mlx_backend.compile_step = False  # eager: no g++ kernel builds on CPU
        torch_backend.setup(make_model(), make_config(), get_arch("demo"))
        mlx_backend.setup(
            demo_model(0, hidden=32, heads=2, double_blocks=1, single_blocks=1, in_channels=16, context_dim=32),
            make_config(backend="mlx"),
            get_arch("demo"),
        )
        losses[masked.mask is None] = [
            b.scalars([b.step([masked], 1e-3).loss])[0] for b in (torch_backend, mlx_backend)
        ]
    assert losses[False][1] == pytest.approx(losses[False][0], rel=1e-5)
    assert losses[True][1] == pytest.approx(losses[True][0], rel=1e-5)
    assert losses[False][0] != pytest.approx(losses[True][0], rel=1e-3)  # the mask mattered


# ---------------------------------------------------------------- through the loop


def referencing_forward(seen):
    """The demo model with reference latents added into its input (as a stand-in for Flux2's extra tokens)."""

    def forward(model, x_t, sigmas, context, extras):
        extras = dict(extras)
        references = extras.pop("reference_latents", [])
        seen.append(len(references))
        for reference in references:
            x_t = x_t + 0.5 * reference.to(x_t.dtype)
        return model(x_t, sigmas, context, **extras)

    return forward


@pytest.fixture
def edit_arch(monkeypatch):
    monkeypatch.setitem(ARCHS, "demo", dataclasses.replace(ARCHS["demo"], reference_latents="reference_latents"))


@pytest.mark.parametrize("kind", ["masks", "controls"])
def test_resume_is_bitwise_with_masks_and_controls(tmp_path, make_model, make_config, kind, request):
    if kind == "controls":
        request.getfixturevalue("edit_arch")
    cfg = make_config(steps=6, checkpoint_every=3, caption_dropout=0.3, ema=True, grad_accum=2, log_every=3)
    data = (
        (lambda: companion_data(masks=True))
        if kind == "masks"
        else (lambda: companion_data(masks=False, controls=True))
    )
    seen = []
    forward = referencing_forward(seen)

    def run(name, stop_at=None, resume=False):
        progress = []
        stop = (lambda: len(progress) >= stop_at) if stop_at else None
        return train(
            cfg,
            make_model(),
            data(),
            run_dir=tmp_path / name,
            forward=forward,
            resume=tmp_path / name if resume else None,
            on_step=progress.append,
            should_stop=stop,
        )

    straight = run("straight")
    assert run("stopped", stop_at=4).stopped
    resumed = run("stopped", resume=True)
    assert_bitwise_resume(straight, resumed)
    assert straight.history.loss == resumed.history.loss
    assert set(seen) == ({1} if kind == "controls" else {0})  # every call had its control (or none)
    plain = train(cfg, make_model(), companion_data(masks=False), run_dir=tmp_path / "plain", forward=forward)
    assert plain.history.loss != straight.history.loss  # masks / controls changed the training


def test_controls_change_the_prediction_they_feed(tmp_path, make_model, make_config, edit_arch):
    cfg = make_config(steps=2, log_every=1)
    a = train(
        cfg, make_model(), companion_data(False, True, seed=0), run_dir=tmp_path / "a", forward=referencing_forward([])
    )
    data = companion_data(False, True, seed=0)
    data.control_latents = [[c[0] * 0] for c in data.control_latents]
    b = train(cfg, make_model(), data, run_dir=tmp_path / "b", forward=referencing_forward([]))
    assert a.history.loss[0] != b.history.loss[0]


def test_a_family_without_reference_latents_refuses_an_edit_dataset(tmp_path, make_model, make_config):
    with pytest.raises(ConfigError, match="demo cannot train on control images.*control/"):
        train(make_config(steps=1), make_model(), companion_data(False, True), run_dir=tmp_path / "r")


def test_flux2_and_qwen_image_take_reference_latents_as_comfyui_does():
    for name in ("flux2_klein", "flux2_dev", "qwen_image"):  # Qwen-Image-Edit 2509/2511 load as qwen_image
        assert get_arch(name).reference_latents == "reference_latents"
    assert get_arch("zimage").reference_latents == ""
    extras = companion_batch.reference_extras(
        [[np.ones((2, 2, 2))], [np.zeros((2, 2, 2))]], get_arch("flux2_klein"), ["a", "b"]
    )
    assert list(extras) == ["reference_latents"] and extras["reference_latents"][0].shape == (2, 2, 2, 2)
    with pytest.raises(ValueError, match="same control folders"):
        companion_batch.reference_extras([[np.ones(1)], [np.ones(1), np.ones(1)]], get_arch("flux2_klein"), ["a", "b"])


def test_estimate_counts_the_reference_images_tokens(tmp_path):
    from trainer.data.companions import reference_count
    from trainer.estimate.torch_step import estimate

    plain, edit = (estimate("flux2-klein-4b", resolution=512, reference_images=n) for n in (0, 2))
    assert edit.tokens - plain.tokens == 2 * 32 * 32  # two more 512 px images of 16 px tokens
    assert edit.activations > plain.activations and edit.weights == plain.weights
    assert "(2 reference images included)" in edit.notes[0]
    for folder in ("control", "control_2", "controls", "photos"):
        (tmp_path / folder).mkdir()
    assert reference_count(tmp_path) == 2 and reference_count("") == 0
