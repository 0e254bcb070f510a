"""Exact resume: stopping after N steps and resuming gives bitwise the weights of an uninterrupted run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainer import config as config
from trainer import safetensors_io
from trainer.run import state
from trainer.run.loop import train

from helpers.resume import assert_bitwise_resume
from helpers.tiny_runs import train_until


@pytest.fixture
def resume_config(make_config):
    # Everything random is switched on: caption dropout (numpy RNG), LoRA dropout (torch RNG),
    # EMA, two buckets, accumulation, a schedule with warm-up.
    return make_config(
        steps=12,
        checkpoint_every=4,
        caption_dropout=0.3,
        lora_dropout=0.1,
        ema=True,
        ema_decay=0.9,
        grad_accum=2,
        lr_schedule="cosine_with_warmup",
        warmup_steps=3,
        log_every=5,
        gradient_checkpointing=True,
    )


@pytest.mark.parametrize("batch_by", ["images", "tokens"])
def test_resume_is_bitwise_exact(tmp_path, make_model, make_data, resume_config, batch_by):
    resume_config = config.replace(resume_config, batch_by=batch_by)  # tokens: 3 images a batch in the small bucket
    straight = train_until(tmp_path / "straight", make_model(), make_data(), resume_config)
    first = train_until(tmp_path / "stopped", make_model(), make_data(), resume_config, stop_at=5)
    assert first.stopped and first.step == 5
    resumed = train_until(tmp_path / "stopped", make_model(), make_data(), resume_config, resume=True)
    assert resumed.step == 12 and not resumed.stopped
    assert_bitwise_resume(straight, resumed, holds=("ema.", "optim."))
    assert straight.history.loss == resumed.history.loss  # the loss history carries over too
    assert straight.history.lr == resumed.history.lr


def test_second_resume_does_not_drift(tmp_path, make_model, make_data, resume_config):
    straight = train_until(tmp_path / "straight", make_model(), make_data(), resume_config)
    train_until(tmp_path / "twice", make_model(), make_data(), resume_config, stop_at=3)
    train_until(tmp_path / "twice", make_model(), make_data(), resume_config, stop_at=4, resume=True)  # 3 → 7
    resumed = train_until(tmp_path / "twice", make_model(), make_data(), resume_config, resume=True)
    assert_bitwise_resume(straight, resumed)


def test_a_checkpoint_with_the_old_ema_names_still_resumes(tmp_path, make_model, make_data, resume_config):
    """Checkpoints written before the EMA shadow took the trained LoRA's naming hold it as
    ema.<path>.lora_A/.lora_B: one loads with the same EMA and resumes to an uninterrupted run's state."""
    straight = train_until(tmp_path / "straight", make_model(), make_data(), resume_config)
    train_until(tmp_path / "old", make_model(), make_data(), resume_config, stop_at=5)
    folder = state.list_checkpoints(tmp_path / "old")[-1][1]
    tensors, metadata = safetensors_io.read(folder / "state.safetensors")
    ema = {k: v for k, v in tensors.items() if k.startswith("ema.")}
    assert ema and all(k.endswith((".A", ".B")) for k in ema)  # today's names
    old = {(f"{k[:-2]}.lora_{k[-1]}" if k in ema else k): v for k, v in tensors.items()}
    safetensors_io.write(folder / "state.safetensors", old, metadata)
    loaded = state.load_checkpoint(folder)
    assert {k: v for k, v in loaded.tensors.items() if k.startswith("ema.")}.keys() == ema.keys()
    for path, weights in state.checkpoint_lora(loaded, ema=True).items():
        assert np.array_equal(weights.A, ema[f"ema.{path}.A"]) and np.array_equal(weights.B, ema[f"ema.{path}.B"])
    resumed = train_until(tmp_path / "old", make_model(), make_data(), resume_config, resume=True)
    assert_bitwise_resume(straight, resumed)


def test_checkpoints_pruned_to_newest_k_and_complete(tmp_path, make_model, make_data, make_config):
    cfg = make_config(steps=10, checkpoint_every=2, keep_checkpoints=2)
    result = train_until(tmp_path / "prune", make_model(), make_data(), cfg)
    steps = [step for step, _ in state.list_checkpoints(result.run_dir)]
    assert steps == [8, 10]
    folder = result.run_dir / "step-000010"
    assert {p.name for p in folder.iterdir()} == {"lora.safetensors", "state.safetensors", "run.json"}
    info = json.loads((folder / "run.json").read_text())
    assert info["step"] == 10 and info["config"]["steps"] == 10 and len(info["history"]["loss"]) == 10
    assert not list(result.run_dir.glob(".tmp-*"))


def test_partial_checkpoints_are_never_chosen(tmp_path, make_model, make_data, make_config):
    cfg = make_config(steps=4, checkpoint_every=2)
    result = train_until(tmp_path / "partial", make_model(), make_data(), cfg)
    broken = result.run_dir / "step-000006"  # newer, but run.json never written
    broken.mkdir()
    (broken / "state.safetensors").write_bytes(b"\x00" * 10)
    (result.run_dir / ".tmp-step-000008-999").mkdir()  # a killed writer's temp folder
    assert state.load_checkpoint(result.run_dir).step == 4


def test_stop_request_saves_a_resumable_checkpoint(tmp_path, make_model, make_data, make_config):
    result = train_until(tmp_path / "stop", make_model(), make_data(), make_config(steps=10), stop_at=3)
    assert result.stopped and result.checkpoint.name == "step-000003"


def test_an_error_raised_by_the_ui_callback_saves_then_propagates(tmp_path, make_model, make_data, make_config):
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    class Interrupted(Exception):
        pass

    def on_step(report):
        if report.step == 2:
            raise Interrupted

    with pytest.raises(Interrupted):
        train(make_config(steps=10), model, make_data(), run_dir=tmp_path / "int", on_step=on_step)
    assert state.load_checkpoint(tmp_path / "int").step == 2
    assert all("forward" not in m.__dict__ for m in model.modules())  # model restored after the error
    assert all((v == before[k]).all() for k, v in model.state_dict().items())


def test_resume_with_other_rank_is_refused_clearly(tmp_path, make_model, make_data, make_config):
    train_until(tmp_path / "rank", make_model(), make_data(), make_config(steps=2, checkpoint_every=2))
    with pytest.raises(ValueError, match="rank"):
        train(
            make_config(steps=4, rank=8), make_model(), make_data(), run_dir=tmp_path / "rank", resume=tmp_path / "rank"
        )


def test_checkpoint_lora_matches_run_result(make_model, make_data, make_config, tmp_path):
    from trainer.run.loop import train
    from trainer.run.state import checkpoint_history, checkpoint_lora, load_checkpoint

    cfg = make_config(steps=4, ema=True, checkpoint_every=0)
    result = train(cfg, make_model(), make_data(), run_dir=tmp_path)
    checkpoint = load_checkpoint(tmp_path)
    for mine, theirs in (
        (checkpoint_lora(checkpoint), result.lora),
        (checkpoint_lora(checkpoint, ema=True), result.ema_lora),
    ):
        assert set(mine) == set(theirs)
        for path in mine:
            np.testing.assert_array_equal(mine[path].B, theirs[path].B)
    assert checkpoint_history(checkpoint).loss == result.history.loss


def test_a_checkpoint_from_another_backend_is_refused_clearly(make_model, make_data, make_config, tmp_path):
    cfg = make_config(steps=2)
    train(cfg, make_model(), make_data(), run_dir=tmp_path)
    info_path = state.list_checkpoints(tmp_path)[-1][1] / "run.json"
    info = json.loads(info_path.read_text())
    info["backend"] = "mlx"
    info_path.write_text(json.dumps(info))
    with pytest.raises(ValueError, match="written by the mlx backend"):
        train(make_config(steps=4), make_model(), make_data(), run_dir=tmp_path, resume=tmp_path)


def test_list_runs_offers_runs_with_a_complete_checkpoint_newest_first(tmp_path):
    """What Load Run's picker and its error message offer: runs with a complete checkpoint only."""
    import os

    def checkpoint(run: str, step: int, complete: bool = True) -> None:
        folder = state.step_dir(tmp_path / run, step)
        folder.mkdir(parents=True)
        (folder / "state.safetensors").write_bytes(b"")
        if complete:
            (folder / "run.json").write_text("{}", encoding="utf-8")

    checkpoint("old", 100)
    checkpoint("new", 50)
    checkpoint("new", 250)
    checkpoint("new", 300, complete=False)  # being written, or killed mid-write
    checkpoint("crashed", 10, complete=False)
    os.utime(tmp_path / "old", (1_000_000, 1_000_000))
    assert state.list_runs(tmp_path) == [("new", 250), ("old", 100)]
    assert state.list_runs(tmp_path / "missing") == []
