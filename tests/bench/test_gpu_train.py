"""bench/gpu_train.py --tiny runs end to end: one Flux2 Klein and one Z-Image row, Kiln and ComfyUI's native
trainer, records appended to a JSON list. A smoke test of the harness, not a timing: it checks the record
keys and that step times and losses are finite. Needs a ComfyUI checkout (COMFYUI_PATH); the harness runs
in a subprocess (it sets ComfyUI up for itself and swaps the native node's ProgressBar while it runs).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import comfy_env

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
COMFY = comfy_env.require_comfy()  # skips (fails in CI) without COMFYUI_PATH

ROOT = Path(__file__).resolve().parents[2]
KEYS = (
    "date",
    "commit",
    "device",
    "torch",
    "arch",
    "resolution",
    "batch",
    "rank",
    "targets",
    "checkpointing",
    "compile",
    "kiln_s_per_step",
    "kiln_p95",
    "native_s_per_step",
    "mfu",
    "peak_alloc_gb",
    "peak_reserved_gb",
    "native_peak_alloc_gb",
    "native_peak_reserved_gb",
    "matmul_tflops",
    "model_tflop_per_step",
    "speedup_vs_native",
    "native_mfu",
    "native_forward_rows",
    "kiln_forward_rows",
)


def test_tiny_rows_run_and_record(tmp_path):
    path = COMFY
    out = tmp_path / "results.json"
    out.write_text(json.dumps([{"earlier": "record"}]), encoding="utf-8")  # appended to, not replaced
    env = {**os.environ, "COMFYUI_PATH": path}
    command = [
        sys.executable,
        str(ROOT / "bench" / "gpu_train.py"),
        "--tiny",
        "--device",
        "cpu",
        "--rows",
        "klein4b:64:1:on:default,zimage:64:2:on:all,klein4b:64:1:on:default:base=fp8q",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--no-checkpoint",  # the loop's final save skipped (a full fine-tune's is tens of GB); the run ends as ever
        "--out",
        str(out),
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    records = json.loads(out.read_text(encoding="utf-8"))
    assert records[0] == {"earlier": "record"} and len(records) == 4
    printed = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert printed == records[1:]
    for record, arch, batch, targets in zip(
        records[1:], ("klein4b", "zimage", "klein4b"), (1, 2, 1), ("default", "all", "default"), strict=True
    ):
        assert all(key in record for key in KEYS), sorted(set(KEYS) - set(record))
        assert (record["arch"], record["batch"], record["targets"], record["checkpointing"]) == (
            arch,
            batch,
            targets,
            True,
        )
        assert record["tiny"] and record["device"].startswith("cpu") and record["compile"] is False
        assert record["peak_alloc_gb"] is None and record["native_peak_reserved_gb"] is None  # CUDA-only
        assert record["kiln_error"] is None and record["native_error"] is None
        assert record["checkpoints"] == "none (--no-checkpoint)"
        assert record["native_checkpoint_depth"] == 2  # per block, as Kiln checkpoints
        for key in (
            "kiln_s_per_step",
            "kiln_p95",
            "native_s_per_step",
            "native_p95",
            "mfu",
            "native_mfu",
            "kiln_loss_first",
            "kiln_loss_last",
            "native_loss_first",
            "native_loss_last",
            "matmul_tflops",
            "model_tflop_per_step",
        ):
            assert isinstance(record[key], float) and math.isfinite(record[key]) and record[key] > 0, key
        assert record["kiln_loss_finite"] and record["native_loss_finite"]
        assert record["kiln_steps_timed"] == record["native_steps_timed"] == 2
        assert record["kiln_forward_rows"] == batch
        assert record["native_forward_rows"] == batch * batch  # native hands every caption the whole batch
        # From 0.25 the native node trains a deep copy rebuilt through cached_patcher_init (the bench's
        # patcher registers one, as ComfyUI's loaders do); its rows are counted on that copy. 0.19 added
        # quantized_backward, which the bench leaves off.
        assert record["native_deep_copy"] is comfy_env.at_least("0.25")
        assert record["native_quantized_backward"] is (False if comfy_env.at_least("0.19") else None)
    flux2, zimage, quantized = records[1:]
    # base=fp8q: the blocks as ComfyUI's own fp8 checkpoints store them (its mixed-precision Linear, no
    # nn.Linear): Kiln finds the same targets and trains; the loss starts where the fp32 model's does,
    # up to fp8 rounding. (On a CPU ComfyUI dequantizes: no quantized matmul, hence no QuantLinearFunc.)
    assert quantized["base_dtype"] == "fp8q" and quantized["weights_gb"] < 0.6 * flux2["weights_gb"]
    assert quantized["lora_modules"] == flux2["lora_modules"] and quantized["kiln_quant_linear_calls"] in (0, None)
    assert abs(quantized["kiln_loss_first"] - flux2["kiln_loss_first"]) < 0.05 * flux2["kiln_loss_first"]
    assert flux2["model_config"].startswith("comfy.model_detection")  # detected like a real Flux2 file
    assert flux2["text_tokens"] == 512 and zimage["image_tokens"] == 32  # 4x4 latent tokens padded to 32
    assert zimage["lora_modules"] > 30  # every Linear, not just the 5 default targets in each of the 6 blocks


WALL_ARGS = [
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
    "64,96",
    "--sample-size",
    "64",
    "--sample-steps",
    "1",
]


def test_tiny_whole_runs_of_kiln_and_native_record_their_phases(tmp_path):
    """bench/wall.py --tiny for Kiln and for ComfyUI's native node (bucket mode on Resolution Bucket's groups):
    one record each, every step timed and shaped, the phases adding up to at most the wall time; Kiln samples
    and checkpoints, native has neither."""
    out = tmp_path / "wall.json"
    env = {**os.environ, "COMFYUI_PATH": COMFY}
    for trainer in ("kiln", "native"):
        done = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "wall.py"), *WALL_ARGS, "--trainer", trainer, "--out", str(out)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kiln, native = json.loads(out.read_text(encoding="utf-8"))
    for record, trainer in ((kiln, "kiln"), (native, "native")):
        assert record["kind"] == "wall" and record["trainer"] == trainer and record["entries"] == 2
        assert len(record["step_seconds"]) == len(record["step_shapes"]) == 3 and record["loss_finite"]
        assert set(record["step_shapes"]) <= set(record["buckets"]) and all(v > 0 for v in record["step_seconds"])
        parts = record["steps_s"] + record["compile_warmup_s"] + (record["validation_s"] or 0) + record["saving_s"]
        assert 0 < parts <= record["wall_s"] + 0.2
    assert kiln["validation_s"] > 0 and kiln["validation_calls"] == 3 and kiln["kiln_settings"] == {}  # 0, 2, end
    assert kiln["saving_calls"] >= 2  # the checkpoint at step 2 and the LoRA
    assert native["validation_s"] is None and native["checkpoints"] is None and native["saving_calls"] == 1
    assert native["native_buckets"] == 2 and native["native_checkpoint_depth"] == 2
