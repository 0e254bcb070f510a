"""bench/gpu_ranks.py (gpu_train.py under torchrun) on a CPU: its figures as functions, and the harness itself
under `torchrun --nproc_per_node 2` with gloo ranks (COMFYUI_PATH; the device machine runs it on GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_ranks  # noqa: E402
from gpu_train import Row  # noqa: E402
from helpers import comfy_env  # noqa: E402
from helpers.distributed import free_port  # noqa: E402

from trainer.run import distributed  # noqa: E402

ROW = Row("zimage", 1024, 1, True, "default", {"sharding": "shard"})


def test_efficiency_is_n_gpus_images_per_s_over_n_times_one_gpus():
    assert gpu_ranks.images_per_s(2, 0.5) == 4.0 and gpu_ranks.images_per_s(2, None) is None
    assert gpu_ranks.efficiency(3.6, 2.0, 2) == pytest.approx(0.9)
    assert gpu_ranks.efficiency(3.6, None, 2) is None and gpu_ranks.efficiency(None, 2.0, 2) is None
    assert gpu_ranks.curve_difference([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)
    assert gpu_ranks.curve_difference([1.0], None) is None


def test_the_record_adds_the_several_gpu_figures_to_the_n_rank_pass():
    together = {"kiln_s_per_step": 0.5, "kiln_loss_curve": [1.0, 0.8], "sharding": "shard"}
    solo = {"kiln_s_per_step": 0.45, "kiln_loss_curve": [1.1], "peak_alloc_gb": 30.0, "extra": 1}
    record = gpu_ranks.record_of(together, ROW, 2, solo, {"kiln_loss_curve": [1.0, 0.79]}, "alone")
    assert record["world_size"] == 2 and record["global_batch"] == 2 and record["sharding"] == "shard"
    assert record["images_per_s"] == 4.0 and record["one_gpu_images_per_s"] == pytest.approx(2.2222, abs=1e-4)
    assert record["scaling_efficiency"] == pytest.approx(0.9) and record["baseline"] == "alone"
    assert record["one_gpu_peak_alloc_gb"] == 30.0 and "one_gpu_extra" not in record
    assert record["one_process_loss_curve"] == [1.0, 0.79]
    assert record["loss_rel_diff_vs_one_process"] == pytest.approx(0.012658, abs=1e-6)
    bare = gpu_ranks.record_of(together, ROW, 2, None, None, "alone")
    assert bare["scaling_efficiency"] is None and bare["baseline"] is None and bare["one_process_loss_curve"] is None


def test_a_baseline_file_gives_the_newest_one_process_record_of_the_same_row(tmp_path):
    same = {"arch": "zimage", "resolution": 1024, "batch": 1, "targets": "default", "kiln_settings": {}}
    records = [
        {**same, "kiln_s_per_step": 0.6},
        {**same, "kiln_s_per_step": 0.5},
        {**same, "kiln_s_per_step": 0.4, "world_size": 2},  # a several-GPU record is no baseline
        {**same, "kiln_s_per_step": 0.3, "batch": 2},
        {**same, "kiln_s_per_step": 0.2, "kiln_settings": {"compile_blocks": False}},
        {**same, "kiln_s_per_step": None},  # a failed row
    ]
    path = tmp_path / "results.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    assert gpu_ranks.baseline_from(path, ROW, (1024, 1))["kiln_s_per_step"] == 0.5  # sharding: not a setting of one
    assert gpu_ranks.baseline_from(path, ROW, (512, 1)) is None


def test_alone_hides_the_group_from_kilns_distributed_helpers(monkeypatch):
    monkeypatch.setattr(distributed, "current", lambda: distributed.Group(1, 2))
    with gpu_ranks.alone(distributed):
        assert distributed.current() is distributed.SINGLE and distributed.start("cpu") is distributed.SINGLE
    assert distributed.current() == distributed.Group(1, 2)


def test_every_ranks_peaks_are_gathered_in_rank_order():
    fake = SimpleNamespace(gather_arrays=lambda mine: [mine, {k: v + 1 for k, v in mine.items()}])
    figures = gpu_ranks.gathered(fake, {"peak_alloc_gb": 10.0, "peak_reserved_gb": None})  # None: NaN on the wire
    assert figures == {"peak_alloc_gb_per_gpu": [10.0, 11.0], "peak_reserved_gb_per_gpu": [None, None]}


@pytest.mark.comfyui
def test_the_harness_under_torchrun_records_two_ranks_against_one_process(tmp_path):
    """Two gloo ranks: a replicated Z-Image row (rank 0 alone first: one GPU's images/s) and a sharded Klein row
    (its ComfyUI blocks split by FSDP2), each with the loss curve of one process at the global batch."""
    path = comfy_env.require_comfy()
    out = tmp_path / "results.json"
    env = {**os.environ, "COMFYUI_PATH": path, "OMP_NUM_THREADS": "1"}
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())),
        *(str(ROOT / "bench" / "gpu_train.py"), "--tiny", "--device", "cpu", "--steps", "3", "--warmup", "1"),
        *("--rows", "zimage:64:1:on:default,klein4b:64:1:on:default:sharding=shard", "--out", str(out)),
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    replicated, sharded = json.loads(out.read_text(encoding="utf-8"))  # rank 0 alone wrote them
    for record, sharding in ((replicated, "replicate"), (sharded, "shard")):
        assert record["world_size"] == 2 and record["global_batch"] == 2 and record["sharding"] == sharding
        assert record["kiln_error"] is None and record["images_per_s"] > 0
        assert record["scaling_efficiency"] > 0 and record["baseline"] == "alone"
        assert len(record["peak_alloc_gb_per_gpu"]) == 2  # None on a CPU, every rank's on GPUs
        assert record["host_noise_ms_share"] >= 0 and record["host_noise_ms_global"] >= 0
        # two ranks at batch 1 train what one process at batch 2 trains (the curve: means of 10 steps)
        assert record["loss_rel_diff_vs_one_process"] < 1e-4, (
            record["kiln_loss_curve"],
            record["one_process_loss_curve"],
        )
