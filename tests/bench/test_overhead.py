"""bench/overhead.py's loops train (2 steps each); nothing here is timed."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "overhead.py"


@pytest.fixture(scope="module")
def overhead():
    spec = importlib.util.spec_from_file_location("kiln_bench_overhead", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kiln_loop_trains(overhead, tmp_path):
    times, result = overhead.run_kiln(2, run_dir=tmp_path / "run")
    assert len(times) == 1
    assert len(result.history.loss) == 2 and all(math.isfinite(v) for v in result.history.loss)
    assert result.lora and all(np.abs(w.B).max() > 0 for w in result.lora.values())  # B starts at zero


@pytest.mark.parametrize("same_work", [False, True])
def test_plain_loop_trains(overhead, same_work):
    times, losses, lora = overhead.run_plain(2, same_work=same_work)
    assert len(times) == 1
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert lora and all(B.detach().abs().max() > 0 for _, B in lora.values())


def test_plain_loop_has_kilns_lora_targets_and_batch_shapes(overhead):
    """Same Linears get a branch, same rank, same batch order (hence shapes) as Kiln."""
    _, result = overhead.run_kiln(2)
    plain = overhead.PlainLoop(2)
    assert sorted(plain.lora) == sorted(result.lora)
    assert all(A.shape == result.lora[path].A.shape for path, (A, _) in plain.lora.items())
    from trainer.data.sampler import BucketSampler

    cfg = overhead.bench_config(2)
    sampler = BucketSampler(overhead.bench_data().buckets, cfg.batch_size, cfg.seed)
    assert plain.order == [sampler.next() for _ in range(2)]


def test_paired_run_and_record(overhead, tmp_path):
    kiln, (plain, same) = overhead.run_paired(3, same_work=(False, True))
    assert len(kiln) == len(plain) == len(same) == 2
    path = tmp_path / "results.json"
    overhead.append({"ratio": 1.0}, path)
    overhead.append({"ratio": 2.0}, path)
    assert [r["ratio"] for r in json.loads(path.read_text())] == [1.0, 2.0]
