#!/usr/bin/env python3
"""fp8_compute's products alone, at the shapes of Klein 4B's and Z-Image's block Linears at 1024 px
(4,096 image tokens + the caption): each direction of one frozen Linear timed apart, bf16 against fp8
(trainer/backends/torch_backend/fp8.py: per-row scales, quantization compiled with the product as it is
inside a compiled block):

    forward   y  = x · Wᵀ      [T, in]  → [T, out]   (inner width in,  output width out)
    backward  dx = dy · W      [T, out] → [T, in]    (inner width out, output width in)

and the whole autograd step (forward + input gradient) as fp8.py runs it. The products fp8 pays for
decide fp8.FP8_PRODUCTS.

    python bench/fp8_matmul.py            # on a CUDA GPU; one JSON line per shape
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.backends.torch_backend.fp8 import Fp8Weight, fp8_linear, quantize_rows

SHAPES = {  # name: (tokens, in, out)
    "klein4b double qkv": (4608, 3072, 9216),
    "klein4b double proj": (4608, 3072, 3072),
    "klein4b double mlp in": (4608, 3072, 18432),
    "klein4b double mlp out": (4608, 9216, 3072),
    "klein4b single linear1": (4608, 3072, 27648),
    "klein4b single linear2": (4608, 12288, 3072),
    "zimage qkv": (4352, 3840, 11520),
    "zimage out": (4352, 3840, 3840),
    "zimage w1": (4352, 3840, 10240),
    "zimage w2": (4352, 10240, 3840),
}


def timed(fn, repeat: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat / 1e3


def fp8_product(a: torch.Tensor, b8: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """a · b8ᵀ with a quantized per row; b8 [n, k] per-row scaled (its scale [1, n])."""
    a8, a_scale = quantize_rows(a)
    return torch._scaled_mm(a8, b8.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)


def _cases(x, weight, fp8, grad, product) -> dict:
    """Each product alone, then forward + input gradient as fp8.py runs it (one compiled call)."""
    step = torch.compile(lambda t: fp8_linear(t, fp8, None))
    return {
        "fwd_bf16": lambda: torch.nn.functional.linear(x.detach(), weight),
        "fwd_fp8": lambda: product(x.detach(), fp8.rows, fp8.row_scale),
        "bwd_bf16": lambda: grad @ weight,
        "bwd_fp8": lambda: product(grad, fp8.cols, fp8.col_scale),
        "step_bf16": lambda: torch.autograd.grad(torch.nn.functional.linear(x, weight), x, grad),
        "step_fp8": lambda: torch.autograd.grad(step(x), x, grad),
    }


def main() -> int:
    device = torch.device("cuda")
    product = torch.compile(fp8_product)
    for name, (tokens, fan_in, fan_out) in SHAPES.items():
        weight = torch.randn(fan_out, fan_in, device=device, dtype=torch.bfloat16) / fan_in**0.5
        fp8 = Fp8Weight(weight, forward=True, backward=True)
        x = torch.randn(tokens, fan_in, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(tokens, fan_out, device=device, dtype=torch.bfloat16)
        cases = _cases(x, weight, fp8, grad, product)
        row = {"shape": name, "tokens": tokens, "in": fan_in, "out": fan_out}
        for label, fn in cases.items():
            row[f"{label}_ms"] = round(timed(fn) * 1e3, 3)
        for direction in ("fwd", "bwd"):
            row[f"{direction}_speedup"] = round(row[f"{direction}_bf16_ms"] / row[f"{direction}_fp8_ms"], 3)
        with torch.no_grad():
            exact = torch.nn.functional.linear(x.float(), weight.float())
            row["fp8_rel_err"] = round(float((fp8_linear(x, fp8, None).float() - exact).norm() / exact.norm()), 5)
            row["bf16_rel_err"] = round(
                float((torch.nn.functional.linear(x, weight).float() - exact).norm() / exact.norm()), 5
            )
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
