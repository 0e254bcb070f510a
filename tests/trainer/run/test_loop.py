"""The loop's pieces: batches, objective settings, reports, metadata."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.archs import get_arch
from trainer.data import InMemoryData
from trainer.objective import flow as objective
from trainer.run.loop import build_batch, objective_settings, train


def test_batch_is_one_bucket_with_caption_dropout_from_the_empty_embedding(make_data, make_config):
    data = make_data()
    settings = objective_settings(make_config(), get_arch("demo"))
    batch = build_batch(data, [0, 2, 4], np.random.default_rng(0), settings, get_arch("demo"), caption_dropout=1.0)
    assert batch.latents.shape == (3, 16, 4, 4) and batch.noise.shape == batch.latents.shape
    assert np.array_equal(batch.context, np.zeros((3, 8, 32), np.float32))  # all dropped → empty caption
    kept = build_batch(data, [0], np.random.default_rng(0), settings, get_arch("demo"), caption_dropout=0.0)
    assert np.array_equal(kept.context[0], data.context(0))
    assert kept.items == ["img_0.png"]


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_flux2_batches_are_left_padded_to_512_and_dev_gets_guidance(batch_size):
    """Each row keeps its own caption and length: Flux2 left-pads to 512, Z-Image right-pads and counts."""
    lengths = [8, 5, 7][:batch_size]
    rng = np.random.default_rng(0)
    data = InMemoryData.from_arrays(
        [rng.standard_normal((16, 4, 4)).astype(np.float32) for _ in lengths],
        [rng.standard_normal((n, 32)).astype(np.float32) for n in lengths],
        [f"img_{i}.png" for i in range(batch_size)],
        np.zeros((8, 32), np.float32),
    )
    rows = list(range(batch_size))
    settings = objective.ObjectiveSettings()
    dev = build_batch(data, rows, np.random.default_rng(0), settings, get_arch("flux2_dev"), 0.0)
    assert dev.context.shape == (batch_size, 512, 32)
    for row, n in enumerate(lengths):
        assert np.array_equal(dev.context[row, -n:], data.context(row)), f"Flux2 row {row}: not its own caption"
        assert not dev.context[row, :-n].any(), f"Flux2 row {row}: the padding is not zeros in front"
    np.testing.assert_array_equal(
        dev.extras["guidance"], np.ones(batch_size, np.float32), err_msg="Flux2 Dev: guidance 1.0 for each row"
    )
    klein = build_batch(data, rows, np.random.default_rng(0), settings, get_arch("flux2_klein"), 0.0)
    assert "guidance" not in klein.extras
    zimage = build_batch(data, rows, np.random.default_rng(0), settings, get_arch("zimage"), 0.0)
    assert zimage.context.shape == (batch_size, max(lengths), 32) and list(zimage.extras) == ["num_tokens"]
    for row, n in enumerate(lengths):
        assert np.array_equal(zimage.context[row, :n], data.context(row)), f"Z-Image row {row}: not its own caption"
        assert not zimage.context[row, n:].any(), f"Z-Image row {row}: the padding is not zeros after it"
    np.testing.assert_array_equal(
        zimage.extras["num_tokens"], lengths, err_msg="Z-Image: num_tokens is each row's caption length"
    )


def test_auto_shift_follows_the_arch(make_config):
    cfg = make_config()
    assert objective_settings(cfg, get_arch("zimage")).shift_mode == "static"
    assert objective_settings(cfg, get_arch("zimage")).shift == 3.0
    assert objective_settings(cfg, get_arch("flux2_klein")).shift_mode == "resolution"
    assert objective_settings(make_config(shift_mode="static", shift=2.0), get_arch("zimage")).shift == 2.0


def test_reports_every_step_with_loss_when_logged(tmp_path, make_model, make_data, make_config):
    reports = []
    result = train(
        make_config(steps=6, log_every=3), make_model(), make_data(), run_dir=tmp_path / "r", on_step=reports.append
    )
    assert [r.step for r in reports] == list(range(1, 7))
    assert [r.loss is not None for r in reports] == [False, False, True, False, False, True]
    assert reports[-1].eta_s == 0.0 and reports[0].it_per_s > 0
    assert len(result.history.loss) == 6 and all(np.isfinite(result.history.loss))
    assert result.trainable_parameters > 0 and result.ema_lora is None


def test_validate_runs_every_n_with_ema_weights(make_model, make_data, make_config, tmp_path):
    """validate() sees the EMA weights: its output equals the base model with the EMA LoRA merged by hand."""
    import torch

    from trainer.run.loop import train

    torch.manual_seed(0)
    x, sigma, ctx = torch.randn(1, 16, 4, 4), torch.tensor([0.5]), torch.randn(1, 8, 32)
    model, outputs = make_model(), {}

    seen = {}

    def validate(step, lora):
        with torch.no_grad():
            outputs[step] = model(x, sigma, ctx)
        seen[step] = lora()

    cfg = make_config(steps=6, ema=True, ema_decay=0.5, checkpoint_every=0)
    result = train(cfg, model, make_data(), run_dir=tmp_path, validate=validate, validate_every=4)
    assert sorted(outputs) == [4, 6]
    for path, w in result.ema_lora.items():  # lora() hands a sampler the EMA weights too
        np.testing.assert_array_equal(seen[6][path].B, w.B)

    def merged(lora):
        base = make_model()
        layers = dict(base.named_modules())
        with torch.no_grad():
            for path, w in lora.items():
                layers[path].weight += torch.from_numpy(w.B @ w.A) * (w.alpha / w.A.shape[0])
            return base(x, sigma, ctx)

    torch.testing.assert_close(outputs[6], merged(result.ema_lora), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(outputs[6], merged(result.lora), atol=1e-5)


def test_batches_collate_rows_as_each_arch_needs():
    """Flux2 left-pads every row to 512 as ComfyUI pads one prompt; Z-Image right-pads and counts tokens."""
    from trainer.archs import get_arch

    rows = [np.ones((3, 4), np.float32), 2 * np.ones((5, 4), np.float32)]
    flux = get_arch("flux2_klein").collate_context(rows)
    assert flux.shape == (2, 512, 4)
    assert (flux[0, :509] == 0).all() and (flux[0, 509:] == 1).all() and (flux[1, 507:] == 2).all()
    zimage = get_arch("zimage").collate_context(rows)
    assert zimage.shape == (2, 5, 4) and (zimage[0, 3:] == 0).all()
    assert get_arch("zimage").model_extras(2, [3, 5])["num_tokens"].tolist() == [3, 5]
    assert get_arch("flux2_dev").model_extras(2, [3, 5])["guidance"].tolist() == [1.0, 1.0]
    full = [np.full((512, 4), 3, np.float32), np.full((512, 4), 4, np.float32)]  # nothing to pad
    one = get_arch("flux2_klein").collate_context(full[:1])
    assert one.shape == (1, 512, 4) and np.shares_memory(one, full[0])  # one row: its own view
    two = get_arch("flux2_klein").collate_context(full)
    assert two.shape == (2, 512, 4) and (two[1] == 4).all() and two.dtype == np.float32
    halves = [row.astype(np.float16) for row in full]  # other dtypes: fp32 out
    assert get_arch("flux2_klein").collate_context(halves).dtype == np.float32


def test_caption_variants_are_drawn_from_the_run_generator():
    from trainer.archs import get_arch
    from trainer.objective import flow as objective
    from trainer.run.loop import build_batch

    class Variants:
        buckets = {"a": [0]}

        def latent(self, i):
            return np.zeros((16, 2, 2), np.float32)

        def variants(self, i):
            return 3

        def context(self, i, variant=0):
            return np.full((1, 4), variant, np.float32)

        def empty_context(self):
            return np.full((1, 4), -1, np.float32)

        def name(self, i):
            return "x.png"

        def mask(self, i):
            return None

        def controls(self, i):
            return []

    settings = objective.ObjectiveSettings()
    picks = [
        build_batch(Variants(), [0], rng, settings, get_arch("demo"), 0.0).context[0, 0, 0]
        for rng in [np.random.default_rng(s) for s in range(30)]
    ]
    assert set(picks) == {0.0, 1.0, 2.0}


def test_batch_by_tokens_sizes_batches_from_each_buckets_latents(make_data, make_config):
    from trainer.archs import get_arch
    from trainer.run.loop import batch_sizes

    data = make_data()  # latents 4x4 and 6x4 (latent cells), demo arch: patch 1, no padding
    arch = get_arch("demo")
    assert arch.patch == 1 and arch.context_tokens == 0
    assert batch_sizes(make_config(batch_size=2), data, arch) == {"4x4": 2, "6x4": 2}
    # 16 and 24 tokens an image: the small bucket takes 2 * 24 // 16 = 3
    assert batch_sizes(make_config(batch_size=2, batch_by="tokens"), data, arch) == {"4x4": 3, "6x4": 2}


def test_the_demo_model_is_built_on_the_training_device(make_config, monkeypatch):
    """The torch backend trains a model where it is: `device = "cuda"` once crashed with the demo's weights
    left on the CPU (found on an H200). Here "meta" stands in for the GPU."""
    import torch

    from trainer.backends.torch_backend import devices
    from trainer.demo.run import model_for

    monkeypatch.setattr(devices, "pick_device", lambda name: torch.device("meta"))
    model = model_for(make_config())
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_one_front_end_object_drives_progress_validation_stop_and_pause(tmp_path, make_model, make_data, make_config):
    """A Callbacks subclass (trainer/run/callbacks.py) overrides only what it needs; the loop calls it in its order:
    on_step, validate when due (before the first step with validate_first), then pause and stop."""
    from trainer.run.callbacks import Callbacks

    class Front(Callbacks):
        validate_every, validate_first = 2, True

        def __init__(self):
            self.calls = []

        def on_step(self, report):
            self.calls.append(("step", report.step))

        def validate(self, step, lora):
            self.calls.append(("validate", step))

        def should_pause(self):
            self.calls.append(("pause?", len(self.calls)))
            return False

        def should_stop(self):
            return ("step", 3) in self.calls

    front = Front()
    result = train(
        make_config(steps=6, checkpoint_every=0), make_model(), make_data(), run_dir=tmp_path / "r", callbacks=front
    )
    steps = [c for c in front.calls if c[0] != "pause?"]
    assert steps == [("validate", 0), ("step", 1), ("step", 2), ("validate", 2), ("step", 3)]
    assert sum(c[0] == "pause?" for c in front.calls) == 3  # asked once after each step
    assert result.stopped and result.step == 3 and result.checkpoint.name == "step-000003"


def test_loose_functions_still_build_the_front_end_and_unknown_ones_are_refused(
    tmp_path, make_model, make_data, make_config
):
    with pytest.raises(TypeError, match=r"\['on_stp'\]"):
        train(make_config(steps=2), make_model(), make_data(), run_dir=tmp_path / "r", on_stp=print)
    validated = []  # validate_first without validate: nothing to run, as before
    train(
        make_config(steps=2, checkpoint_every=0),
        make_model(),
        make_data(),
        run_dir=tmp_path / "s",
        validate_first=True,
        on_step=lambda report: validated.append(report.step),
    )
    assert validated == [1, 2]
