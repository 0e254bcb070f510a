"""Starting a run from an existing LoRA (#19 item 4): its weights, rank and alpha, resume, the record it leaves."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainer import config as config
from trainer import safetensors_io
from trainer.archs import get_arch
from trainer.backends.torch_backend.backend import TorchBackend
from trainer.lora import files as lora_format
from trainer.lora.files import LoraWeights
from trainer.lora.sources import file_identity
from trainer.run import init_lora
from trainer.run.loop import train

from helpers.resume import assert_bitwise_resume

LR = 1e-3  # tiny_config's: one AdamW step moves a weight by at most about this


def fresh_lora(make_model, cfg) -> dict[str, LoraWeights]:
    backend = TorchBackend()
    backend.setup(make_model(), cfg, get_arch(cfg.arch))
    try:
        return backend.lora_state()
    finally:
        backend.teardown()


def file_lora(make_model, make_config, rank=8, alpha=2.0, seed=5, skip=()) -> dict[str, LoraWeights]:
    """A LoRA for every default target of the tiny model (but `skip`), random A and B, at `rank`/`alpha`."""
    rng = np.random.default_rng(seed)
    paths = fresh_lora(make_model, make_config())
    return {
        path: LoraWeights(
            rng.standard_normal((rank, w.A.shape[1])).astype(np.float32) * 0.1,
            rng.standard_normal((w.B.shape[0], rank)).astype(np.float32) * 0.1,
            alpha,
        )
        for path, w in paths.items()
        if path not in skip
    }


def write(path, lora, fmt="comfy"):
    lora_format.save_lora(path, lora, arch="demo", fmt=fmt, dtype="fp32", metadata={})
    return path


def product(w: LoraWeights) -> np.ndarray:
    return (w.B.astype(np.float64) @ w.A.astype(np.float64)) * w.scale


def test_a_run_starts_from_the_file_and_records_it(tmp_path, make_model, make_data, make_config):
    source = file_lora(make_model, make_config, skip=("single_blocks.0.linear2",))
    path = write(tmp_path / "start.safetensors", source)
    cfg = make_config(steps=1, init_lora=str(path), ema=True, ema_decay=0.9, checkpoint_every=1)
    result = train(cfg, make_model(), make_data(), run_dir=tmp_path / "run")
    for name, trained in result.lora.items():
        assert trained.rank == 8 and trained.alpha == 2.0  # the file's rank and alpha, not 4/4
        if name in source:  # one AdamW step from the file's weights: near them, but moved
            for role in "AB":
                moved = np.abs(getattr(trained, role) - getattr(source[name], role))
                assert moved.max() <= 1.1 * LR and moved.max() > 0, (name, role)
            ema = result.ema_lora[name]  # the shadow started from the file too
            assert np.abs(ema.A - source[name].A).max() <= 0.11 * LR
    # A targeted module the file lacks starts as a new LoRA: B was zero, one step away from it.
    assert np.abs(result.lora["single_blocks.0.linear2"].B).max() <= 1.1 * LR
    _, metadata = safetensors_io.read(result.checkpoint / "lora.safetensors")
    assert json.loads(metadata["kiln.init_lora"]) == file_identity(path)
    saved = json.loads(metadata["kiln.config"])
    assert (saved["rank"], saved["alpha"], saved["init_lora_sha256"]) == (8, 2.0, file_identity(path)["sha256"])


def test_step_zero_weights_are_the_files(tmp_path, make_model, make_config):
    """Loaded into a backend at the file's rank: A, B and the EMA shadow are the file's, bit for bit."""
    source = file_lora(make_model, make_config)
    cfg, init = init_lora.prepare(make_config(ema=True, init_lora=str(write(tmp_path / "s.safetensors", source))))
    backend = TorchBackend()
    backend.setup(make_model(), cfg, get_arch("demo"))
    try:
        init_lora.load_into(backend, init, ema=True)
        loaded, shadow = backend.lora_state(), backend.ema_state()
    finally:
        backend.teardown()
    for name, weights in source.items():
        assert np.array_equal(loaded[name].A, weights.A) and np.array_equal(loaded[name].B, weights.B)
        assert np.array_equal(shadow[f"{name}.A"], weights.A) and np.array_equal(shadow[f"{name}.B"], weights.B)


def test_resuming_a_run_started_from_a_lora_is_bitwise_a_straight_run(tmp_path, make_model, make_data, make_config):
    path = write(tmp_path / "start.safetensors", file_lora(make_model, make_config))
    cfg = make_config(
        steps=8,
        checkpoint_every=3,
        init_lora=str(path),
        ema=True,
        ema_decay=0.9,
        lora_dropout=0.1,
        caption_dropout=0.3,
        grad_accum=2,
    )

    def run(name, stop_at=None, resume=False):
        steps = []
        return train(
            cfg,
            make_model(),
            make_data(),
            run_dir=tmp_path / name,
            on_step=steps.append,
            resume=tmp_path / name if resume else None,
            should_stop=(lambda: len(steps) >= stop_at) if stop_at else None,
        )

    straight = run("straight")
    assert run("stopped", stop_at=5).stopped
    resumed = run("stopped", resume=True)  # continues from its checkpoint; the file is not loaded again
    assert_bitwise_resume(straight, resumed, holds=("ema.",))
    write(path, file_lora(make_model, make_config, seed=11))  # the file changed: its run does not resume from it
    with pytest.raises(ValueError, match="this run started from init LoRA sha256 .* but the config gives init"):
        train(
            config.replace(cfg, steps=10),
            make_model(),
            make_data(),
            run_dir=tmp_path / "stopped",
            resume=tmp_path / "stopped",
        )


@pytest.mark.parametrize("fmt", ["kohya", "diffusers"])
def test_kohya_and_diffusers_files_start_a_run(tmp_path, make_model, make_data, make_config, fmt):
    source = file_lora(make_model, make_config, rank=6, alpha=3.0)
    path = write(tmp_path / f"{fmt}.safetensors", source, fmt)
    cfg, init = init_lora.prepare(make_config(init_lora=str(path)))
    # kohya keeps alpha; diffusers folds alpha/rank into B (alpha = rank): the same product either way.
    assert (cfg.rank, cfg.alpha) == ((6, 3.0) if fmt == "kohya" else (6, 6.0))
    start = init_lora.start_weights(fresh_lora(make_model, cfg), init)
    for name, weights in source.items():
        np.testing.assert_allclose(product(start[name]), product(weights), rtol=1e-6, atol=1e-9)
    result = train(config.replace(cfg, steps=2), make_model(), make_data(), run_dir=tmp_path / "run")
    assert all(w.rank == 6 for w in result.lora.values())


def test_a_diffusers_file_with_split_qkv_is_padded_exactly(tmp_path, make_model, make_config):
    """PEFT trains q, k and v with their own A: the fused qkv reads as rank 3r, the rest pad to it."""
    source = file_lora(make_model, make_config, rank=2, alpha=2.0)
    qkv = source.pop("double_blocks.0.img_attn.qkv")
    tensors = lora_format.to_tensors(source, "diffusers", "demo")
    rng = np.random.default_rng(3)
    rows = qkv.B.shape[0] // 3
    for part in ("to_q", "to_k", "to_v"):
        tensors[f"transformer.transformer_blocks.0.attn.{part}.lora_A.weight"] = rng.standard_normal(
            (2, qkv.A.shape[1])
        ).astype(np.float32)
        tensors[f"transformer.transformer_blocks.0.attn.{part}.lora_B.weight"] = rng.standard_normal((rows, 2)).astype(
            np.float32
        )
    path = tmp_path / "peft.safetensors"
    safetensors_io.write(path, tensors, {})
    cfg, init = init_lora.prepare(make_config(init_lora=str(path)))
    assert (cfg.rank, cfg.alpha) == (6, 6.0)
    fresh = fresh_lora(make_model, cfg)
    start = init_lora.start_weights(fresh, init)
    for name, weights in init.lora.items():
        np.testing.assert_allclose(product(start[name]), product(weights), rtol=1e-6, atol=1e-9)
        if weights.rank < 6:  # the extra rank starts as a new LoRA's: the run's A rows, zero B columns
            assert np.array_equal(start[name].A[2:], fresh[name].A[2:]) and not start[name].B[:, 2:].any()


def test_modules_outside_the_targets_stop_the_run(tmp_path, make_model, make_data, make_config):
    path = write(tmp_path / "all.safetensors", file_lora(make_model, make_config))
    cfg = make_config(init_lora=str(path), targets=["img_attn.qkv"])
    with pytest.raises(
        ValueError,
        match=r"all\.safetensors.*not among this run's targets.*double_blocks\.0\."
        r"img_mlp\.0.*add them to targets.*'img_mlp\.0'.*'linear1'",
    ):
        train(cfg, make_model(), make_data(), run_dir=tmp_path / "run")


def test_a_module_of_another_model_is_named(tmp_path, make_model, make_data, make_config):
    source = file_lora(make_model, make_config)
    name = "double_blocks.0.img_attn.proj"
    source[name] = LoraWeights(source[name].A[:, :5], source[name].B, source[name].alpha)
    cfg = make_config(init_lora=str(write(tmp_path / "other.safetensors", source)))
    with pytest.raises(ValueError, match=rf"{name} is 32x5 in the file but 32x32 in this model"):
        train(cfg, make_model(), make_data(), run_dir=tmp_path / "run")


def test_the_file_sets_rank_and_alpha_and_a_changed_file_is_refused(tmp_path, make_model, make_config):
    path = write(tmp_path / "s.safetensors", file_lora(make_model, make_config, rank=16, alpha=8.0))
    cfg, _ = init_lora.prepare(make_config(rank=32, alpha=32.0, init_lora=str(path)))
    assert (cfg.rank, cfg.alpha, cfg.init_lora_sha256) == (16, 8.0, file_identity(path)["sha256"])
    assert init_lora.prepare(cfg)[0] == cfg  # settled: nothing changes
    write(path, file_lora(make_model, make_config, rank=16, alpha=8.0, seed=9))
    with pytest.raises(ValueError, match="the file changed since the run started"):
        init_lora.prepare(cfg)
    with pytest.raises(ValueError, match="is not a file"):
        init_lora.prepare(make_config(init_lora=str(tmp_path / "missing.safetensors")))


def test_mixed_alphas_are_folded_into_b(tmp_path, make_model, make_config):
    source = file_lora(make_model, make_config, rank=4, alpha=4.0)
    source["double_blocks.0.img_attn.proj"].alpha = 1.0
    init = init_lora.InitLora(source, "mixed", "0" * 64)
    cfg = init_lora.settle(make_config(), init)
    assert (cfg.rank, cfg.alpha) == (4, 4.0)
    start = init_lora.start_weights(fresh_lora(make_model, cfg), init)
    for name, weights in source.items():
        np.testing.assert_allclose(product(start[name]), product(weights), rtol=1e-6, atol=1e-9)


def test_a_lora_model_is_identified_by_its_tensors(make_model, make_config):
    tensors = lora_format.to_tensors(file_lora(make_model, make_config), "comfy", "demo")
    first = init_lora.from_tensors_named(tensors, "LORA_MODEL", "demo")
    assert first.sha256 == init_lora.from_tensors_named(dict(reversed(tensors.items())), "LORA_MODEL").sha256
    key = next(iter(tensors))
    changed = {**tensors, key: tensors[key] + 1}
    assert init_lora.from_tensors_named(changed, "LORA_MODEL").sha256 != first.sha256
