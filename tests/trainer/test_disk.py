"""Full disks and failed writes: free space is checked first, a half-written file never replaces a
good one, and pruning makes room without ever leaving zero complete checkpoints."""

from __future__ import annotations

import errno
import os
import shutil
from collections import namedtuple

import numpy as np
import pytest

from trainer import atomic, safetensors_io
from trainer.atomic import NotEnoughSpace
from trainer.lora import files as lora_format
from trainer.run import state
from trainer.run.loop import train

Usage = namedtuple("Usage", "total used free")


def fake_disk(monkeypatch, free_bytes):
    """shutil.disk_usage reporting `free_bytes()` free (a callable, so a test can fill the disk later)."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - free_bytes(), free_bytes()))


def test_a_full_disk_stops_before_a_checkpoint_and_keeps_the_last(
    tmp_path, monkeypatch, make_model, make_data, make_config
):
    full = []
    fake_disk(monkeypatch, lambda: 1000 if full else 10**11)
    with pytest.raises(NotEnoughSpace) as error:
        train(
            make_config(steps=6, checkpoint_every=2),
            make_model(),
            make_data(),
            run_dir=tmp_path / "run",
            on_step=lambda report: full.append(1) if report.step == 3 else None,
        )
    message = str(error.value)
    assert str(tmp_path / "run") in message and "step-000004" in message
    assert "1,000 bytes" in message and "needs" in message and "keep_checkpoints" in message
    assert [step for step, _ in state.list_checkpoints(tmp_path / "run")] == [2]
    assert state.load_checkpoint(tmp_path / "run").step == 2
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-000002"]  # no temp folder left


def test_a_full_disk_refuses_a_lora_save_and_keeps_the_old_file(tmp_path, monkeypatch):
    lora = {
        "double_blocks.0.img_attn.qkv": lora_format.LoraWeights(
            A=np.ones((4, 32), np.float32), B=np.zeros((96, 4), np.float32), alpha=4.0
        )
    }
    path = tmp_path / "loras" / "mine.safetensors"
    lora_format.save_lora(path, lora, arch="demo", metadata={"v": "old"})
    before = path.read_bytes()
    fake_disk(monkeypatch, lambda: 100)
    with pytest.raises(
        NotEnoughSpace, match=r"mine\.safetensors needs [\d,]+ bytes but the disk has 100 bytes free"
    ) as error:
        lora_format.save_lora(path, lora, arch="demo", metadata={"v": "new"})
    assert str(path.parent) in str(error.value) and "free space" in str(error.value)
    assert path.read_bytes() == before and os.listdir(path.parent) == ["mine.safetensors"]


def test_free_space_check_against_the_real_disk(tmp_path):
    atomic.require_free_space(tmp_path, 1000, "a small file", "n/a")  # passes: there is room
    with pytest.raises(
        NotEnoughSpace, match=r"a huge file needs 1,152,921,504,606,846,976 bytes \(1073741824\.0 GiB\)"
    ):
        atomic.require_free_space(tmp_path / "not" / "made", 2**60, "a huge file", "use a bigger disk")


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_pruning_first_never_needs_keep_plus_one(tmp_path, monkeypatch, make_model, make_data, make_config, keep):
    """At every file write of a checkpoint, count the complete checkpoints on disk."""
    counts, real_write = [], safetensors_io.write

    def counting_write(path, *args, **kwargs):
        if ".tmp-step-" in str(path):
            counts.append(len(state.list_checkpoints(tmp_path / "run")))
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(safetensors_io, "write", counting_write)
    train(
        make_config(steps=10, checkpoint_every=1, keep_checkpoints=keep),
        make_model(),
        make_data(),
        run_dir=tmp_path / "run",
    )
    assert len(counts) == 20 and counts[:2] == [0, 0]  # two files per checkpoint
    assert max(counts) == max(keep - 1, 1)  # room for the new one only
    assert min(counts[2:]) >= 1  # never zero once one exists
    assert len(state.list_checkpoints(tmp_path / "run")) == keep


def test_a_write_that_fails_half_way_keeps_the_old_file(tmp_path):
    path = tmp_path / "lora.safetensors"
    safetensors_io.write(path, {"x": np.ones(4, np.float32)})
    before = path.read_bytes()

    def half_then_full(handle):
        handle.write(b"\x00" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic.atomic_write(path, half_then_full)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["lora.safetensors"]


def test_a_checkpoint_that_fails_half_way_leaves_nothing_and_the_next_save_works(
    tmp_path, monkeypatch, make_model, make_data, make_config
):
    real_write = safetensors_io.write
    failures = []

    def write_then_fail(path, *args, **kwargs):
        if str(path).endswith("state.safetensors") and "step-000004" in str(path) and not failures:
            failures.append(path)
            real_write(path, *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(safetensors_io, "write", write_then_fail)
    cfg = make_config(steps=6, checkpoint_every=2, keep_checkpoints=2)
    with pytest.raises(OSError, match="No space"):
        train(cfg, make_model(), make_data(), run_dir=tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-000002"]
    result = train(cfg, make_model(), make_data(), run_dir=tmp_path / "run", resume=tmp_path / "run")
    assert result.step == 6 and [s for s, _ in state.list_checkpoints(tmp_path / "run")] == [4, 6]


def test_the_same_step_saved_again_replaces_it_whole(tmp_path, make_model, make_data, make_config):
    cfg = make_config(steps=2, checkpoint_every=2)
    train(cfg, make_model(), make_data(), run_dir=tmp_path / "run")
    checkpoint = state.load_checkpoint(tmp_path / "run")
    (checkpoint.path / "marker").write_text("old")
    train(cfg, make_model(), make_data(), run_dir=tmp_path / "run")  # step 2 again, from 0
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-000002"]
    assert not (checkpoint.path / "marker").exists() and state.load_checkpoint(tmp_path / "run").step == 2


def test_a_folder_where_a_file_goes_is_refused(tmp_path):
    (tmp_path / "out.safetensors").mkdir()
    with pytest.raises(IsADirectoryError, match="is a folder; give a file name"):
        safetensors_io.write(tmp_path / "out.safetensors", {"x": np.ones(1, np.float32)})
