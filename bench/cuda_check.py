"""CUDA check of the PyTorch backend on a GPU: fused AdamW, bf16 autocast, checkpointing, EMA, resume (a LoRA and
a full fine-tune), and bf16 stochastic rounding, eager against compiled.

Not a speed benchmark (that is the full-size harness); it proves the CUDA code
paths train, resume and report memory. Run: python bench/cuda_check.py
Prints one JSON record.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer import config as config  # noqa: E402
from trainer import safetensors_io
from trainer.data import InMemoryData  # noqa: E402
from trainer.demo.tiny_dit import build_tiny_flux  # noqa: E402
from trainer.run.loop import train  # noqa: E402


def data(count=16, size=32):
    rng = np.random.default_rng(0)
    latents = [rng.standard_normal((16, size, size)).astype(np.float32) for _ in range(count)]
    contexts = [rng.standard_normal((8, 32)).astype(np.float32) for _ in range(count)]
    return InMemoryData.from_arrays(
        latents, contexts, [f"{i}.png" for i in range(count)], np.zeros((8, 32), np.float32)
    )


def model():
    return build_tiny_flux(0, hidden=256, heads=4, double_blocks=4, single_blocks=4).cuda().to(torch.bfloat16)


def run(cfg, folder, stop_at=None, resume=False):
    count = []
    stop = (lambda: len(count) >= stop_at) if stop_at else None
    return train(
        cfg, model(), data(), run_dir=folder, resume=folder if resume else None, on_step=count.append, should_stop=stop
    )


def resume_check(cfg, holds=("lora.",)):
    """A straight run, one stopped at step 15 and resumed, and a second straight run: the resumed (and the rerun's)
    trained tensors against the straight run's, bit for bit."""
    tmp = Path(tempfile.mkdtemp())
    started = time.perf_counter()
    straight = run(cfg, tmp / "a")
    elapsed = time.perf_counter() - started
    run(cfg, tmp / "b", stop_at=15)
    resumed = run(cfg, tmp / "b", resume=True)
    again = run(cfg, tmp / "c")  # a second uninterrupted run: tells kernel nondeterminism from resume drift
    a, _ = safetensors_io.read(straight.checkpoint / "state.safetensors")
    b, _ = safetensors_io.read(resumed.checkpoint / "state.safetensors")
    c, _ = safetensors_io.read(again.checkpoint / "state.safetensors")

    def diff(x, y):
        return max(
            float(np.abs(x[k].astype(np.float64) - y[k].astype(np.float64)).max()) for k in x if k.startswith(holds)
        )

    losses = straight.history.loss
    return {
        "wall_s_incl_setup": round(elapsed, 2),
        "loss_first10": float(np.mean(losses[:10])),
        "loss_last10": float(np.mean(losses[-10:])),
        "resume_bitwise_equal": all(np.array_equal(a[k], b[k]) for k in a),
        "resume_max_abs_diff": diff(a, b),
        "rerun_bitwise_equal": all(np.array_equal(a[k], c[k]) for k in a),
        "rerun_max_abs_diff": diff(a, c),
    }


def rounding_check(weights=1 << 28):
    """bf16 stochastic rounding of a flat buffer in place (full.round_flat_), the eager kernels against the compiled
    one: both land on the two neighbours only, unbiased, the same draws from the same seed; GPU time each."""
    from trainer.backends.torch_backend import full

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = {}
    for name, fused in (("eager", False), ("compiled", True)):
        full.FUSED_ROUNDING = fused
        draws = []
        for _ in range(2):
            torch.cuda.manual_seed(7)
            value = torch.full((weights,), 1 - 5e-4, device="cuda")  # between bf16's 1 - 2^-8 and 1
            full.round_flat_(value)
            draws.append(value)
        start.record()
        for _ in range(10):
            full.round_flat_(value)  # values already on bf16's grid: the same work, nothing moves
        end.record()
        torch.cuda.synchronize()
        out[name] = {
            "ms_per_call": start.elapsed_time(end) / 10,
            "values": sorted(set(draws[0].unique().tolist())),
            "mean_error": float(draws[0].double().mean()) - (1 - 5e-4),
            "same_seed_same_draws": torch.equal(draws[0], draws[1]),
        }
    full.FUSED_ROUNDING = True
    return {"weights": weights, **out}


def main():
    cfg = config.from_dict(
        dict(
            arch="demo",
            device="cuda",
            mixed_precision="bf16",
            steps=40,
            batch_size=4,
            rank=16,
            alpha=16.0,
            learning_rate=1e-3,
            ema=True,
            gradient_checkpointing=True,
            checkpoint_every=20,
            log_every=10,
            lora_dropout=0.1,
            caption_dropout=0.1,
        )
    )
    lora = resume_check(cfg)
    full = resume_check(
        config.replace(cfg, adapter="full", learning_rate=1e-4, lora_dropout=0.0), holds=("full.", "ema.")
    )
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "steps": cfg.steps,
                "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                **lora,
                "full_finetune": full,
                "bf16_rounding": rounding_check(),
                "peak_alloc_mb": torch.cuda.max_memory_allocated() / 2**20,
                "fused_adamw": True,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    if "--deterministic" in sys.argv:  # needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment
        torch.use_deterministic_algorithms(True)
    main()
