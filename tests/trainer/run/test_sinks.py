"""TensorBoard and Weights & Biases logging (trainer/run/sinks.py), with the real packages on CPU.

Each test skips, saying why, where its package is not installed (pip install tensorboard / wandb:
both are in the `test` extra)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from trainer.run import sinks as logging_sinks
from trainer.run.loop import train


def _validate(step, lora):
    """A stand-in sampler: one 8×8 image whose brightness is the step (so each logged image is told apart)."""
    return [np.full((8, 8, 3), min(step / 10, 1.0), np.float32)]


def _events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_scalars_images_config_and_resume(tmp_path, make_model, make_data, make_config):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    run = tmp_path / "run"
    cfg = make_config(steps=6, log_every=2, checkpoint_every=3, log_tensorboard=True)
    train(cfg, make_model(), make_data(), run_dir=run, validate=_validate, validate_every=3, should_stop=lambda: False)
    acc = _events(run / logging_sinks.TENSORBOARD_DIR)
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in acc.Scalars("learning_rate")] == [1, 2, 3, 4, 5, 6]
    assert {"grad_norm"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Images("validation/0")] == [3, 6]
    assert "config" in "".join(acc.Tags()["tensors"])
    first = [e.value for e in acc.Scalars("loss")]

    # Resume from step 3 (the run's step-3 checkpoint): steps 4..6 are logged again, not twice.
    import shutil

    from trainer.run.state import step_dir

    shutil.rmtree(step_dir(run, 6))
    train(
        make_config(steps=6, log_every=2, checkpoint_every=3, log_tensorboard=True),
        make_model(),
        make_data(),
        run_dir=run,
        resume=step_dir(run, 3),
        validate=_validate,
        validate_every=3,
    )
    acc = _events(run / logging_sinks.TENSORBOARD_DIR)
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([e.value for e in acc.Scalars("loss")], first, rtol=1e-5)  # exact resume
    assert [e.step for e in acc.Images("validation/0")] == [3, 6]


def test_tensorboard_gets_the_samples_before_the_first_step(tmp_path, make_model, make_data, make_config):
    """validate_first (headless sample_first): step 0's images reach the event file on a new run; a resumed
    run does not sample its start again."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    run, seen = tmp_path / "run", []

    def validate(step, lora):
        seen.append(step)
        return _validate(step, lora)

    cfg = make_config(steps=4, log_every=2, checkpoint_every=2, log_tensorboard=True)
    train(cfg, make_model(), make_data(), run_dir=run, validate=validate, validate_every=2, validate_first=True)
    assert seen == [0, 2, 4]
    images = _events(run / logging_sinks.TENSORBOARD_DIR).Images("validation/0")
    assert [e.step for e in images] == [0, 2, 4]
    assert len({e.encoded_image_string for e in images}) == 3  # each step's own image

    import shutil

    from trainer.run.state import step_dir

    shutil.rmtree(step_dir(run, 4))
    seen.clear()
    train(
        cfg,
        make_model(),
        make_data(),
        run_dir=run,
        resume=step_dir(run, 2),
        validate=validate,
        validate_every=2,
        validate_first=True,
    )
    assert seen == [4]
    assert [e.step for e in _events(run / logging_sinks.TENSORBOARD_DIR).Images("validation/0")] == [0, 2, 4]


def test_wandb_offline_run_files(tmp_path, make_model, make_data, make_config, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    cfg = make_config(steps=4, log_every=2, wandb_project="kiln-test")
    train(cfg, make_model(), make_data(), run_dir=run, validate=_validate, validate_every=2)
    runs = sorted((run / logging_sinks.WANDB_DIR).glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].name.endswith(logging_sinks.run_id(run))
    from wandb.proto import wandb_internal_pb2

    steps, config, images = [], {}, 0
    for record in _finished_wandb_records(next(runs[0].glob("*.wandb")), wandb_internal_pb2.Record):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            steps.append(int(items["_step"]))
            images += "validation/filenames" in items  # wandb.Image list: nested keys
            assert "loss" in items
        elif record.WhichOneof("record_type") == "config":
            config.update({item.key: item.value_json for item in record.config.update})
    assert steps == [1, 2, 3, 4] and images == 2
    assert config["rank"] == str(cfg.rank)


def _finished_wandb_records(path, record_type, wait_s: float = 60.0) -> list:
    """The records of a run's .wandb file once W&B's writer (a service process of its own) has written the run's
    exit record: finish() can return while the service still flushes, which a loaded CI machine showed
    (history records missing from a file read at once). A condition waited for, not a timing asserted."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        from google.protobuf.message import DecodeError

        records = []
        try:
            for data in _wandb_records(path):
                record = record_type()
                record.ParseFromString(data)
                records.append(record)
        except DecodeError:  # a record still being written
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _wandb_records(path):
    """The records of a .wandb file: a 7-byte W&B header, then LevelDB's log format (32 KiB blocks of
    chunks, each with a 7-byte header: crc32c, length, type 1 full / 2 first / 3 middle / 4 last)."""
    data, out, pending, block = path.read_bytes(), [], b"", 32768
    position = 7
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        chunk, position = data[position + 7 : position + 7 + length], position + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            out.append(pending)
    return out


def test_missing_package_names_pip(monkeypatch, tmp_path, make_config):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install wandb"):
        logging_sinks.open_sinks(make_config(wandb_project="p"), tmp_path, 0)


def test_only_the_main_rank_opens_sinks(tmp_path, make_config):
    sinks = logging_sinks.open_sinks(make_config(log_tensorboard=True, wandb_project="p"), tmp_path, 0, main=False)
    assert sinks.sinks == [] and not (tmp_path / logging_sinks.TENSORBOARD_DIR).exists()
