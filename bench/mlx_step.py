"""MLX backend step: compiled vs eager step time, and peak memory with and without per-block checkpointing.

    python bench/mlx_step.py [--steps 5] [--warmup 1] [--hidden 256] [--blocks 4] [--size 32]

A mid-size tiny DiT (the demo's model scaled up: hidden 256, 4 double + 4 single blocks), fp32,
batch 2 of 32×32 latents (1,024 image tokens + 8 text tokens), rank 16 on the default targets,
AdamW, clipping, EMA off. Each case gets a fresh model and backend; the warm-up steps (the
first one traces the graph and, on mlx[cpu], builds its fused kernels with g++) are not timed;
then `--steps` steps are timed one by one (each step ends in its own mx.eval) and the median is
reported. Peak memory is mx.get_peak_memory() over the timed steps, reset after the warm-up.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx.core as mx

from trainer import config as config_module
from trainer.archs import get_arch
from trainer.backends.base import Batch
from trainer.backends.mlx_backend.backend import MlxBackend
from trainer.backends.mlx_backend.models.tiny import build, demo_weights


def make_batch(batch_size: int, size: int, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    shape = (batch_size, 16, size, size)
    return Batch(
        latents=rng.standard_normal(shape).astype(np.float32),
        noise=rng.standard_normal(shape).astype(np.float32),
        sigmas=rng.uniform(0.1, 0.9, batch_size).astype(np.float32),
        weights=np.ones(batch_size, np.float32),
        context=rng.standard_normal((batch_size, 8, 32)).astype(np.float32),
    )


def run_case(weights, heads: int, compiled: bool, checkpointing: bool, args) -> dict:
    cfg = config_module.from_dict(
        dict(
            arch="demo",
            backend="mlx",
            mixed_precision="no",
            rank=16,
            alpha=16.0,
            learning_rate=1e-4,
            max_grad_norm=1.0,
            gradient_checkpointing=checkpointing,
            batch_size=args.batch,
            resolutions=[args.size * 8],
        )
    )
    backend = MlxBackend()
    backend.compile_step = compiled
    backend.setup(build("demo", weights, "float32", heads=heads), cfg, get_arch("demo"))
    batches = [make_batch(args.batch, args.size, seed) for seed in range(args.warmup + args.steps)]
    started = time.perf_counter()
    for batch in batches[: args.warmup]:
        backend.step([batch], 1e-4)
    first = time.perf_counter() - started
    mx.reset_peak_memory()
    times, losses = [], []
    for batch in batches[args.warmup :]:
        started = time.perf_counter()
        stats = backend.step([batch], 1e-4)
        times.append(time.perf_counter() - started)
        losses.append(stats.loss)
    peak = backend.peak_memory_bytes()
    result = dict(
        median=statistics.median(times),
        spread=(min(times), max(times)),
        warmup=first,
        peak=peak,
        loss=backend.scalars(losses)[-1],
        trainable=backend.trainable_parameter_count(),
    )
    backend.teardown()
    mx.clear_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (compile happens here)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=4, help="double blocks, and as many single blocks")
    parser.add_argument("--size", type=int, default=32, help="latent side (tokens = size²)")
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    weights = demo_weights(
        0, hidden=args.hidden, heads=args.heads, double_blocks=args.blocks, single_blocks=args.blocks
    )
    print(
        f"mlx {mx.__version__} on {mx.default_device()}, {platform.machine()}, {platform.processor() or '?'}; "
        f"hidden {args.hidden}, {args.blocks}+{args.blocks} blocks, batch {args.batch}, "
        f"{args.size}x{args.size} latents, rank 16, fp32; {args.warmup} warm-up + {args.steps} timed steps"
    )
    rows = []
    for compiled, checkpointing in ((True, False), (False, False), (True, True), (False, True)):
        result = run_case(weights, args.heads, compiled, checkpointing, args)
        rows.append((compiled, checkpointing, result))
        print(
            f"  done: compiled={compiled} checkpointing={checkpointing} median {result['median']:.3f} s",
            file=sys.stderr,
        )
    print(f"\ntrainable parameters {rows[0][2]['trainable']:,}\n")
    print(
        "| step | checkpointing | median s/step | min–max s | warm-up (incl. compile) s | peak memory MB | last loss |"
    )
    print("|---|---|---|---|---|---|---|")
    for compiled, checkpointing, r in rows:
        print(
            f"| {'compiled' if compiled else 'eager'} | {'per block' if checkpointing else 'off'} | "
            f"{r['median']:.3f} | {r['spread'][0]:.3f}–{r['spread'][1]:.3f} | {r['warmup']:.1f} | "
            f"{r['peak'] / 2**20:.1f} | {r['loss']:.5f} |"
        )


if __name__ == "__main__":
    main()
