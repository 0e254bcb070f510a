"""SDPA kernels on the shapes Kiln trains: accuracy against an fp32 reference, and speed.

    python bench/attention_check.py [--out results.json]

For each model's attention shape at 1024 px (batch 1, head dim 128; q, k, v laid out as ComfyUI
hands them: [B, L, H, D] moved to [B, H, L, D], not contiguous) and each kernel torch can run there
(flash, memory-efficient, cuDNN), in bf16:
    accuracy   relative error ||x - ref|| / ||ref|| of the output and of dq, dk, dv, against the
               math kernel in fp32 on the same bf16 inputs and output gradient
    speed      CUDA events around 20 forward calls and 20 forward+backward calls after 3 warm-up
               calls, median; TFLOPS with 4·B·H·L²·D forward FLOPs and 2.5x that for backward
Prints one JSON record per (shape, kernel) and appends them to --out when given.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # heads, image + text tokens at 1024 px (bench/gpu_train.py's inputs)
    "zimage": (30, 4096 + 256),
    "klein4b": (24, 4096 + 512),
    "klein9b": (32, 4096 + 512),
}
KERNELS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def inputs(heads: int, tokens: int, seed: int = 0):
    generator = torch.Generator("cuda").manual_seed(seed)
    make = lambda: torch.randn(
        1,
        tokens,
        heads,
        128,
        device="cuda",
        generator=generator,  # noqa: E731
        dtype=torch.bfloat16,
    ).movedim(1, 2)
    return (
        make(),
        make(),
        make(),
        torch.randn(1, heads, tokens, 128, device="cuda", generator=generator, dtype=torch.bfloat16),
    )


def run(q, k, v, grad, backend=None, dtype=None):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([backend] if backend is not None else [SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach().float()] + [t.grad.float() for t in leaves]


def relative(got, ref) -> float:
    return float((got - ref).norm() / ref.norm())


def timed(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def check(shape: str, kernel: str) -> dict:
    heads, tokens = SHAPES[shape]
    q, k, v, grad = inputs(heads, tokens)
    record = {"shape": shape, "heads": heads, "tokens": tokens, "kernel": kernel}
    try:
        reference = run(q, k, v, grad, dtype=torch.float32)
        got = run(q, k, v, grad, KERNELS[kernel])
    except RuntimeError as error:  # the kernel does not take this input here
        return {**record, "error": str(error).splitlines()[0][:300]}
    record.update(
        {
            f"rel_err_{name}": round(relative(g, r), 5)
            for name, g, r in zip(("out", "dq", "dk", "dv"), got, reference, strict=True)
        }
    )
    del reference, got
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def forward():
        with torch.no_grad(), sdpa_kernel([KERNELS[kernel]]):
            F.scaled_dot_product_attention(*leaves)

    def forward_backward():
        with sdpa_kernel([KERNELS[kernel]]):
            F.scaled_dot_product_attention(*leaves).backward(grad)

    flops = 4 * heads * tokens * tokens * 128
    fwd, both = timed(forward), timed(forward_backward)
    record.update(
        forward_ms=round(fwd * 1e3, 3),
        forward_backward_ms=round(both * 1e3, 3),
        forward_tflops=round(flops / fwd / 1e12, 1),
        forward_backward_tflops=round(3.5 * flops / both / 1e12, 1),
    )
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON list file to append the records to")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_check needs a CUDA GPU")
    common = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
    }
    records = []
    for shape in SHAPES:
        for kernel in KERNELS:
            record = {**common, **check(shape, kernel)}
            records.append(record)
            print(json.dumps(record), flush=True)
    if args.out:
        path = Path(args.out)
        existing = json.loads(path.read_text()) if path.is_file() else []
        path.write_text(json.dumps(existing + records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
