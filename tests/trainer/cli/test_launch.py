"""trainer/cli/launch.py (#22): a torchrun run of two gloo ranks on the CPU as a child process, its progress
read from rank 0's KILN_PROGRESS lines, Stop as a clean checkpoint on every rank, then resumed."""

from __future__ import annotations

import sys

import pytest
import torch

from trainer.cli import launch
from trainer.lora.files import load_lora
from trainer.run import state

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or sys.platform == "win32",
    reason="needs torch.distributed with gloo (Linux, macOS)",
)


STEPS = 60  # Stop is asked at step 3: the ranks are still training when torchrun forwards it


def demo_config(dataset, steps: int) -> dict:
    return {
        "arch": "demo",
        "device": "cpu",
        "mixed_precision": "no",
        "steps": steps,
        "batch_size": 1,
        "rank": 4,
        "alpha": 4.0,
        "resolutions": [64],
        "checkpoint_every": 20,
        "log_every": 1,
        "dataset_dir": str(dataset),
    }


def test_parse_line_reads_only_the_tagged_lines():
    assert launch.parse_line('KILN_PROGRESS {"step": 3, "loss": 0.5}') == ("progress", {"step": 3, "loss": 0.5})
    assert launch.parse_line('KILN_DONE {"lora": "/a.safetensors"}') == ("done", {"lora": "/a.safetensors"})
    assert launch.parse_line(" 30%|###   | 3/10 [00:01<00:02]") is None
    assert launch.parse_line("KILN_PROGRESS {broken") is None
    assert launch.parse_line(' 10%|#  | 1/10 KILN_PROGRESS {"step": 1}') == ("progress", {"step": 1})
    assert launch.parse_line('KILN_SAMPLE {"step": 2, "index": 0, "path": "/r/samples/step-000002-p0.png"}') == (
        "sample",
        {"step": 2, "index": 0, "path": "/r/samples/step-000002-p0.png"},
    )
    assert launch.parse_line('KILN_PAUSED {"paused": true, "step": 4}') == ("paused", {"paused": True, "step": 4})
    assert launch.parse_line('KILN_PLAN {"lines": ["memory plan: x"]}') == ("plan", {"lines": ["memory plan: x"]})


def test_pause_writes_the_pause_file_and_resume_removes_it(tmp_path):
    run_dir = tmp_path / "r"
    run = launch.Launch({"arch": "demo", "device": "cpu"}, run_dir, processes=2)
    run_dir.mkdir()
    run.pause(True)
    assert (run_dir / "PAUSE").is_file() and run.pausing
    run.pause(False)
    assert not (run_dir / "PAUSE").exists() and not run.pausing


def test_bad_gpus_and_processes_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"gpus '0,x'.*e\.g\. '0,1'"):
        launch.Launch({"arch": "demo"}, tmp_path / "r", processes=2, gpus="0,x")
    with pytest.raises(ValueError, match=r"names 1 GPU\(s\) for 2 processes"):
        launch.Launch({"arch": "demo"}, tmp_path / "r", processes=2, gpus="3")
    assert launch.environment([2, 3])["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_two_ranks_report_progress_stop_with_a_checkpoint_and_resume(tmp_path):
    from trainer.demo.run import make_dataset

    make_dataset(tmp_path / "shapes")
    run_dir = tmp_path / "runs" / "r"
    steps: list[int] = []
    plans: list[dict] = []
    run = launch.Launch(demo_config(tmp_path / "shapes", STEPS), run_dir, processes=2).start()
    stopped = run.wait(
        on_progress=lambda p: steps.append(p["step"]), should_stop=lambda: len(steps) >= 3, on_plan=plans.append
    )
    # Rank 0 alone says its plan, once, before its first step.
    assert len(plans) == 1 and plans[0]["lines"][0].startswith("memory plan: "), plans
    # The stop file, not Ctrl-C: the ranks saved and exited 0 by themselves, and the request was removed.
    assert stopped.stopped and stopped.returncode == 0 and stopped.checkpoint is not None, stopped.tail
    assert "stop requested" in stopped.tail and "Ctrl-C again" not in stopped.tail
    assert not (run_dir / "stop.request").exists()
    assert (run_dir / launch.CONFIG_NAME).is_file()
    # Stop reached both ranks after the same step; rank 0 saved that step and the LoRA of it.
    assert 3 <= stopped.step < STEPS and steps[:3] == [1, 2, 3], (steps, stopped.tail)
    assert state.load_checkpoint(run_dir).info["world_size"] == 2
    assert stopped.lora is not None and load_lora(stopped.lora)

    steps.clear()
    resumed = launch.Launch(demo_config(tmp_path / "shapes", STEPS), run_dir, processes=2).start(resume=True)
    finished = resumed.wait(on_progress=lambda p: steps.append(p["step"]))
    assert finished.returncode == 0 and not finished.stopped, finished.tail
    assert finished.step == STEPS and steps[0] == stopped.step + 1 and steps[-1] == STEPS, steps
    assert finished.lora == run_dir / "r.safetensors" and finished.lora.is_file()
    assert len(state.load_checkpoint(run_dir).info["history"]["loss"]) == STEPS
