"""One Triton kernel for fp8_compute: per-row e4m3 quantization of an activation in one read.

Inductor fuses `fp8.quantize_rows`' amax and cast into the kernel that produces its input. For most inputs
that is as fast as a separate pass or faster, but not for Flux2's single-block `linear2` input (the
concat of the attention output with SwiGLU of the LoRA'd linear1 output): that fused reduction ran 0.49 ms
a call where reading the input once and writing e4m3 takes ~0.06 ms (bench/RESULTS.md). The producer's
output is written anyway (the LoRA branch keeps the same input), so an opaque op that reads it once,
holds each row in registers and writes e4m3 plus its scale costs about that read. Which Linears use it
is the arch's fact (Arch.fp8_quantize_kernel), taken by levers.fp8_base.

Registered with `torch.library.triton_op`, so torch.compile keeps it as one user-defined kernel in the
compiled block. The arithmetic is eager torch's own (the row's amax times 448's fp32 reciprocal, the row
divided by that scale rounded to nearest, clamped, rounded to nearest e4m3), so the two agree bit for bit:
`probe` checks it on the GPU before a run uses it, bench/fp8_quant.py records it. Absent Triton (CPU,
MPS, the CI machine) nothing is registered and `AVAILABLE` is False.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # a CPU-only torch has no Triton: fp8.quantize_rows keeps its torch ops
    triton = None

E4M3_MAX = 448.0
ONE_PASS_MAX = 32768  # a row up to this width stays in registers (32 per thread at 32 warps)
LOOP_BLOCK = 4096  # wider rows: an amax pass, then a cast pass that re-reads the row from L2

AVAILABLE = False

if triton is not None:
    _MAX = tl.constexpr(E4M3_MAX)  # a jit function reads only constexpr globals
    # torch divides a CUDA tensor by a Python number as a product with the number's fp32 reciprocal
    _INV_MAX = tl.constexpr((torch.ones((), dtype=torch.float32) / E4M3_MAX).item())

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        src = x_ptr + row * stride_x
        dst = q_ptr + row * K
        if ONE_PASS:
            cols = tl.arange(0, BLOCK)
            x = tl.load(src + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=0)
        else:
            peak = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, K, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                v = tl.load(src + cols, mask=cols < K, other=0.0).to(tl.float32)
                peak = tl.maximum(peak, tl.abs(v))
            amax = tl.max(peak, axis=0)
        scale = tl.maximum(amax, 1e-12) * _INV_MAX
        tl.store(scale_ptr + row, scale)
        if ONE_PASS:
            q = tl.clamp(tl.div_rn(x, scale), -_MAX, _MAX)
            tl.store(dst + cols, q.to(tl.float8e4nv), mask=cols < K)
        else:
            for start in range(0, K, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                v = tl.load(src + cols, mask=cols < K, other=0.0).to(tl.float32)
                q = tl.clamp(tl.div_rn(v, scale), -_MAX, _MAX)
                tl.store(dst + cols, q.to(tl.float8e4nv), mask=cols < K)

    def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[M, K] on a CUDA GPU → (float8_e4m3fn [M, K], fp32 scale [M, 1]), as fp8.quantize_rows."""
        if t.stride(-1) != 1:
            t = t.contiguous()
        rows, width = t.shape
        q = torch.empty((rows, width), device=t.device, dtype=torch.float8_e4m3fn)
        scale = torch.empty((rows, 1), device=t.device, dtype=torch.float32)
        block = triton.next_power_of_2(width)
        one_pass = block <= ONE_PASS_MAX
        if not one_pass:
            block = LOOP_BLOCK
        warps = max(4, min(32, block // 1024))
        wrap_triton(_quantize_rows_kernel)[(rows,)](
            t, q, scale, width, t.stride(0), BLOCK=block, ONE_PASS=one_pass, num_warps=warps
        )
        return q, scale

    def _registered() -> bool:
        try:
            torch.ops.kiln.quantize_rows  # noqa: B018 - another copy of the pack (a second custom_nodes folder) has it
        except (AttributeError, RuntimeError):
            return False
        return True

    if not _registered():
        triton_op("kiln::quantize_rows", quantize_rows, mutates_args=())
    AVAILABLE = True


def probe(device: torch.device, reference, widths: tuple[int, ...] = ()) -> str | None:
    """Run the kernel once on `device` at each of `widths` (the run's inputs: each width builds its own
    variant) and at a narrow and a looped width, on random rows of very different sizes, against
    `reference` (the torch ops); None when it builds and agrees bit for bit everywhere, else why not."""
    if not AVAILABLE:
        return "Triton is not installed"
    generator = torch.Generator(device="cpu").manual_seed(0)
    try:
        for rows, width in ((64, 3000), (4, LOOP_BLOCK * 9 + 17), *((8, w) for w in sorted(set(widths)))):
            t = torch.randn(rows, width, generator=generator) * torch.logspace(-4, 4, rows)[:, None]
            t = t.to(device=device, dtype=torch.bfloat16)
            q, scale = torch.ops.kiln.quantize_rows(t)
            q_ref, scale_ref = reference(t)
            if not (torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))):
                return f"its result differs from torch's at width {width}"
    except Exception as error:  # noqa: BLE001 - a Triton or driver fault of any kind means: use torch ops
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
    return None
