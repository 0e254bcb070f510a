"""bench/wall.py's diffusers + PEFT peer (bench/wall_peers.py) runs end to end on a CPU: diffusers' own
Z-Image transformer at test size with a PEFT LoRA, shuffled epochs over the bucket entries, a checkpoint
and samples every --every steps, the LoRA saved. A smoke test of the harness, not a timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from wall_peers import entry_order


def test_entries_come_in_shuffled_epochs():
    order = entry_order(5, 13, seed=3)
    assert len(order) == 13
    assert sorted(order[:5]) == sorted(order[5:10]) == list(range(5)) and order[:5] != order[5:10]
    assert entry_order(5, 13, seed=3) == order


def test_the_diffusers_peer_trains_samples_and_saves(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    out = tmp_path / "wall.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "wall.py"),
            "--trainer",
            "diffusers",
            "--tiny",
            "--device",
            "cpu",
            "--arch",
            "zimage",
            "--steps",
            "3",
            "--every",
            "2",
            "--images",
            "1",
            "--res",
            "256",
            "--sample-size",
            "128",
            "--sample-steps",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (record,) = json.loads(out.read_text(encoding="utf-8"))
    assert record["trainer"] == "diffusers" and record["checkpoints"] == 1 and record["loss_finite"]
    assert len(record["step_seconds"]) == 3 and record["validation_s"] > 0
    assert record["validation_calls"] == 2 and record["saving_calls"] == 2  # before step 1 and at 2; at 2 and the LoRA
    assert 0 < record["peer_lora_params"] < record["peer_params"]
    assert (
        record["steps_s"] + record["compile_warmup_s"] + record["validation_s"] + record["saving_s"]
        <= record["wall_s"] + 0.2
    )
