#!/usr/bin/env python3
"""fp8_compute's per-row quantization alone, at the widths of Klein 4B's and Z-Image's block Linears at
1024 px: eager torch ops, the same ops compiled by inductor, and fp8_kernels' Triton kernel; then the
pattern as it sits in a compiled block (Klein's single-block linear2 input: the LoRA'd linear1 output's
add, SwiGLU, the concat with attention, then quantized; the bf16 input is kept, as the LoRA branch keeps
it) with inductor's fused reduction against the Triton kernel. Each time is the median of
`triton.testing.do_bench`, against the floor of its bytes (each input read once, each output written once)
at the copy bandwidth measured in the same process. Bit equality against eager torch is counted too.

    python bench/fp8_quant.py [--out FILE]      # on a CUDA GPU with Triton; one JSON record
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.backends.torch_backend import fp8, fp8_kernels

WIDTHS = {  # name: (tokens, width) of a quantized [tokens, width] input at 1024 px
    "klein4b in 3072": (4608, 3072),
    "klein4b double mlp out in 9216": (4608, 9216),
    "klein4b single linear2 in 12288": (4608, 12288),
    "klein4b single linear1 grad 27648": (4608, 27648),
    "zimage in 3840": (4352, 3840),
    "zimage w2 in 10240": (4352, 10240),
    "wide 40960 (looped)": (2048, 40960),
}


def median_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median"))


torch_quantize = fp8.quantize_rows_torch


def agreement(t: torch.Tensor) -> dict:
    q0, s0 = torch_quantize(t)
    q1, s1 = torch.ops.kiln.quantize_rows(t)
    same = (q0.view(torch.uint8) == q1.view(torch.uint8)).float().mean().item()
    return {"q_bits_equal": round(same, 6), "scales_equal": bool(torch.equal(s0, s1))}


def klein_linear2_input(attn, base, lora, *, triton_kernel: bool):
    """Flux2's single block: linear1's output (base + LoRA) split, SwiGLU on the MLP half, concat with
    the attention output; the bf16 result (kept for the LoRA branch) and its quantization."""
    h = base + lora
    a, b = h.chunk(2, dim=-1)
    x = torch.cat((attn, torch.nn.functional.silu(a) * b), dim=-1)
    q, s = torch.ops.kiln.quantize_rows(x) if triton_kernel else torch_quantize(x)
    return x, q, s


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() and fp8_kernels.AVAILABLE):
        print("needs a CUDA GPU with Triton", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    big = torch.empty(2**30, dtype=torch.uint8, device=dev)
    bandwidth = 2 * 2**30 / (median_ms(big.clone) / 1e3) / 1e9  # GB/s, read + write
    big = None
    record = {
        "kind": "fp8_quant",
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "copy_gbps": round(bandwidth),
        "widths": [],
    }
    compiled = torch.compile(torch_quantize)
    print(f"copy bandwidth {bandwidth:.0f} GB/s")
    print(f"{'input':36} {'floor':>7} {'eager':>7} {'inductor':>9} {'triton':>7}  bits equal")
    for name, (tokens, width) in WIDTHS.items():
        t = torch.randn(tokens, width, device=dev, dtype=torch.bfloat16) * torch.rand(tokens, 1, device=dev) * 8
        floor = (t.numel() * 3 + tokens * 4) / bandwidth / 1e6  # bf16 read, e4m3 written, scales (ms)
        row = {
            "name": name,
            "tokens": tokens,
            "width": width,
            "floor_ms": round(floor, 4),
            "eager_ms": round(median_ms(lambda t=t: torch_quantize(t)), 4),
            "inductor_ms": round(median_ms(lambda t=t: compiled(t)), 4),
            "triton_ms": round(median_ms(lambda t=t: torch.ops.kiln.quantize_rows(t)), 4),
            **agreement(t),
        }
        record["widths"].append(row)
        print(
            f"{name:36} {row['floor_ms']:7.3f} {row['eager_ms']:7.3f} {row['inductor_ms']:9.3f} "
            f"{row['triton_ms']:7.3f}  {row['q_bits_equal']:.6f} scales {row['scales_equal']}"
        )
    # As in a compiled Klein single block: inductor's fused reduction against the opaque kernel.
    tokens = 4608
    attn = torch.randn(tokens, 3072, device=dev, dtype=torch.bfloat16)
    base = torch.randn(tokens, 18432, device=dev, dtype=torch.bfloat16)
    lora = torch.randn(tokens, 18432, device=dev, dtype=torch.bfloat16) * 0.01
    fused = {}
    for kernel in (False, True):
        fn = torch.compile(lambda a, b, c, k=kernel: klein_linear2_input(a, b, c, triton_kernel=k))
        _, q, s = fn(attn, base, lora)
        fused[kernel] = (round(median_ms(lambda f=fn: f(attn, base, lora)), 4), q, s)
    floor = (attn.numel() * 2 + base.numel() * 4 + tokens * 12288 * 3) / bandwidth / 1e6
    same = (fused[False][1].view(torch.uint8) == fused[True][1].view(torch.uint8)).float().mean().item()
    record["klein_linear2_pattern"] = {
        "floor_ms": round(floor, 4),
        "inductor_fused_ms": fused[False][0],
        "triton_kernel_ms": fused[True][0],
        "q_bits_equal": round(same, 6),
    }
    print(
        f"Klein linear2 input as compiled: floor {floor:.3f} ms, inductor fused {fused[False][0]:.3f} ms, "
        f"producer + Triton kernel {fused[True][0]:.3f} ms (bits equal {same:.6f})"
    )
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
