"""The MLX memory model: the Mac table, and the measurements it was fitted to.

    python bench/mlx_memory.py            # the table: Klein 4B/9B, Z-Image at 512/1024 px on 32/64/128 GB Macs
    python bench/mlx_memory.py --measure  # also: peak memory of compiled bf16 steps of small MLX Flux2 and
                                          # Z-Image ports on this machine vs the estimate (~6 min on 2 cores)
    python bench/mlx_memory.py --measure-edit  # the small Flux2 with 0, 1, 2 reference images (edit training)

The table is trainer/estimate/mlx_step.py's (the `estimate --backend mlx` command prints the same rows).
--measure runs each case in its own process (MLX keeps compiled graphs and buffers across runs in
one process): hidden 256 (2 heads of 128), rank 32 on the default targets, AdamW, 64 text tokens,
two sequence lengths, 1+1 / 2+1 / 1+2 blocks, checkpointing off and on; peak = mx.get_peak_memory()
over the second step minus the model's weights, against the estimate's total minus weights.
The attention probe times n chained SDPA calls under a gradient: bytes per (heads x L^2) value.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.archs import flux2, zimage  # noqa: E402
from trainer.archs.layout import ModelDims  # noqa: E402
from trainer.estimate.common import GIB  # noqa: E402
from trainer.estimate.mlx_step import estimate_mlx, mlx_budget_gib  # noqa: E402

VARIANTS = ("flux2-klein-4b", "flux2-klein-9b", "zimage")
MACS = (32, 64, 128)


def table() -> str:
    head = "| model | px | checkpointing | base | total GiB | " + " | ".join(f"{gb} GB Mac" for gb in MACS) + " |"
    lines = [head, "|" + "---|" * (5 + len(MACS))]
    for variant in VARIANTS:
        for resolution in (512, 1024):
            for checkpointing in (True, False):
                for base in ("bf16", "int8", "int4"):
                    total = (
                        estimate_mlx(
                            variant, resolution=resolution, gradient_checkpointing=checkpointing, base_dtype=base
                        ).total
                        / GIB
                    )
                    fits = ["fits" if total <= mlx_budget_gib(gb) else "no" for gb in MACS]
                    lines.append(
                        f"| {variant} | {resolution} | {'on' if checkpointing else 'off'} | {base} | "
                        f"{total:.1f} | " + " | ".join(fits) + " |"
                    )
    budgets = ", ".join(f"{gb} GB: {mlx_budget_gib(gb):.1f} GiB" for gb in MACS)
    return "\n".join(lines) + f"\n\nMLX budget (95 % of the conservative working set): {budgets}"


# ---------------------------------------------------------------- measurement (one case per process)


def measure_case(family: str, first: int, second: int, side: int, checkpointing: bool, references: int = 0) -> dict:
    import mlx.core as mx
    import numpy as np

    from trainer import config as config_module
    from trainer.archs import get_arch
    from trainer.backends.base import Batch
    from trainer.backends.mlx_backend.backend import MlxBackend
    from trainer.backends.mlx_backend.models import build
    from trainer.demo import tiny_weights

    rng = np.random.default_rng(0)
    if family == "flux2":
        arch, shape, context = "flux2_klein", (1, 128, side, side), (1, 64, 192)
        model = build(arch, tiny_weights.flux2_weights(0, hidden=256, double=first, single=second), "bfloat16")
        extras = (
            {"reference_latents": [rng.standard_normal(shape).astype(np.float32) for _ in range(references)]}
            if references
            else {}
        )
    else:
        arch, shape, context = "zimage", (1, 16, side, side), (1, 64, 64)
        model = build(
            arch, tiny_weights.zimage_weights(0, dim=256, n_layers=second, n_refiner_layers=first), "bfloat16"
        )
        extras = {"num_tokens": np.full(1, 64, np.int64)}
    batch = Batch(
        latents=rng.standard_normal(shape).astype(np.float32),
        noise=rng.standard_normal(shape).astype(np.float32),
        sigmas=np.full(1, 0.5, np.float32),
        weights=np.ones(1, np.float32),
        context=rng.standard_normal(context).astype(np.float32),
        extras=extras,
    )
    cfg = config_module.from_dict(
        dict(
            arch=arch, backend="mlx", mixed_precision="bf16", rank=32, alpha=32.0, gradient_checkpointing=checkpointing
        )
    )
    weights = mx.get_active_memory()
    backend = MlxBackend()
    backend.setup(model, cfg, get_arch(arch))
    backend.step([batch], 1e-4)
    mx.reset_peak_memory()
    backend.step([batch], 1e-4)
    return {"peak": mx.get_peak_memory(), "weights": weights}


def attention_bytes(length: int, chained: int, heads: int = 2) -> float:
    import mlx.core as mx

    q, k, v, w = (mx.random.normal((1, heads, length, 128)).astype(mx.bfloat16) for _ in range(4))
    mx.eval(q, k, v, w)

    def loss(a, b, c):
        for _ in range(chained):
            a = mx.fast.scaled_dot_product_attention(a, b, c, scale=128**-0.5)
        return (a * w).astype(mx.float32).sum()

    gradient = mx.compile(mx.grad(loss, argnums=(0, 1, 2)))
    mx.eval(gradient(q, k, v))
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(gradient(q, k, v))
    return (mx.get_peak_memory() - base) / (heads * length**2)


def probe_dims(family: str, first: int, second: int) -> ModelDims:
    if family == "flux2":
        return flux2.model_dims("probe", "flux2_klein", 256, first, second, context_dim=192, context_tokens=64)
    return zimage.model_dims("probe", 256, layers=second, refiners=first, context_dim=64, context_tokens=64)


def measure() -> str:
    import mlx.core as mx

    lines = [
        f"mlx {mx.__version__} on {mx.default_device()}",
        "",
        "attention under a gradient, bytes per heads x L^2 value (1, 2, 3 chained SDPA calls):",
    ]
    for length in (1024, 2048):
        lines.append(f"  L={length}: " + ", ".join(f"{attention_bytes(length, n):.2f}" for n in (1, 2, 3)))
    lines += [
        "",
        "| family | blocks | latent side | checkpointing | measured MB | estimate MB | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for family, sides in (("flux2", (16, 32)), ("zimage", (32, 64))):
        for checkpointing in (False, True):
            for first, second in ((1, 1), (2, 1), (1, 2)):
                for side in sides:
                    code = (
                        f"import json, sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import mlx_memory; "
                        f"print(json.dumps(mlx_memory.measure_case({family!r}, {first}, {second}, {side}, "
                        f"{checkpointing})))"
                    )
                    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                    found = json.loads(out.stdout.strip().splitlines()[-1])
                    measured = found["peak"] - found["weights"]
                    est = estimate_mlx(
                        probe_dims(family, first, second),
                        resolution=side * (16 if family == "flux2" else 8),
                        gradient_checkpointing=checkpointing,
                    )
                    estimated = est.total - est.weights - est.workspace + (est.workspace - _overhead())
                    lines.append(
                        f"| {family} | {first}+{second} | {side} | {'on' if checkpointing else 'off'} | "
                        f"{measured / 2**20:.1f} | {estimated / 2**20:.1f} | "
                        f"{(estimated - measured) / measured:+.0%} |"
                    )
    return "\n".join(lines)


def measure_edit() -> str:
    """Edit training: the small Flux2 (1+1 blocks, latent 16x16) with 0-2 reference latents of the target's
    size, measured against estimate_mlx(reference_images=n)."""
    lines = ["| references | checkpointing | measured MB | estimate MB | error |", "|---|---|---|---|---|"]
    for checkpointing in (False, True):
        for references in (0, 1, 2):
            code = (
                f"import json, sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import mlx_memory; "
                f"print(json.dumps(mlx_memory.measure_case('flux2', 1, 1, 16, {checkpointing}, {references})))"
            )
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            found = json.loads(out.stdout.strip().splitlines()[-1])
            measured = found["peak"] - found["weights"]
            est = estimate_mlx(
                probe_dims("flux2", 1, 1),
                resolution=256,
                gradient_checkpointing=checkpointing,
                reference_images=references,
            )
            estimated = est.total - est.weights - _overhead()
            lines.append(
                f"| {references} | {'on' if checkpointing else 'off'} | {measured / 2**20:.1f} | "
                f"{estimated / 2**20:.1f} | {(estimated - measured) / measured:+.0%} |"
            )
    return "\n".join(lines)


def _overhead() -> int:
    from trainer.estimate.mlx_step import MLX_OVERHEAD

    return MLX_OVERHEAD  # Metal's fixed overhead: not part of a CPU measurement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", action="store_true", help="also measure small models on this machine")
    parser.add_argument("--measure-edit", action="store_true", help="also measure the small Flux2 with references")
    args = parser.parse_args()
    print(table())
    if args.measure:
        print()
        print(measure())
    if args.measure_edit:
        print()
        print(measure_edit())


if __name__ == "__main__":
    main()
