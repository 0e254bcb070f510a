"""CUDA check of step graphs (trainer/backends/torch_backend/step_graphs.py) on a GPU: the replayed steps train
what eager steps train, across two bucket shapes, compiled and eager blocks, gradient accumulation, exact
resume, and a capture that fails (an op that waits for the host) falls back without losing a step.

Not a speed benchmark (gpu_train.py and wall.py time the real models). Run: python bench/step_graphs_check.py
Prints one JSON record (and appends it to --out if given).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer import config as config  # noqa: E402
from trainer.backends.torch_backend.step_graphs import StepGraphs  # noqa: E402
from trainer.data import InMemoryData  # noqa: E402
from trainer.demo.tiny_dit import build_tiny_flux  # noqa: E402
from trainer.run.loop import train  # noqa: E402


def data(count=16):
    """Two bucket shapes (32x32 and 32x48 latents: 512x512 and 512x768 px), as a mixed-aspect dataset has."""
    rng = np.random.default_rng(0)
    latents = [rng.standard_normal((16, 32, 32 if i % 2 else 48)).astype(np.float32) for i in range(count)]
    contexts = [rng.standard_normal((8, 32)).astype(np.float32) for _ in range(count)]
    return InMemoryData.from_arrays(
        latents, contexts, [f"{i}.png" for i in range(count)], np.zeros((8, 32), np.float32)
    )


def model():
    return build_tiny_flux(0, hidden=256, heads=4, double_blocks=4, single_blocks=4).cuda().to(torch.bfloat16)


class Recordings:
    """Counts StepGraphs' recordings and replays, and times each recording (host seconds)."""

    def __init__(self):
        self.record, self.run = StepGraphs._record, StepGraphs.run
        self.recorded, self.calls = [], 0
        outer = self

        def record(graphs, *args):
            started = time.perf_counter()
            try:
                return outer.record(graphs, *args)
            finally:
                outer.recorded.append(round(time.perf_counter() - started, 4))

        def run(graphs, *args):
            outer.calls += 1
            return outer.run(graphs, *args)

        StepGraphs._record, StepGraphs.run = record, run

    def close(self):
        StepGraphs._record, StepGraphs.run = self.record, self.run


def lora_of(result) -> np.ndarray:
    return np.concatenate([np.concatenate([w.A.ravel(), w.B.ravel()]) for _, w in sorted(result.lora.items())])


def trained(folder: Path, name: str, forward=None, stop_at=None, resume=False, **settings):
    cfg = config.from_dict(
        {
            **dict(
                arch="demo",
                device="cuda",
                mixed_precision="bf16",
                steps=30,
                batch_size=2,
                rank=16,
                alpha=16.0,
                learning_rate=1e-3,
                ema=True,
                gradient_checkpointing=True,
                checkpoint_every=10,
                log_every=10,
                caption_dropout=0.1,
                resolutions=[512],
            ),
            **settings,
        }
    )
    count = []
    stop = (lambda: len(count) >= stop_at) if stop_at else None
    recordings = Recordings()
    try:
        result = train(
            cfg,
            model(),
            data(),
            run_dir=folder / name,
            forward=forward,
            on_step=count.append,
            should_stop=stop,
            resume=folder / name if resume else None,
        )
    finally:
        recordings.close()
    return result, recordings


def compare(a, b) -> dict:
    la, lb = np.array(a.history.loss), np.array(b.history.loss)
    return {
        "losses_equal": bool(np.array_equal(la, lb)),
        "loss_max_abs_diff": float(np.abs(la - lb).max()),
        "lora_bitwise_equal": bool(np.array_equal(lora_of(a), lora_of(b))),
        "lora_max_abs_diff": float(np.abs(lora_of(a).astype(np.float64) - lora_of(b)).max()),
    }


def syncing_forward(model, x_t, sigmas, context, extras):
    """A model whose forward reads a device value on the host (as some model code does): cannot be captured."""
    if float(sigmas.max().item()) > 2.0:
        raise AssertionError("unreachable")
    return model(x_t, sigmas, context, **extras)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON list to append the record to")
    parser.add_argument("--skip-compiled", action="store_true", help="the eager-block runs only (no compile wait)")
    args = parser.parse_args(argv)
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage()) if record.levelno >= logging.WARNING else None
    logging.getLogger("kiln").addHandler(handler)
    tmp = Path(tempfile.mkdtemp())
    record: dict = {"kind": "step_graphs_check", "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    # two plain runs: the GPU's own run-to-run difference (atomics in some backward kernels), the yardstick
    record["rerun_noise"] = compare(
        *(trained(tmp, f"noise-{k}", compile_blocks=False, step_graphs=False)[0] for k in range(2))
    )
    for compiled in (False,) if args.skip_compiled else (False, True):
        tag = "compiled" if compiled else "eager"
        plain, _ = trained(tmp, f"{tag}-off", compile_blocks=compiled, step_graphs=False)
        started = time.perf_counter()
        graphed, rec = trained(tmp, f"{tag}-on", compile_blocks=compiled, step_graphs=True)
        record[tag] = {
            **compare(plain, graphed),
            "recordings": len(rec.recorded),
            "record_s": rec.recorded,
            "graph_calls": rec.calls,
            "wall_s": round(time.perf_counter() - started, 1),
        }
    # gradient accumulation: two micro-batches a step, one graph replayed twice
    plain, _ = trained(tmp, "accum-off", compile_blocks=False, step_graphs=False, grad_accum=2, batch_size=1)
    graphed, rec = trained(tmp, "accum-on", compile_blocks=False, step_graphs=True, grad_accum=2, batch_size=1)
    record["grad_accum_2"] = {**compare(plain, graphed), "recordings": len(rec.recorded)}
    # exact resume: stopped at step 15, resumed (each shape recorded again) against the straight run
    straight, _ = trained(tmp, "straight", compile_blocks=False, step_graphs=True)
    trained(tmp, "resumed", compile_blocks=False, step_graphs=True, stop_at=15)
    resumed, _ = trained(tmp, "resumed", compile_blocks=False, step_graphs=True, resume=True)
    record["resume"] = compare(straight, resumed)
    # LoRA dropout under checkpointing (its RNG replayed by the recompute) inside a graph
    plain, _ = trained(tmp, "dropout-off", compile_blocks=False, step_graphs=False, lora_dropout=0.1)
    before = len(warnings)
    graphed, rec = trained(tmp, "dropout-on", compile_blocks=False, step_graphs=True, lora_dropout=0.1)
    record["lora_dropout"] = {**compare(plain, graphed), "recordings": len(rec.recorded), "warnings": warnings[before:]}
    # a capture that fails: one warning, the run goes on eagerly with the same result
    plain, _ = trained(tmp, "sync-off", compile_blocks=False, step_graphs=False, forward=syncing_forward)
    before = len(warnings)
    graphed, rec = trained(tmp, "sync-on", compile_blocks=False, step_graphs=True, forward=syncing_forward)
    record["failed_capture"] = {
        **compare(plain, graphed),
        "recordings_tried": len(rec.recorded),
        "warnings": warnings[before:],
    }
    record["peak_alloc_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    print(json.dumps(record, indent=1))
    if args.out:
        path = Path(args.out)
        records = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps([*records, record], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
