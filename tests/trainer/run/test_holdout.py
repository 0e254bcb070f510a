"""Held-out loss and early stopping (trainer/run/holdout.py), and pausing the loop (trainer/run/pause.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainer import config as config
from trainer import safetensors_io
from trainer.archs import get_arch
from trainer.backends.torch_backend.backend import TorchBackend
from trainer.run import holdout, pause, state
from trainer.run.loop import train

from helpers.resume import assert_bitwise_resume


def test_the_split_is_seeded_whole_images_and_leaves_training_something(make_data):
    data = make_data(count=10)
    buckets, held = holdout.split(data.buckets, 0.3, seed=7)
    assert len(held) == 3 and held == holdout.split(data.buckets, 0.3, seed=7)[1]  # seeded
    assert held != holdout.split(data.buckets, 0.3, seed=8)[1]
    trained = {i for indices in buckets.values() for i in indices}
    assert trained.isdisjoint(held) and trained | set(held) == set(range(10))
    assert len(holdout.split(data.buckets, 2, seed=0)[1]) == 2  # a count
    assert holdout.split(data.buckets, 0, seed=0) == (data.buckets, [])
    with pytest.raises(ValueError, match="holdout 10 keeps 10 of the dataset's 10 image"):
        holdout.split(data.buckets, 10, seed=0)


def test_held_out_images_are_never_trained_on(tmp_path, make_model, make_data, make_config, monkeypatch):
    seen: list[str] = []
    step = TorchBackend.step

    def spy(self, micro_batches, lr):
        seen.extend(name for batch in micro_batches for name in batch.items)
        return step(self, micro_batches, lr)

    monkeypatch.setattr(TorchBackend, "step", spy)
    data, cfg = make_data(count=8), make_config(steps=10, holdout=0.25, holdout_every=5, batch_size=3)
    _, held = holdout.split(data.buckets, cfg.holdout, cfg.seed)
    result = train(cfg, make_model(), data, run_dir=tmp_path / "run")
    held_names = {data.name(i) for i in held}
    assert len(held_names) == 2 and held_names.isdisjoint(seen)
    assert set(seen) == {data.name(i) for i in range(8)} - held_names  # every other image was
    assert [s for s, _ in result.history.holdout] == [5, 10]


def test_the_held_out_loss_is_deterministic_and_its_draws_fixed(make_model, make_data, make_config):
    cfg, data, arch = make_config(holdout=2, holdout_sigmas=3, batch_size=2), make_data(), get_arch("demo")
    _, held = holdout.split(data.buckets, cfg.holdout, cfg.seed)
    first, again = holdout.batches(data, held, cfg, arch), holdout.batches(data, held, cfg, arch)
    assert len(first) == 4  # 2 images × 3 sigmas in chunks of 2 rows
    for a, b in zip(first, again):
        assert np.array_equal(a.noise, b.noise) and np.array_equal(a.sigmas, b.sigmas)
    assert np.allclose(np.concatenate([b.sigmas for b in first[:2]]), [1 / 6, 1 / 2, 5 / 6])
    backend = TorchBackend()
    backend.setup(make_model(), cfg, arch)
    try:
        torch_rng = backend.rng_state()
        values = [holdout.evaluate(backend, holdout.batches(data, held, cfg, arch)) for _ in range(2)]
        assert values[0] == values[1] and np.isfinite(values[0]) and values[0] > 0
        assert all(np.array_equal(torch_rng[k], v) for k, v in backend.rng_state().items())
    finally:
        backend.teardown()


def test_evaluations_do_not_change_training(tmp_path, make_model, make_data, make_config):
    """Evaluating every step or only at the end trains the same weights: the held-out draws come from
    their own generators, never the run's."""
    runs = [
        train(
            make_config(steps=4, holdout=1, holdout_every=every, lora_dropout=0.2, caption_dropout=0.3),
            make_model(),
            make_data(),
            run_dir=tmp_path / str(every),
        )
        for every in (1, 100)
    ]
    assert runs[0].history.loss == runs[1].history.loss
    assert all(np.array_equal(runs[0].lora[k].B, runs[1].lora[k].B) for k in runs[0].lora)
    assert len(runs[0].history.holdout) == 4 and runs[0].history.holdout[-1] == runs[1].history.holdout[-1]


def test_best_counts_evaluations_without_an_improvement_by_min_delta():
    points = [[10, 1.0], [20, 0.8], [30, 0.79], [40, 0.9], [50, float("nan")]]
    assert holdout.best(points, 0.0) == holdout.Best(step=30, loss=0.79, since=2)
    assert holdout.best(points, 0.05) == holdout.Best(step=20, loss=0.8, since=3)
    assert holdout.best([], 0.0) is None


def test_early_stopping_stops_at_the_right_step_keeps_the_best_and_a_resume_ends_at_once(
    tmp_path, make_model, make_data, make_config, monkeypatch, capsys
):
    scripted = iter([1.0, 0.5, 0.6, 0.55, 0.7, 0.1])  # best at the 2nd evaluation (step 4), then 2 worse
    monkeypatch.setattr(holdout, "evaluate", lambda backend, batches: next(scripted))
    cfg = make_config(
        steps=12,
        holdout=1,
        holdout_every=2,
        early_stop_patience=2,
        early_stop_min_delta=0.01,
        checkpoint_every=2,
        keep_checkpoints=1,
    )
    result = train(cfg, make_model(), make_data(), run_dir=tmp_path / "run")
    assert result.early_stopped and not result.stopped and result.step == 8
    assert result.best == holdout.Best(step=4, loss=0.5, since=2)
    assert result.checkpoint == state.step_dir(tmp_path / "run", 8)
    assert [s for s, _ in state.list_checkpoints(tmp_path / "run")] == [8]  # keep_checkpoints pruned
    assert result.best_lora == tmp_path / "run" / "best" / "lora.safetensors" and result.best_lora.is_file()
    assert holdout.read_best(tmp_path / "run") == {"step": 4, "holdout_loss": 0.5}
    _, metadata = safetensors_io.read(result.best_lora)
    assert metadata["kiln.holdout_loss"] == "0.5"
    # Queued again (resumed): it had stopped early, so it ends at once, trains nothing, and keeps best/ as it was.
    best_bytes = result.best_lora.read_bytes()
    monkeypatch.setattr(holdout, "evaluate", lambda backend, batches: pytest.fail("a stopped run evaluated again"))
    steps: list[int] = []
    again = train(
        cfg,
        make_model(),
        make_data(),
        run_dir=tmp_path / "run",
        resume=tmp_path / "run",
        on_step=lambda report: steps.append(report.step),
    )
    assert not steps and again.early_stopped and not again.stopped and again.step == 8
    assert again.best == result.best and again.checkpoint == state.step_dir(tmp_path / "run", 8)
    assert [s for s, _ in state.list_checkpoints(tmp_path / "run")] == [8]
    assert again.best_lora.read_bytes() == best_bytes
    for path, weights in result.lora.items():
        assert np.array_equal(weights.A, again.lora[path].A) and np.array_equal(weights.B, again.lora[path].B)
    assert "stopped early at step 8" in capsys.readouterr().err


def test_best_lora_is_the_weights_of_the_best_step(tmp_path, make_model, make_data, make_config, monkeypatch):
    scripted = iter([0.9, 0.5, 0.8, 0.8])
    monkeypatch.setattr(holdout, "evaluate", lambda backend, batches: next(scripted))
    cfg = make_config(steps=8, holdout=1, holdout_every=2, checkpoint_every=4, keep_checkpoints=5, save_dtype="fp32")
    result = train(cfg, make_model(), make_data(), run_dir=tmp_path / "run")
    assert not result.early_stopped and result.best.step == 4
    saved, _ = safetensors_io.read(result.best_lora)
    at_step_4, _ = safetensors_io.read(state.step_dir(tmp_path / "run", 4) / "lora.safetensors")
    assert saved.keys() == at_step_4.keys() and all(np.array_equal(saved[k], at_step_4[k]) for k in saved)


def test_resume_is_bitwise_with_holdout_and_early_stopping_on(tmp_path, make_model, make_data, make_config):
    cfg = make_config(
        steps=8,
        checkpoint_every=4,
        holdout=0.34,
        holdout_every=3,
        early_stop_patience=50,
        lora_dropout=0.1,
        caption_dropout=0.3,
        ema=True,
        ema_decay=0.9,
        log_every=5,
    )

    def run(name, stop_at=None, resume=False):
        progress: list = []
        stop = (lambda: len(progress) >= stop_at) if stop_at else None
        return train(
            cfg,
            make_model(),
            make_data(),
            run_dir=tmp_path / name,
            on_step=progress.append,
            should_stop=stop,
            resume=tmp_path / name if resume else None,
        )

    straight = run("straight")
    assert run("stopped", stop_at=5).stopped
    resumed = run("stopped", resume=True)
    assert_bitwise_resume(straight, resumed)
    assert straight.history.holdout == resumed.history.holdout and len(straight.history.holdout) == 3
    assert json.loads((resumed.checkpoint / "run.json").read_text())["history"]["holdout"] == straight.history.holdout


def test_config_refuses_early_stopping_without_holdout_and_a_fractional_count(make_config):
    with pytest.raises(config.ConfigError, match="early_stop_patience 3 stops on the held-out loss: set holdout"):
        make_config(early_stop_patience=3)
    with pytest.raises(config.ConfigError, match="holdout 2.5 must be a whole number"):
        make_config(holdout=2.5)


def test_mlx_held_out_loss_matches_torch(make_model, make_data, make_config):
    pytest.importorskip("mlx.core")
    from trainer.backends.mlx_backend.backend import MlxBackend
    from trainer.backends.mlx_backend.models.tiny import demo_model

    cfg, data, arch = make_config(holdout=2, ema=True), make_data(), get_arch("demo")
    batches = holdout.batches(data, holdout.split(data.buckets, 2, cfg.seed)[1], cfg, arch)
    values = []
    for backend, model in (
        (TorchBackend(), make_model()),
        (
            MlxBackend(),
            demo_model(0, hidden=32, heads=2, double_blocks=1, single_blocks=1, in_channels=16, context_dim=32),
        ),
    ):
        backend.setup(model, cfg, arch)
        try:
            values.append([holdout.evaluate(backend, batches) for _ in range(2)])
        finally:
            backend.teardown()
    assert values[1][0] == values[1][1]
    np.testing.assert_allclose(values[1][0], values[0][0], rtol=1e-5)


# ---------------------------------------------------------------- pause


def test_wait_returns_at_once_when_not_paused_and_ends_on_resume_or_stop(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(pause.time, "sleep", sleeps.append)
    assert pause.wait(None) == 0.0 and pause.wait(lambda: False) == 0.0 and not sleeps
    answers = iter([True, True, True, False])
    events: list[bool] = []
    assert pause.wait(lambda: next(answers), on_pause=events.append) >= 0.0
    assert len(sleeps) == 2 and events == [True, False]
    stops = iter([False, True])
    pause.wait(lambda: True, lambda: next(stops))  # paused for good, then a stop ends the wait
    assert len(sleeps) == 3


def test_a_paused_run_waits_between_steps_and_stops_while_paused(
    tmp_path, make_model, make_data, make_config, monkeypatch
):
    monkeypatch.setattr(pause.time, "sleep", lambda seconds: None)
    steps: list[int] = []
    polls = {"n": 0}

    def should_pause() -> bool:  # paused after step 3: the loop asks while it waits, never stepping on
        if len(steps) == 3:
            polls["n"] += 1
            return True
        return False

    result = train(
        make_config(steps=10),
        make_model(),
        make_data(),
        run_dir=tmp_path / "run",
        on_step=lambda report: steps.append(report.step),
        should_pause=should_pause,
        should_stop=lambda: polls["n"] >= 5,
    )
    assert steps == [1, 2, 3] and result.stopped and result.step == 3
    assert result.checkpoint == state.step_dir(tmp_path / "run", 3)


def test_the_pause_file_flag(tmp_path):
    flag = pause.file_flag(tmp_path)
    assert not flag()
    (tmp_path / pause.PAUSE_FILE).touch()
    assert flag()


def test_each_evaluation_goes_to_the_history_and_the_loggers(tmp_path, make_data, make_config, monkeypatch):
    logged: list = []

    class Sinks:
        def log_scalars(self, step, values):
            logged.append((step, values))

    monkeypatch.setattr(holdout, "evaluate", lambda backend, batches: 0.25)
    cfg, history = make_config(steps=5, holdout=1, holdout_every=2), state.History()
    judge = holdout.Judge(
        cfg, get_arch("demo"), make_data(), [0], run_dir=tmp_path, history=history, sinks=Sinks(), main=False
    )  # not rank 0: writes no best LoRA
    assert [judge.maybe(step, None, dict) for step in range(1, 6)] == [None, 0.25, None, 0.25, 0.25]
    assert history.holdout == [[2, 0.25], [4, 0.25], [5, 0.25]]  # and the last step
    assert logged == [(2, {"holdout_loss": 0.25}), (4, {"holdout_loss": 0.25}), (5, {"holdout_loss": 0.25})]
    assert judge.best_lora is None and not (tmp_path / "best").exists()
    assert not holdout.Judge(
        cfg, get_arch("demo"), make_data(), [], run_dir=tmp_path, history=history, sinks=Sinks()
    ).maybe(2, None, dict)  # nothing held out: inert


def test_held_out_batches_carry_the_images_mask_and_references(make_data, make_config):
    """A held-out image is scored as its training batches are built: its loss mask (clamped) and, in an edit
    dataset, its reference latents repeated over the evaluation's rows."""
    data = make_data()
    data.masks = [np.full((1, *data.latents[i].shape[-2:]), 0.5, np.float32) for i in range(len(data.latents))]
    data.control_latents = [[data.latents[i] + 1.0] for i in range(len(data.latents))]
    cfg = make_config(holdout=1, holdout_sigmas=3, batch_size=2, unmasked_weight=0.6)
    chunks = holdout.batches(data, [0], cfg, get_arch("flux2_klein"))
    assert [len(b.sigmas) for b in chunks] == [2, 1]
    for batch in chunks:
        rows = len(batch.sigmas)
        assert batch.mask.shape == (rows, 1, *data.latents[0].shape[-2:]) and np.all(batch.mask == 0.6)  # clamped
        (references,) = [v for v in batch.extras.values() if isinstance(v, list)]
        assert len(references) == 1 and np.array_equal(references[0], np.repeat(data.latents[0][None] + 1.0, rows, 0))


def test_a_console_run_has_its_folder_before_its_first_step(tmp_path, make_model, make_data, make_config):
    """Headless: `touch <run>/PAUSE` (or stop.request) works from the first step, before any checkpoint made
    the folder (a user trying it found no folder to touch)."""
    from trainer.cli import console

    run_dir, seen = tmp_path / "runs" / "me", []
    console.run_loop(
        make_config(steps=2, checkpoint_every=10),
        make_model(),
        make_data(),
        run_dir=run_dir,
        resume=False,
        should_pause=lambda: seen.append(run_dir.is_dir()) or False,
    )
    assert seen and seen[0] is True


def test_held_out_batches_of_clips_are_5d_and_their_loss_is_fixed(make_config):
    """A clip's cached latent is [C,t,h,w]: its held-out rows are [K,C,t,h,w] with noise of that shape, the same
    draws every call, and a loss over them (here the flow target's own error, v = ε − x0) is the same each time."""
    from helpers.tiny_runs import InMemoryData

    rng = np.random.default_rng(3)
    latents = [rng.standard_normal((16, 3, 4, 6)).astype(np.float32) for _ in range(2)]  # two clips, 3 latent frames
    contexts = [rng.standard_normal((8, 32)).astype(np.float32) for _ in range(2)]
    data = InMemoryData.from_arrays(latents, contexts, ["a.mp4", "b.mp4"], np.zeros((8, 32), np.float32))
    cfg = make_config(holdout=1, holdout_sigmas=3, batch_size=2)
    chunks = holdout.batches(data, [1], cfg, get_arch("demo"))
    assert [b.latents.shape for b in chunks] == [(2, 16, 3, 4, 6), (1, 16, 3, 4, 6)]
    assert all(b.noise.shape == b.latents.shape and b.mask is None for b in chunks)
    again = holdout.batches(data, [1], cfg, get_arch("demo"))
    assert all(np.array_equal(a.noise, b.noise) for a, b in zip(chunks, again))

    def loss(batches):  # the mean error of predicting zero velocity, per row and σ: any 5-D-safe loss will do
        rows = [((b.noise - b.latents) ** 2).mean(axis=(1, 2, 3, 4)) for b in batches]
        return float(np.concatenate(rows).mean())

    assert loss(chunks) == loss(again) and np.isfinite(loss(chunks))
