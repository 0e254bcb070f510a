"""Killed processes: `python -m trainer demo` SIGKILLed at 20+ moments, then resumed, ends bit for bit
where an uninterrupted run ends.

Deterministic kills go through the test-only hook in trainer/atomic.py (KILN_FAULT=<glob> SIGKILLs the
process at a labelled point: a file written to its temp name but not renamed, a checkpoint half built,
complete but not renamed, renamed but not pruned, an old one half deleted). Random kills come at seeded
moments of the run. After every kill, each checkpoint the resume rule can pick must load completely and
no more than keep_checkpoints are on disk. One thread per process keeps the run short and exact.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from trainer import safetensors_io
from trainer.run import state

ROOT = Path(__file__).resolve().parents[3]
STEPS, EVERY, KEEP = 8, 2, 2  # checkpoints at 2, 4, 6, 8; the demo keeps 2
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
ENV.pop("KILN_FAULT", None)

# One process per entry, in order; each resumes what the one before left. Globs over the labels.
FAULTS = [
    "write:*/shape_05.png",  # half the generated dataset written
    "write:*/.kiln_cache/latents/*",  # the first cached latent
    "write:*/.kiln_cache/text/*",  # the first cached text embedding
    "checkpoint:2:pruned",  # nothing of step 2 written yet
    "write:*/.tmp-step-000002-*/lora.safetensors",  # inside the temp folder, file by file
    "write:*/.tmp-step-000002-*/state.safetensors",
    "write:*/.tmp-step-000002-*/run.json",
    "checkpoint:2:complete",  # complete, not yet renamed
    "checkpoint:2:renamed",  # step 2 in place, not yet pruned
    "checkpoint:4:renamed",
    "checkpoint:6:pruning",  # step 2 half deleted
    "write:*/.tmp-step-000006-*/state.safetensors",
    "checkpoint:6:renamed",
    "checkpoint:8:complete",
]
# Then: a stop at step 7 writes demo_lora.safetensors; the next process is killed while it writes
# the final one over it, and the old file must still be whole.
LATE_FAULTS = ["write:*/demo_lora.safetensors", "write:*/loss.png"]
RANDOM_KILLS = 7

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL (POSIX)")


def start(out: Path, *, fault: str | None = None, resume: bool = True, extra=()) -> subprocess.Popen:
    env = dict(ENV, KILN_FAULT=fault) if fault else ENV
    args = [
        sys.executable,
        "-m",
        "trainer",
        "demo",
        "--output",
        str(out),
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        str(EVERY),
        *(["--resume"] if resume else []),
        *extra,
    ]
    with open(out.parent / f"{out.name}.log", "ab") as log:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, out: Path) -> int:
    return proc.wait(timeout=300)


def log_tail(out: Path) -> str:
    return (out.parent / f"{out.name}.log").read_text(errors="replace")[-3000:]


def check_on_disk(run_dir: Path) -> None:
    """What a resume can pick is whole; at most KEEP complete checkpoints; no visible half folder."""
    found = state.list_checkpoints(run_dir)
    assert len(found) <= KEEP, found
    for step, path in found:
        checkpoint = state.load_checkpoint(path)
        assert checkpoint.step == step
        safetensors_io.read(path / "lora.safetensors")
    visible = {p.name for p in run_dir.glob("step-*")} if run_dir.is_dir() else set()
    assert visible == {p.name for _, p in found}, visible


def steps_on_disk(run_dir: Path) -> list[int]:
    return [step for step, _ in state.list_checkpoints(run_dir)]


def final_files(run_dir: Path):
    tensors, _ = safetensors_io.read(run_dir / f"step-{STEPS:06d}" / "state.safetensors")
    info = state.load_checkpoint(run_dir / f"step-{STEPS:06d}").info
    lora, _ = safetensors_io.read(run_dir / "demo_lora.safetensors")
    return tensors, info, lora


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "out"
    out.mkdir()
    began = time.monotonic()
    code = finish(start(out, resume=False), out)
    assert code == 0, log_tail(out)
    return final_files(out / "demo"), time.monotonic() - began


def assert_same_as(reference, run_dir: Path) -> None:
    (ref_tensors, ref_info, ref_lora), _ = reference
    tensors, info, lora = final_files(run_dir)
    assert set(tensors) == set(ref_tensors)
    for key in ref_tensors:
        assert np.array_equal(tensors[key], ref_tensors[key]), key
    assert info["history"] == ref_info["history"] and info["numpy_rng"] == ref_info["numpy_rng"]
    assert info["cursor"] == ref_info["cursor"]
    assert set(lora) == set(ref_lora) and all(np.array_equal(lora[k], ref_lora[k]) for k in ref_lora)


def test_kills_at_every_stage_of_a_save_resume_exactly(tmp_path, reference):
    out = tmp_path / "out"
    out.mkdir()
    run_dir = out / "demo"
    for index, fault in enumerate(FAULTS):
        code = finish(start(out, fault=fault, resume=index > 0), out)
        assert code == -signal.SIGKILL, f"{fault}: the hook never fired (exit {code})\n{log_tail(out)}"
        check_on_disk(run_dir)
    assert steps_on_disk(run_dir) == [6]  # step 8 was killed before its rename: not there
    assert finish(start(out, extra=["--stop-after", "7"]), out) == 0, log_tail(out)
    assert steps_on_disk(run_dir) == [6, 7]
    code = finish(start(out, fault=LATE_FAULTS[0]), out)
    assert code == -signal.SIGKILL, log_tail(out)
    _, metadata = safetensors_io.read(run_dir / "demo_lora.safetensors")
    assert metadata["kiln.steps"] == "7"  # the old LoRA is still there, whole
    code = finish(start(out, fault=LATE_FAULTS[1]), out)
    assert code == -signal.SIGKILL, log_tail(out)
    assert finish(start(out), out) == 0, log_tail(out)
    check_on_disk(run_dir)
    assert_same_as(reference, run_dir)


def test_random_kills_resume_exactly(tmp_path, reference):
    """Kills at seeded moments; a chain that finishes before the next kill is checked, then begun anew."""
    out = tmp_path / "out"
    out.mkdir()
    run_dir = out / "demo"
    _, duration = reference
    rng = np.random.default_rng(2024)
    kills = attempts = 0
    while kills < RANDOM_KILLS and attempts < 4 * RANDOM_KILLS:
        attempts += 1
        proc = start(out, resume=run_dir.exists())
        try:
            proc.wait(timeout=float(rng.uniform(0.1, 0.9)) * duration)
        except subprocess.TimeoutExpired:
            proc.kill()
        code = finish(proc, out)
        assert code in (0, -signal.SIGKILL), log_tail(out)
        check_on_disk(run_dir)
        if code == 0:
            assert_same_as(reference, run_dir)
            shutil.rmtree(run_dir)
        kills += code == -signal.SIGKILL
    assert kills == RANDOM_KILLS
    assert finish(start(out, resume=run_dir.exists()), out) == 0, log_tail(out)
    assert_same_as(reference, run_dir)
