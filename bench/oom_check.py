"""Out-of-memory check on a real GPU (not run by tests): a real CUDA OOM mid-run is caught, the last good
step is saved and resumable, the message names the fix, and the memory comes back.

The tiny DiT trains on two buckets, 32×32 latents and 256×256 ones; the process is capped with
torch.cuda.set_per_process_memory_fraction so the first large batch runs out of memory (checkpointing
off, batch 4). Expect: trainer.run.faults.OutOfMemory naming "resolutions" and a step-NNNNNN checkpoint;
allocated memory after the error back near the baseline; a resume on the small bucket alone finishing.
Run: python bench/oom_check.py [--fraction 0.02]. Prints one JSON record; exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer import config as config
from trainer.data import InMemoryData  # noqa: E402
from trainer.demo.tiny_dit import build_tiny_flux  # noqa: E402
from trainer.run import (
    faults,
    state,  # noqa: E402
)
from trainer.run.loop import train  # noqa: E402


def data(sizes):
    rng = np.random.default_rng(0)
    latents = [rng.standard_normal((16, s, s)).astype(np.float32) for s in sizes]
    contexts = [rng.standard_normal((8, 32)).astype(np.float32) for _ in sizes]
    return InMemoryData.from_arrays(
        latents, contexts, [f"{s}px_{i}.png" for i, s in enumerate(sizes)], np.zeros((8, 32), np.float32)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fraction", type=float, default=0.02, help="share of GPU memory this process may use")
    args = parser.parse_args()
    torch.cuda.set_per_process_memory_fraction(args.fraction)
    cfg = config.from_dict(
        dict(
            arch="demo",
            device="cuda",
            mixed_precision="bf16",
            steps=40,
            batch_size=4,
            rank=16,
            alpha=16.0,
            learning_rate=1e-4,
            resolutions=[64],
            caption_dropout=0.0,
            gradient_checkpointing=False,
            checkpoint_every=0,
            log_every=5,
        )
    )
    model = build_tiny_flux(0, hidden=256, heads=4, double_blocks=4, single_blocks=4).cuda().to(torch.bfloat16)
    record: dict = {"device": torch.cuda.get_device_name(), "fraction": args.fraction}
    # The baseline is what a finished small run leaves: cuBLAS keeps its workspaces (32 MiB each on an
    # H100) in torch's allocator from the first matmul on, and they are not a leak of the OOM path.
    with tempfile.TemporaryDirectory() as folder:
        train(config.replace(cfg, steps=2), model, data([32] * 8), run_dir=folder)
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    with tempfile.TemporaryDirectory() as folder:
        try:
            train(cfg, model, data([32] * 8 + [256] * 8), run_dir=folder)
            record["error"] = None
        except faults.OutOfMemory as error:
            record["error"] = str(error)
        gc.collect()
        torch.cuda.empty_cache()
        record["allocated_after_mib"] = (torch.cuda.memory_allocated() - baseline) / 2**20
        found = state.list_checkpoints(folder)
        record["checkpoint_step"] = found[-1][0] if found else None
        if found:
            resumed = train(
                config.replace(cfg, steps=found[-1][0] + 5), model, data([32] * 8), run_dir=folder, resume=folder
            )
            record["resumed_to"] = resumed.step
    checks = [
        record["error"] is not None and "resolutions" in record["error"],
        record["allocated_after_mib"] < 8,
        record.get("resumed_to") in (None, (record["checkpoint_step"] or 0) + 5),
    ]
    record["ok"] = all(checks)
    print(json.dumps(record, indent=1))
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
