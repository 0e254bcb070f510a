#!/usr/bin/env python3
"""The several-GPU launcher (trainer/cli/launch.py, what Kiln Train LoRA (several GPUs) runs) on real GPUs:
`processes` ranks of `torchrun -m trainer train` on the demo arch in CUDA, a stop request at step
`--stop-at` (the stop file: every rank checkpoints the same step and exits 0), then a resume to the end.
Prints one JSON line: what each phase returned and how long it took.

    python bench/launch_check.py --processes 1            # the single-GPU machine
    python bench/launch_check.py --processes 2 --gpus 0,1 # two GPUs (NCCL)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.cli import launch
from trainer.demo.run import make_dataset


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--gpus", default="")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--stop-at", type=int, default=60)
    parser.add_argument("--device", default="cuda", help="cpu: the same path on this machine (gloo)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-launch-"))
    make_dataset(work / "shapes")
    config = {
        "arch": "demo",
        "device": args.device,
        "steps": args.steps,
        "batch_size": 2,
        "rank": 8,
        "alpha": 8.0,
        "resolutions": [256],
        "checkpoint_every": 100,
        "log_every": 10,
        "dataset_dir": str(work / "shapes"),
    }
    run_dir, record, steps = work / "runs" / "check", {"processes": args.processes, "gpus": args.gpus}, []

    def on_progress(fields: dict) -> None:
        steps.append(fields["step"])

    started = time.perf_counter()
    first = launch.Launch(config, run_dir, processes=args.processes, gpus=args.gpus).start()
    outcome = first.wait(on_progress, should_stop=lambda: bool(steps) and steps[-1] >= args.stop_at)
    record.update(
        stopped_rc=outcome.returncode,
        stopped=outcome.stopped,
        stopped_step=outcome.step,
        stopped_wall_s=round(time.perf_counter() - started, 1),
        progress_lines=len(steps),
    )
    started = time.perf_counter()
    resumed = launch.Launch(config, run_dir, processes=args.processes, gpus=args.gpus).start(resume=True)
    final = resumed.wait(on_progress)
    record.update(
        final_rc=final.returncode,
        final_step=final.step,
        lora=bool(final.lora),
        resumed_wall_s=round(time.perf_counter() - started, 1),
        tail=final.tail[-400:] if final.returncode else "",
    )
    print(json.dumps(record), flush=True)
    return 0 if outcome.returncode == 0 and final.returncode == 0 and final.step == args.steps else 1


if __name__ == "__main__":
    raise SystemExit(main())
