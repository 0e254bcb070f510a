"""base_quantize int8 (torch): the frozen base's block Linears stored in int8 and multiplied in int8 (W8A8).

For Ampere and Ada cards, whose fp8 matmuls are missing or slow (fp8.py needs per-row `_scaled_mm`): each block
Linear's weight becomes int8 with one fp32 scale per output channel (symmetric, absmax / 127), half its bf16
bytes, and its bf16 original goes to host memory until `remove()` puts it back bit for bit. The forward
quantizes the activation per token (row) and multiplies through `torch._int_mm` (int32 accumulation), rescaled
by row scale x channel scale into the compute dtype (bf16 under autocast). The activation gradient runs in int8
too: dx = g · W = g · diag(s) · Wq, so the channel scale `s`, which lies along the reduced dimension, is folded
into the gradient (g · diag(s), exact) before it is quantized per row, and the product multiplies the stored Wq
itself. Why: no second resident int8 copy of W (a transposed copy quantized per input channel would cost the
weight's int8 bytes again, undoing half the saving) and no dequantization. OneTrainer's LinearW8A8 keeps one
scale per tensor instead, where the question does not arise; a per-channel scale is tighter for the diffusion
bases' rows of very different magnitude. Memory: cuBLASLt's int8 product with a row-major right operand (Wq as
it lies) ran 4.6-5.8x slower on an H200 than the column-major one the forward uses (8192 x 3072 x 3072: 1.25 ms
against 0.22; it also refused row counts not a multiple of 32 for narrow weights), so the backward copies Wq
transposed per use: 0.27 ms with the copy, which holds one Linear's int8 weight for the duration of its product
(the widest: Z-Image 42 MiB, Klein 9B 144, Flux2 Dev 324). No weight gradient: the base is frozen; nothing of x is saved.

Sampling under no_grad runs the same int8 path (the bf16 weights are on the host). A product `torch._int_mm`
refuses (on CUDA: M <= 16 rows, K or N not a multiple of 8; MPS has no int8 matmul) multiplies the dequantized
weight in the compute dtype instead, counted in FALLBACKS. The scales (4 bytes per output channel) stay on the
GPU; a streamed block (streaming.py) streams the int8 weight, a frozen Parameter like any other.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..base import restore_forward

log = logging.getLogger("kiln")

INT8_MAX = 127.0
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
FALLBACKS = {"calls": 0}  # eager products that took the dequantized matmul (compiled ones are not counted)


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] → (int8 [M, K], fp32 scale [M, 1]) with t ≈ int8 · scale: symmetric, each row's absmax at ±127,
    rounded to nearest (each value off by at most scale / 2)."""
    amax = t.detach().abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / INT8_MAX
    return torch.round(t.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def int_mm_fits(rows: int, inner: int, cols: int, device: torch.device) -> bool:
    """Whether torch._int_mm takes a [rows, inner] x [inner, cols] product on `device` (the CPU takes any)."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and rows > 16 and inner % 8 == 0 and cols % 8 == 0


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype if x.dtype in _FLOAT else torch.float32


def _product(a: torch.Tensor, b8: torch.Tensor, b_scale: torch.Tensor | None, dtype) -> torch.Tensor:
    """a [M, K] · b8 [K, N] (int8, column-major: b8.t() contiguous) → [M, N] in `dtype`; `b_scale` [1, N]
    multiplies b8's columns (None: 1)."""
    rows = a.shape[0]
    if not int_mm_fits(rows, a.shape[1], b8.shape[1], a.device):
        if not torch.compiler.is_compiling():
            FALLBACKS["calls"] += 1
        b = b8.float() if b_scale is None else b8.float() * b_scale
        return (a.float() @ b).to(dtype)
    a8, scale = quantize_rows(a)
    scale = scale if b_scale is None else scale * b_scale
    return (torch._int_mm(a8, b8).float() * scale).to(dtype)


class _Int8Matmul(torch.autograd.Function):
    """y = x · Wᵀ with W = Wq · diag(scale) by rows; the backward gives x's gradient only (W is frozen)."""

    @staticmethod
    def forward(ctx, x, weight, scale, dtype):
        with torch.autocast(x.device.type, enabled=False):
            y = _product(x.reshape(-1, x.shape[-1]), weight.t(), scale.reshape(1, -1), dtype)
        ctx.save_for_backward(weight, scale)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        weight, scale = ctx.saved_tensors
        with torch.autocast(grad.device.type, enabled=False):
            g = grad.reshape(-1, grad.shape[-1]).float() * scale.reshape(1, -1)  # the channel scale folded in
            # Wq [N, K] copied column-major for the product (see the module's docstring), one weight at a time
            dx = _product(g, weight.t().contiguous().t(), None, ctx.x_dtype)
        return dx.reshape(ctx.x_shape), None, None, None


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    y = _Int8Matmul.apply(x, weight, scale, _compute_dtype(x))
    return y if bias is None else y + bias.to(y.dtype)


def _eligible(module: nn.Module, device: torch.device) -> bool:
    """A plain Linear whose float weight (a plain tensor, not ComfyUI's quantized subclass) sits on the training
    device or the host, with no ComfyUI forward-time patches (a weight function would be lost)."""
    weight = getattr(module, "weight", None)
    return (
        isinstance(module, nn.Linear)
        and type(weight) in (torch.Tensor, nn.Parameter)
        and weight.dtype in _FLOAT
        and weight.device.type in (device.type, "cpu")  # on the host: ComfyUI's partial load left it there
        and not getattr(module, "weight_function", None)
        and not getattr(module, "bias_function", None)
    )


def _linear_like(module: nn.Module) -> bool:
    return hasattr(module, "in_features") and hasattr(module, "out_features") and hasattr(module, "weight")


class Int8Base:
    """int8 weights and forwards on every eligible Linear inside `blocks`; `remove()` gives each its own weight
    (bitwise, where it was) and forward back."""

    mode = "int8"  # what compiled blocks bake in

    def __init__(self, blocks: list[nn.Module], device: torch.device):
        self.replaced: list[tuple[nn.Linear, object, torch.Tensor, torch.device]] = []
        self.bytes = self.freed = 0
        skipped = refused = 0
        # ComfyUI's mixed-precision Linear (a quantized checkpoint's) is no nn.Linear: counted, left to its own forward
        linears = [m for block in blocks for m in block.modules() if isinstance(m, nn.Linear) or _linear_like(m)]
        for module in linears:
            if not _eligible(module, device):
                skipped += 1
                continue
            original = module.weight.data
            with torch.no_grad():  # quantized on the device (a host weight too: a GPU rounds 20B weights in seconds)
                weight, scale = quantize_rows(original.to(device))
            # the original to host memory (a weight already there is kept as it is: no copy), and the int8 copy
            # where the original lay: one on the host streams from there (streaming.py) or arrives with its block
            host = original if original.device.type == "cpu" else original.to("cpu")
            weight = weight.to(original.device)
            self.replaced.append((module, module.__dict__.get("forward"), host, original.device))
            module.weight.data = weight
            scale = scale.reshape(-1)
            self.bytes += weight.numel() + scale.numel() * 4
            self.freed += original.numel() * original.element_size()
            refused += not int_mm_fits(17, module.in_features, module.out_features, device)
            module.forward = _forward(module, scale)
        log.info(
            "[Kiln] base_quantize int8: %d block Linears stored and multiplied in int8 (%.2f GiB, from %.2f GiB)%s%s",
            len(self.replaced),
            self.bytes / 2**30,
            self.freed / 2**30,
            f"; {refused} multiply dequantized weights (sizes torch._int_mm refuses here)" if refused else "",
            f"; {skipped} stay as they are (off the device, quantized or patched at forward)" if skipped else "",
        )

    def streamed(self, stream, blocks: list[nn.Module]):
        """Nothing to drop: an int8 forward reads its weight from the module at each call (it streams as it is)."""
        return stream

    def remove(self) -> None:
        for module, previous, host, origin in self.replaced:
            module.weight.data = host if host.device == origin else host.to(origin)
            restore_forward(module, previous)
        self.replaced = []


def _forward(module: nn.Linear, scale: torch.Tensor):
    # module.weight read at each call: a streamed block's weight points into its ring slot (streaming.py)
    def forward(x, *args, **kwargs):
        return int8_linear(x, module.weight, scale, module.bias)

    return forward
