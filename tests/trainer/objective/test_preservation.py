"""Preservation (trainer/objective/preservation.py): differential output preservation and regularisation images."""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image
from helpers.tiny_runs import tiny_data

from trainer import config as config
from trainer.archs import get_arch
from trainer.backends.base import Batch
from trainer.backends.torch_backend.backend import TorchBackend
from trainer.config import ConfigError
from trainer.data import InMemoryData
from trainer.data.captions import CaptionSettings, class_caption
from trainer.data.dataset import Dataset, DatasetError, DataSettings
from trainer.data.regularised import RegularisedData
from trainer.data.sampler import BucketSampler
from trainer.objective.preservation import OFF, Preservation, Settings
from trainer.run.loop import build_batch, objective_settings, train
from helpers.resume import assert_bitwise_resume

DOP = {"preservation_class": "person", "preservation_weight": 1.0}
REG = {"reg_dataset_dir": "reg", "reg_repeats": 2, "reg_weight": 0.5}


class WithClass:
    """In-memory data with class-word caption embeddings (what Encode Captions caches with preservation_class)."""

    def __init__(self, data, seed: int = 7):
        rng = np.random.default_rng(seed)
        self.data = data
        self.class_contexts = [rng.standard_normal((8, 32)).astype(np.float32) for _ in data.latents]

    def __getattr__(self, name):
        return getattr(self.data, name)

    def preservation_context(self, index: int, variant: int = 0) -> np.ndarray:
        return self.class_contexts[index]


def dop_data():
    return WithClass(tiny_data())


def reg_set(repeats: int = 2):
    rng = np.random.default_rng(11)
    latents = [rng.standard_normal((16, 4, 4)).astype(np.float32) for _ in range(3)]
    contexts = [rng.standard_normal((8, 32)).astype(np.float32) for _ in range(3)]
    return InMemoryData.from_arrays(
        latents, contexts, [f"person_{i}.png" for i in range(3)], np.zeros((8, 32), np.float32), repeats=repeats
    )


def both_data():
    return RegularisedData(dop_data(), reg_set())


def dop_batch(rows: int = 2, seed: int = 0, weight: float = 1.0) -> Batch:
    rng = np.random.default_rng(seed)
    arch = get_arch("demo")
    contexts = [rng.standard_normal((8, 32)).astype(np.float32) for _ in range(rows)]
    kept = [rng.standard_normal((8, 32)).astype(np.float32) for _ in range(rows)]
    batch = Batch(
        latents=rng.standard_normal((rows, 16, 4, 4)).astype(np.float32),
        noise=rng.standard_normal((rows, 16, 4, 4)).astype(np.float32),
        sigmas=rng.uniform(0.2, 0.8, rows).astype(np.float32),
        weights=rng.uniform(0.5, 1.5, rows).astype(np.float32),
        context=arch.collate_context(contexts),
    )
    batch.preservation = Preservation(
        context=arch.collate_context(kept),
        extras={},
        joint_context=arch.collate_context(contexts + kept),
        joint_extras={},
        weights=np.full(rows, weight, np.float32),
    )
    return batch


def backend_with_lora(make_model, make_config, nonzero: bool = True) -> TorchBackend:
    backend = TorchBackend()
    backend.setup(make_model(), make_config(), get_arch("demo"))
    if nonzero:
        rng = np.random.default_rng(1)
        lora = backend.lora_state()
        for weights in lora.values():
            weights.B = (0.05 * rng.standard_normal(weights.B.shape)).astype(np.float32)
        backend.load_lora_state(lora)
    return backend


def predict(model, x_t, sigmas, context):
    with torch.no_grad():
        return model(x_t, sigmas, torch.from_numpy(context)).float()


# --------------------------------------------------------------------------- DOP: the objective


def test_the_target_is_the_base_model_with_the_lora_off(make_model, make_config):
    """The loss is mean(w·|v_θ(c)−v|²) + mean(p·|v_θ(c')−v_0(c')|²), v_0 from a model that never had a LoRA."""
    backend, reference = backend_with_lora(make_model, make_config), make_model()  # same seed: same base
    batch, rows = dop_batch(), 2
    x0, noise, sigmas = (torch.from_numpy(a) for a in (batch.latents, batch.noise, batch.sigmas))
    x_t = (1 - sigmas.view(-1, 1, 1, 1)) * x0 + sigmas.view(-1, 1, 1, 1) * noise
    with_lora = predict(backend.model, x_t, sigmas, batch.preservation.context)
    base = predict(reference, x_t, sigmas, batch.preservation.context)
    with backend.lora.disabled():
        off = predict(backend.model, x_t, sigmas, batch.preservation.context)
    assert torch.equal(off, base)  # LoRA off = the base model, bitwise
    assert (with_lora - base).abs().max() > 1e-3  # the LoRA does change the prediction
    assert torch.equal(predict(backend.model, x_t, sigmas, batch.preservation.context), with_lora)  # back on
    trained = (predict(backend.model, x_t, sigmas, batch.context) - (noise - x0)).square().flatten(1).mean(1)
    kept = (with_lora - base).square().flatten(1).mean(1)
    expected = (trained * torch.from_numpy(batch.weights)).mean() + kept.mean()
    got = backend._micro_loss(batch).detach()
    assert kept.mean() > 1e-6
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert got.shape == () and rows == batch.latents.shape[0]


def test_the_dop_term_and_its_gradient_are_zero_at_step_zero(make_model, make_config):
    """B = 0 (a new LoRA): v_θ = v_0, so the term and its gradient (2p/N)·Jᵀ(v_θ − v_0) vanish."""
    grads = []
    for weight in (5.0, None):
        backend = backend_with_lora(make_model, make_config, nonzero=False)
        batch = dop_batch(weight=weight or 0.0)
        if weight is None:
            batch.preservation = None
        backend._micro_loss(batch).backward()
        grads.append([p.grad.clone() for p in backend.params.values()])
    for with_dop, plain in zip(*grads):
        torch.testing.assert_close(with_dop, plain, rtol=1e-5, atol=1e-8)


def test_the_dop_gradient_matches_finite_differences(make_model, make_config):
    backend = backend_with_lora(make_model, make_config)
    batch = dop_batch(weight=3.0)
    batch.weights[:] = 0.0  # the DOP term alone
    backend._micro_loss(batch).backward()
    checked = 0
    for name, param in backend.params.items():
        if not name.endswith("lora_B"):
            continue
        index = np.unravel_index(int(param.grad.abs().argmax()), param.shape)
        step, original = 1e-2, param.data[index].item()
        values = []
        for sign in (1, -1):
            with torch.no_grad():
                param.data[index] = original + sign * step
                values.append(backend._micro_loss(batch).double().item())
        with torch.no_grad():
            param.data[index] = original
        numeric = (values[0] - values[1]) / (2 * step)
        assert numeric == pytest.approx(param.grad[index].item(), rel=2e-2, abs=1e-6), name
        checked += abs(numeric) > 1e-5
    assert checked >= 3


def test_dop_weight_zero_is_bitwise_the_plain_run(tmp_path, make_model, make_config):
    plain = train(make_config(), make_model(), tiny_data(), run_dir=tmp_path / "plain")
    off = train(
        make_config(preservation_class="person", preservation_weight=0.0),
        make_model(),
        dop_data(),
        run_dir=tmp_path / "off",
    )
    on = train(make_config(**DOP), make_model(), dop_data(), run_dir=tmp_path / "on")
    assert plain.history.loss == off.history.loss
    for path, weights in plain.lora.items():
        assert np.array_equal(weights.A, off.lora[path].A) and np.array_equal(weights.B, off.lora[path].B)
    assert any(not np.array_equal(w.B, on.lora[p].B) for p, w in plain.lora.items())  # DOP does train otherwise


# --------------------------------------------------------------------------- regularisation images


def test_reg_images_are_drawn_as_configured():
    """Each epoch: every training image (× repeats) and every regularisation image (× reg repeats) once,
    in batches of one kind; the regularisation batches' loss weights times reg_weight."""
    main, reg = tiny_data(), reg_set(repeats=3)
    data = RegularisedData(main, reg)
    sampler = BucketSampler(data.buckets, 2, seed=3)
    plan = sampler.epoch_plan(0)
    counts = Counter(i for batch in plan for i in batch)
    assert {i: counts[i] for i in range(6)} == dict.fromkeys(range(6), 1)
    assert {i: counts[i] for i in range(6, 9)} == dict.fromkeys(range(6, 9), 3) and len(counts) == 9
    assert all(len({data.is_regularisation(i) for i in batch}) == 1 for batch in plan)
    assert sorted(data.buckets) == ["4x4", "6x4", "reg/4x4"] and data.name(6) == "reg/person_0.png"
    arch, cfg = get_arch("demo"), config.from_dict({"arch": "demo"})
    reg_batch = next(batch for batch in plan if data.is_regularisation(batch[0]))
    plain, weighted = (
        build_batch(
            data, reg_batch, np.random.default_rng(0), objective_settings(cfg, arch), arch, 0.0, preserve=chosen
        )
        for chosen in (OFF, Settings(reg_weight=0.25))
    )
    np.testing.assert_array_equal(weighted.weights, plain.weights * np.float32(0.25))
    np.testing.assert_array_equal(weighted.latents, plain.latents)
    np.testing.assert_array_equal(weighted.latents[0], reg.latent(reg_batch[0] - 6))
    assert weighted.preservation is None


def test_dop_rows_carry_their_class_captions_and_reg_batches_skip_dop(make_config):
    data, arch = both_data(), get_arch("demo")
    cfg = make_config(**DOP, **REG)
    chosen, settings = Settings(weight=2.0, reg_weight=0.5), objective_settings(cfg, arch)
    batch = build_batch(data, [0, 2], np.random.default_rng(0), settings, arch, 0.0, preserve=chosen)
    kept = batch.preservation
    np.testing.assert_array_equal(kept.context, arch.collate_context([data.main.class_contexts[i] for i in (0, 2)]))
    np.testing.assert_array_equal(kept.joint_context[:2], batch.context)  # the rows as trained, then class rows
    np.testing.assert_array_equal(kept.joint_context[2:], kept.context)
    np.testing.assert_array_equal(kept.weights, [2.0, 2.0])
    assert (
        build_batch(data, [6, 7], np.random.default_rng(0), settings, arch, 0.0, preserve=chosen).preservation is None
    )


def test_a_run_with_dop_and_reg_images_resumes_bitwise(tmp_path, make_model, make_config):
    cfg = make_config(
        steps=10,
        checkpoint_every=4,
        caption_dropout=0.3,
        lora_dropout=0.1,
        ema=True,
        grad_accum=2,
        log_every=5,
        gradient_checkpointing=True,
        **DOP,
        **REG,
    )
    straight = train(cfg, make_model(), both_data(), run_dir=tmp_path / "straight")
    progress = []
    first = train(
        cfg,
        make_model(),
        both_data(),
        run_dir=tmp_path / "stopped",
        on_step=progress.append,
        should_stop=lambda: len(progress) >= 5,
    )
    assert first.stopped and first.step == 5
    resumed = train(cfg, make_model(), both_data(), run_dir=tmp_path / "stopped", resume=tmp_path / "stopped")
    assert_bitwise_resume(straight, resumed)
    assert straight.history.loss == resumed.history.loss


# --------------------------------------------------------------------------- refusals


def test_settings_that_cannot_work_are_refused(tmp_path, make_model, make_config):
    with pytest.raises(ConfigError, match="preservation_class"):
        make_config(preservation_weight=1.0)
    with pytest.raises(ConfigError, match="class-word captions"):
        train(make_config(**DOP), make_model(), tiny_data(), run_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match="reg_dataset"):
        train(make_config(**REG), make_model(), tiny_data(), run_dir=tmp_path / "b")
    with pytest.raises(ConfigError, match="reg_dataset_dir is empty"):
        train(make_config(), make_model(), both_data(), run_dir=tmp_path / "c")


# --------------------------------------------------------------------------- the cached class-word captions


def test_class_captions_are_encoded_and_cached(tmp_path):
    assert (
        class_caption("ohwx, a man beside ohwx2 and ohwx", "ohwx", "person") == "person, a man beside ohwx2 and person"
    )
    root = tmp_path / "ds"
    root.mkdir()
    for name, caption, colour in (
        ("a.png", "a man at a desk", (200, 30, 30)),
        ("b.png", "{trigger} in the rain", (30, 30, 200)),
    ):
        Image.new("RGB", (64, 64), colour).save(root / name)
        (root / name).with_suffix(".txt").write_text(caption)
    settings = DataSettings(resolutions=(64,), captions=CaptionSettings(trigger_word="ohwx"))
    dataset = Dataset.load(root, settings)
    with pytest.raises(DatasetError, match="no trigger word"):
        Dataset.load(root, DataSettings(resolutions=(64,))).with_preservation("person")
    dataset = dataset.with_preservation("person")
    assert set(dataset.texts()) == {
        "",
        "ohwx, a man at a desk",
        "ohwx in the rain",
        "person, a man at a desk",
        "person in the rain",
    }
    seen = []

    def encode_text(text):
        seen.append(text)
        return np.full((3, 4), len(text), np.float32)

    encoded = dataset.encode_images(lambda px: px[:, ::8, ::8].transpose(0, 3, 1, 2), "vae").encode_captions(
        encode_text, "te"
    )
    data = encoded.training_data()
    for index in range(len(data.entries)):
        expected = class_caption(data.caption(index), "ohwx", "person")
        assert data.preservation_context(index)[0, 0] == len(expected)
    again = copy.copy(seen)
    dataset.encode_captions(encode_text, "te")  # cached: nothing encoded again
    assert seen == again and len(seen) == 5

    # An encoder's conditioning beside the embedding (SD 3.5's pooled vector) comes with the class-word captions:
    # the DOP forward takes the class captions', the joint forward the rows' then theirs.
    def pooled(text):
        return {"context": encode_text(text), "pooled_output": np.full(2, len(text), np.float32)}

    data = dataset.encode_images(lambda px: px[:, ::8, ::8].transpose(0, 3, 1, 2), "vae")
    data = data.encode_captions(pooled, "te-pooled").training_data()
    rows, arch = [0, 1], get_arch("generic")
    batch = build_batch(
        data,
        rows,
        np.random.default_rng(0),
        objective_settings(config.from_dict({}), arch),
        arch,
        0.0,
        preserve=Settings(weight=1.0),
    )
    class_lengths = [len(class_caption(data.caption(i), "ohwx", "person")) for i in rows]
    assert batch.preservation.extras["pooled_output"][:, 0].tolist() == class_lengths
    joint = batch.preservation.joint_extras["pooled_output"][:, 0].tolist()
    assert joint == [len(data.caption(i)) for i in rows] + class_lengths


# --------------------------------------------------------------------------- MLX


def test_mlx_trains_dop_and_reg_images_as_torch_does(tmp_path, make_model, make_config, monkeypatch):
    """A few steps of the real loop with DOP and regularisation images: MLX (eager step) against torch."""
    pytest.importorskip("mlx.core")
    from trainer.backends.mlx_backend.backend import MlxBackend
    from trainer.backends.mlx_backend.models.tiny import demo_model

    monkeypatch.setattr(MlxBackend, "compile_step", False)  # no g++ kernel builds on CPU (test_mlx_backend.py)
    results = {}
    for name, model in (
        ("torch", make_model()),
        ("mlx", demo_model(0, hidden=32, heads=2, double_blocks=1, single_blocks=1, in_channels=16, context_dim=32)),
    ):
        cfg = make_config(backend=name, steps=8, max_grad_norm=0.01, **DOP, **REG)
        results[name] = train(cfg, model, both_data(), run_dir=tmp_path / name)
    ref, ours = results["torch"], results["mlx"]
    np.testing.assert_allclose(ours.history.loss, ref.history.loss, rtol=1e-3)
    for path, weights in ref.lora.items():
        np.testing.assert_allclose(ours.lora[path].B, weights.B, atol=1e-5)
    plain = train(
        make_config(backend="torch", steps=8, max_grad_norm=0.01, **REG),
        make_model(),
        both_data(),
        run_dir=tmp_path / "plain",
    )
    # DOP was on in both: it moves the weights by far more than the backends differ
    apart = max(np.abs(ours.lora[p].B - w.B).max() for p, w in ref.lora.items())
    moved = max(np.abs(plain.lora[p].B - w.B).max() for p, w in ref.lora.items())
    assert moved > 10 * apart, (moved, apart)


def test_estimate_counts_dops_doubled_forward():
    from trainer.estimate.mlx_step import estimate_mlx
    from trainer.estimate.torch_step import estimate

    for rule in (estimate, estimate_mlx):
        plain = rule("flux2-klein-4b", resolution=512, batch_size=2)
        dop = rule("flux2-klein-4b", resolution=512, batch_size=2, preservation=True)
        assert dop.activations == rule("flux2-klein-4b", resolution=512, batch_size=4).activations
        assert dop.weights == plain.weights and dop.total > plain.total
        assert any("differential output preservation" in note for note in dop.notes)


def test_the_headless_data_path_caches_class_captions_and_the_reg_folder(tmp_path, make_config):
    """`train` (the demo's encoders): the class-word captions and the regularisation folder are encoded and
    cached; the regularisation images come with reg_repeats and without the trigger word; a run trains."""
    from trainer.demo.run import build_data, make_images, model_for

    make_images(tmp_path / "main", count=4)
    make_images(tmp_path / "reg", count=3, seed=1)
    cfg = make_config(
        trigger_word="ohwx", resolutions=[128], steps=2, reg_dataset_dir=str(tmp_path / "reg"), reg_repeats=2, **DOP
    )
    data = build_data(cfg, tmp_path / "main", tmp_path / "cache")
    assert isinstance(data, RegularisedData)
    reg = [i for indices in data.buckets.values() for i in indices if data.is_regularisation(i)]
    assert len(reg) == 3 * 2 and all(data.name(i).startswith("reg/") for i in reg)
    assert not any("ohwx" in data.reg.caption(i - data.offset) for i in reg)
    first = data.main.buckets[next(iter(data.main.buckets))][0]
    assert "ohwx" in data.main.caption(first) and data.preservation_context(first) is not None
    assert data.preservation_context(reg[0]) is None
    result = train(cfg, model_for(cfg), data, run_dir=tmp_path / "run")
    assert result.step == 2 and all(np.isfinite(result.history.loss))


def test_compiled_blocks_do_not_recompile_for_the_lora_off_forward(make_model, make_config, monkeypatch):
    """The base forward runs without grad (blocks eager): a DOP step compiles the graphs a plain step of its
    joint batch (2B rows) compiles, no more, and later steps compile nothing."""
    from torch._dynamo.utils import counters

    from trainer.backends.torch_backend import checkpointing

    monkeypatch.setattr(checkpointing, "COMPILE_BACKEND", "aot_eager")  # same graphs, no C++ build
    lora = backend_with_lora(make_model, make_config).lora_state()

    def graphs_and_grads(batches, compiled=True):
        torch._dynamo.reset()
        counters.clear()
        backend = TorchBackend()
        backend.setup(make_model(), make_config(gradient_checkpointing=True, compile_blocks=compiled), get_arch("demo"))
        backend.load_lora_state(lora)
        seen = []
        for batch in batches:
            backend.optimizer.zero_grad(set_to_none=True)
            backend._micro_loss(batch).backward()
            seen.append(counters["stats"]["unique_graphs"])
        grads = torch.cat([p.grad.flatten() for p in backend.params.values()])
        backend.teardown()
        return seen, grads

    try:
        plain = dop_batch(rows=4)
        plain.preservation = None
        expected, _ = graphs_and_grads([plain])
        seen, grads = graphs_and_grads([dop_batch(weight=2.0)] * 3)
        _, eager = graphs_and_grads([dop_batch(weight=2.0)], compiled=False)
        assert expected[0] >= 1 and seen == [expected[0]] * 3
        torch.testing.assert_close(grads, eager, atol=1e-6, rtol=1e-5)
    finally:
        torch._dynamo.reset()
