"""The loop's pieces: batches, objective settings, reports, metadata."""
from __future__ import annotations

import numpy as np

from trainer import objective
from trainer.archs import get_arch
from trainer.loop import build_batch, objective_settings, train


def test_batch_is_one_bucket_with_caption_dropout_from_the_empty_embedding(make_data, make_config):
    data = make_data()
    settings = objective_settings(make_config(), get_arch("demo"))
    batch = build_batch(data, [0, 2, 4], np.random.default_rng(0), settings, get_arch("demo"), caption_dropout=1.0)
    assert batch.latents.shape == (3, 16, 4, 4) and batch.noise.shape == batch.latents.shape
    assert np.array_equal(batch.context, np.zeros((3, 8, 32), np.float32))   # all dropped → empty caption
    kept = build_batch(data, [0], np.random.default_rng(0), settings, get_arch("demo"), caption_dropout=0.0)
    assert np.array_equal(kept.context[0], data.context(0))
    assert kept.items == ["img_0.png"]


def test_flux2_batches_are_left_padded_to_512_and_dev_gets_guidance(make_data):
    data = make_data()
    settings = objective.ObjectiveSettings()
    dev = build_batch(data, [0], np.random.default_rng(0), settings, get_arch("flux2_dev"), 0.0)
    assert dev.context.shape == (1, 512, 32)
    assert np.array_equal(dev.context[0, -8:], data.context(0)) and not dev.context[0, :504].any()
    assert np.array_equal(dev.extras["guidance"], np.ones(1, np.float32))
    klein = build_batch(data, [0], np.random.default_rng(0), settings, get_arch("flux2_klein"), 0.0)
    assert "guidance" not in klein.extras
    zimage = build_batch(data, [0], np.random.default_rng(0), settings, get_arch("zimage"), 0.0)
    assert zimage.extras == {"num_tokens": 8} and zimage.context.shape == (1, 8, 32)


def test_auto_shift_follows_the_arch(make_config):
    cfg = make_config()
    assert objective_settings(cfg, get_arch("zimage")).shift_mode == "static"
    assert objective_settings(cfg, get_arch("zimage")).shift == 3.0
    assert objective_settings(cfg, get_arch("flux2_klein")).shift_mode == "resolution"
    assert objective_settings(make_config(shift_mode="static", shift=2.0), get_arch("zimage")).shift == 2.0


def test_reports_every_step_with_loss_when_logged(tmp_path, make_model, make_data, make_config):
    reports = []
    result = train(make_config(steps=6, log_every=3), make_model(), make_data(), run_dir=tmp_path / "r",
                   on_step=reports.append)
    assert [r.step for r in reports] == list(range(1, 7))
    assert [r.loss is not None for r in reports] == [False, False, True, False, False, True]
    assert reports[-1].eta_s == 0.0 and reports[0].it_per_s > 0
    assert len(result.history.loss) == 6 and all(np.isfinite(result.history.loss))
    assert result.trainable_parameters > 0 and result.ema_lora is None


def test_validate_runs_every_n_with_ema_weights(make_model, make_data, make_config, tmp_path):
    """validate() sees the EMA weights: its output equals the base model with the EMA LoRA merged by hand."""
    import torch

    from trainer.loop import train

    torch.manual_seed(0)
    x, sigma, ctx = torch.randn(1, 16, 4, 4), torch.tensor([0.5]), torch.randn(1, 8, 32)
    model, outputs = make_model(), {}

    def validate(step):
        with torch.no_grad():
            outputs[step] = model(x, sigma, ctx)

    cfg = make_config(steps=6, ema=True, ema_decay=0.5, checkpoint_every=0)
    result = train(cfg, model, make_data(), run_dir=tmp_path, validate=validate, validate_every=4)
    assert sorted(outputs) == [4, 6]

    def merged(lora):
        base = make_model()
        layers = dict(base.named_modules())
        with torch.no_grad():
            for path, w in lora.items():
                layers[path].weight += torch.from_numpy(w.B @ w.A) * (w.alpha / w.A.shape[0])
            return base(x, sigma, ctx)

    torch.testing.assert_close(outputs[6], merged(result.ema_lora), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(outputs[6], merged(result.lora), atol=1e-5)
