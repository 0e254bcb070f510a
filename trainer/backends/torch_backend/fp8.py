"""fp8_compute: the frozen base's block Linears multiply in fp8, forward and backward.

The base is frozen and most of a step's FLOPs: each of its Linears runs three matmuls per step with
checkpointing (forward, recompute, the activation gradient) and no weight gradient. Here all three run
on the GPU's fp8 tensor cores through `torch._scaled_mm` with per-row scales (torchao's "rowwise"
recipe): the activation (or incoming gradient) is scaled per token, the weight per output channel for
the forward and per input channel for the backward, all in float8_e4m3fn, accumulating in fp32 and
returning bf16. The LoRA branches are untouched (bf16 matmuls on fp32 masters), so what trains keeps
full precision; only the frozen path's products are rounded.

Measured on an H100 (bench/RESULTS.md, "fp8 compute" and "fp8 compute as the loop runs it", 1024 px,
defaults otherwise, CUDA-event step times): Z-Image 0.280 → 0.235 s/step, Klein 4B 0.173 → 0.156; the
200-step loss curves within 1 % of bf16's. At 512-768 px, where the host's launches pace a step, its extra
kernels and matmul calls made steps slower (up to +30 %). Costs: two fp8
copies of each block weight (one per layout cuBLAS needs: [out, in] for the forward, [in, out] for the
backward), as many bytes as the bf16 weights again (Z-Image +11.5 GiB, Klein 4B +6.9 GiB), and a longer
first compile; the weights themselves are ComfyUI's and stay as they are (sampling uses them). A base
stored in e4m3 needs no copy for its forward (Fp8Weight.stored): Flux2 Dev 1.219 → 1.093 s/step; its
backward multiplies in fp8 too where a transposed copy of the stored weights fits beside the step
(levers.fp8_stored_backward), else it casts them to bf16 per use. Activations are quantized by torch ops
that inductor fuses into their producers, except the Linears an arch names (Arch.fp8_quantize_kernel:
Flux2's single-block linear2, in runs whose buckets are all >= 1024 px), whose input fp8_kernels' Triton
kernel quantizes: Klein 4B 0.155 -> 0.149 s/step at 1024 px.
Installed like the LoRA branches, by instance-forward override, before them; removal restores each
Linear exactly.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..base import restore_forward
from . import fp8_kernels

log = logging.getLogger("kiln")

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
_ALIGN = 16  # cuBLAS fp8 needs both matrix dims of the weight divisible by 16
_PLAIN = (torch.bfloat16, torch.float16, torch.float32)
TRITON_QUANTIZE = True  # False: never fp8_kernels' Triton kernel (A/B switch)


def quantize_rows(t: torch.Tensor, kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] → (float8 [M, K], fp32 scale [M, 1]) with t ≈ fp8 · scale, each row using e4m3's full range.
    `kernel`: on a CUDA GPU, the same arithmetic as one opaque Triton kernel (fp8_kernels), which inductor
    does not fuse into the input's producer; for the arch families where that measured faster
    (Arch.fp8_quantize_kernel)."""
    if kernel and TRITON_QUANTIZE and fp8_kernels.AVAILABLE and t.is_cuda and t.dim() == 2 and t.dtype in _PLAIN:
        return torch.ops.kiln.quantize_rows(t)
    return quantize_rows_torch(t)


def quantize_rows_torch(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in torch ops (CPU, MPS, no Triton; the reference the Triton kernel matches)."""
    amax = t.detach().abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def fp8_products(in_features: int, out_features: int) -> tuple[bool, bool]:
    """(forward, backward): which of a Linear's two products run in fp8. Both, for every size: on an H100
    each product alone ran 1.0-1.45x faster in fp8 (bench/fp8_matmul.py; only the square 3072² / 3840²
    ones broke even), and a run with the down projections' forwards and up projections' backwards kept in
    bf16 (half the copies) was slower than all-fp8: Z-Image 0.278 against 0.260 s/step (RESULTS.md)."""
    return True, True


class Fp8Weight:
    """One frozen weight [out, in]: the base's own tensor, plus an fp8 copy in the layout of each product
    that runs in fp8, with its per-row scales. The weight is read from its owner at each use: a streamed
    block's weight lies in its ring slot by then (streaming.py), and a weight ComfyUI left on the host arrives."""

    def __init__(self, weight: torch.Tensor, *, forward: bool = True, backward: bool = True):
        self.source = weight  # the module's own Parameter (or a tensor): the bf16 products' operand, not a copy
        w = weight.detach()
        self.kernel = False  # its forward's input quantized by fp8_kernels
        self.stored_rows = False  # the forward multiplies the stored e4m3 weight itself
        self._rows = self.row_scale = self.cols = self.col_scale = None
        if forward:  # per output channel: the forward's B, [out, in] and [1, out]
            rows, scale = quantize_rows(w)
            self._rows, self.row_scale = rows, scale.reshape(1, -1).contiguous()
        if backward:  # per input channel: the backward's B, [in, out] and [1, in]
            cols, scale = quantize_rows(w.t().contiguous())
            self.cols, self.col_scale = cols, scale.reshape(1, -1).contiguous()

    @property
    def weight(self) -> torch.Tensor:
        return self.source.detach()

    @property
    def rows(self) -> torch.Tensor | None:
        return self.weight if self.stored_rows else self._rows

    @classmethod
    def stored(cls, weight: torch.Tensor, backward: bool = False, device: torch.device | None = None) -> Fp8Weight:
        """A base already stored in e4m3 (Load Diffusion Model's weight_dtype fp8_e4m3fn: values cast, no
        scale): the forward multiplies the stored weight itself (no copy, unit scales). `backward`: so does
        the backward, through the stored values transposed (cuBLAS's other layout: a copy as large as the
        stored weight, exact); without it the backward casts the weight to bf16 per use, as ComfyUI's own
        forward does (Flux2 Dev's copy would be 30 GiB). `device`: where it computes (a weight ComfyUI left
        on the host gets there by the stream or with its block, never with a copy)."""
        out = cls(weight, forward=False, backward=False)
        w = weight.detach()
        device = w.device if device is None else device
        out.stored_rows = True
        out.row_scale = torch.ones(1, w.shape[0], device=device, dtype=torch.float32)
        if backward:
            out.cols = w.t().contiguous()
            out.col_scale = torch.ones(1, w.shape[1], device=device, dtype=torch.float32)
        return out

    def drop_copies(self) -> None:
        """No fp8 copy of this weight kept (its block streams: a copy would stay on the GPU): the products without
        one take the weight from where it lies at each use, in bf16 (a stored weight's forward stays in fp8)."""
        if not self.stored_rows:
            self._rows = self.row_scale = None
        self.cols = self.col_scale = None

    def nbytes(self) -> int:
        """Bytes of the fp8 copies and scales (the weight itself is the base's)."""
        base = self.weight.untyped_storage().data_ptr()
        kept = [t for t in (self.rows, self.row_scale, self.cols, self.col_scale) if t is not None]
        return sum(t.numel() * t.element_size() for t in kept if t.untyped_storage().data_ptr() != base)


def _product(
    a: torch.Tensor, fp8: torch.Tensor | None, scale: torch.Tensor | None, plain: torch.Tensor, kernel: bool
) -> torch.Tensor:
    """a [M, K] · Bᵀ → [M, N] bf16: in fp8 with B = fp8 [N, K] (per-row `scale` [1, N]) when there is one,
    else in bf16 with B = plain."""
    with torch.autocast(a.device.type, enabled=False):  # scales in fp32, eager and compiled alike
        if fp8 is None:
            return a.to(torch.bfloat16) @ plain.to(torch.bfloat16).t()
        a8, a_scale = quantize_rows(a, kernel)
        return torch._scaled_mm(a8, fp8.t(), scale_a=a_scale, scale_b=scale, out_dtype=torch.bfloat16)


class _Fp8Matmul(torch.autograd.Function):
    """y = x · Wᵀ; the backward gives x's gradient only (the weight is frozen). Each product in fp8 or bf16
    as Fp8Weight holds it. Nothing of x is saved: the weights are all the backward needs."""

    @staticmethod
    def forward(ctx, x, weight, rows, row_scale, cols, col_scale, kernel):
        y = _product(x.reshape(-1, x.shape[-1]), rows, row_scale, weight, kernel)  # [tokens, in] → [tokens, out]
        ctx.save_for_backward(weight, cols, col_scale)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return y.reshape(*x.shape[:-1], weight.shape[0])  # [..., out]

    @staticmethod
    def backward(ctx, grad):
        weight, cols, col_scale = ctx.saved_tensors
        dx = _product(grad.reshape(-1, grad.shape[-1]), cols, col_scale, weight.t(), False)  # → [tokens, in]
        return dx.reshape(ctx.x_shape).to(ctx.x_dtype), None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    y = _Fp8Matmul.apply(x, weight.weight, weight.rows, weight.row_scale, weight.cols, weight.col_scale, weight.kernel)
    return y if bias is None else y + bias.to(y.dtype)


def _eligible(module: nn.Module, device: torch.device) -> bool:
    """A plain Linear of the block lists whose weight sits on the training device in a float dtype or
    stored as plain e4m3 (not a quantized tensor subclass, whose scales ComfyUI applies), with no ComfyUI
    forward-time patches (a weight function would be lost) and fp8-friendly sizes."""
    weight = getattr(module, "weight", None)
    if not (
        isinstance(module, nn.Linear)
        and type(weight) in (torch.Tensor, nn.Parameter)
        and weight.dtype in (*_PLAIN, E4M3)
        and (_on(weight.device, device) or _host_stored(weight, device))
    ):
        return False
    if getattr(module, "weight_function", None) or getattr(module, "bias_function", None):
        return False
    return module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0


def _host_stored(weight: torch.Tensor, device: torch.device) -> bool:
    """An e4m3 weight ComfyUI's partial load left on the host, for a GPU run: its forward needs no copy (it streams
    or arrives with its block, Fp8Weight reads it where it lies)."""
    return weight.device.type == "cpu" and device.type != "cpu" and weight.dtype == E4M3


def _on(where: torch.device, device: torch.device) -> bool:
    """`where` is `device` ("cuda" means the current GPU, as "cuda:0" may name it)."""
    if where.type != device.type:
        return False
    current = torch.cuda.current_device() if device.type == "cuda" else None
    return (where.index if where.index is not None else current) == (
        device.index if device.index is not None else current
    )


def check_device(device: torch.device) -> None:
    """fp8_compute needs `torch._scaled_mm` with per-row scales here (H100-class GPUs, or the CPU for tests)."""
    a = torch.ones(16, 16, device=device).to(E4M3)
    scale = torch.ones(16, 1, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=scale, scale_b=scale.t().contiguous(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as error:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        raise ValueError(
            f"fp8_compute: this device ({name}) has no fp8 matmul with per-row scales "
            f"({str(error).strip().splitlines()[0][:200]}); it needs an H100-class GPU (compute "
            "capability 9.0+). Turn fp8_compute off in Kiln Training Options (or the config)."
        ) from error


def _kernel_works(device: torch.device, widths: tuple[int, ...] = ()) -> bool:
    """fp8_kernels' kernel builds on `device` at the input `widths` it will quantize and agrees with the torch
    ops bit for bit (else one log line, and the torch ops quantize: same values, slower)."""
    if device.type != "cuda" or not (TRITON_QUANTIZE and fp8_kernels.AVAILABLE):
        return False
    failed = fp8_kernels.probe(device, quantize_rows_torch, widths)
    if failed:
        log.warning(
            "[Kiln] fp8_compute: the Triton quantization kernel is off (%s); quantizing with torch "
            "ops instead (same values, slower)",
            failed,
        )
    return not failed


def stored_linears(blocks: list[nn.Module], device: torch.device) -> list[nn.Linear]:
    """The eligible Linears of `blocks` whose weight is stored in e4m3 (an fp8-loaded base)."""
    return [
        module
        for block in blocks
        for module in block.modules()
        if isinstance(module, nn.Linear) and _eligible(module, device) and module.weight.dtype == E4M3
    ]


class Fp8Base:
    """fp8 forwards on every eligible Linear inside `blocks`; `remove()` gives each its own forward back.
    `stored_backward`: the e4m3-stored weights' backward in fp8 too (a transposed copy of each).
    `kernel`: the names (inside a block) of the Linears whose forward input fp8_kernels' Triton kernel
    quantizes, where it works here (Arch.fp8_quantize_kernel)."""

    def __init__(
        self, blocks: list[nn.Module], device: torch.device, stored_backward: bool = False, kernel: tuple[str, ...] = ()
    ):
        check_device(device)
        named = [
            module
            for block in blocks
            for name, module in block.named_modules()
            if isinstance(module, nn.Linear) and name in kernel and _eligible(module, device)
        ]
        works = bool(named) and _kernel_works(device, tuple(m.in_features for m in named))
        self.kernel_linears: list[nn.Linear] = named if works else []  # forward input quantized by fp8_kernels
        # what compiled blocks bake in
        self.mode = "on" + ("+stored_backward" if stored_backward else "") + ("+kernel" if self.kernel else "")
        self.replaced: list[tuple[nn.Module, object]] = []
        self.weights: dict[nn.Module, Fp8Weight] = {}
        self.bytes = 0
        skipped = 0
        for block in blocks:
            for module in block.modules():
                if not isinstance(module, nn.Linear):
                    continue
                if not _eligible(module, device):
                    skipped += 1
                    continue
                if module.weight.dtype == E4M3:
                    on_device = _on(module.weight.device, device)
                    weight = Fp8Weight.stored(module.weight, backward=stored_backward and on_device, device=device)
                else:
                    forward, backward = fp8_products(module.in_features, module.out_features)
                    weight = Fp8Weight(module.weight, forward=forward, backward=backward)
                weight.kernel = any(module is linear for linear in self.kernel_linears)
                self.bytes += weight.nbytes()
                self.replaced.append((module, module.__dict__.get("forward")))
                self.weights[module] = weight
                module.forward = _forward(module, weight, module.forward)
        log.info(
            "[Kiln] fp8_compute: %d block Linears multiply in fp8 (%.2f GiB of fp8 weight copies%s)%s",
            len(self.replaced),
            self.bytes / 2**30,
            f"; {len(self.kernel_linears)} quantize their input with the Triton kernel" if self.kernel_linears else "",
            f"; {skipped} stay as they are (off the GPU, patched at forward, or sizes not multiples of 16)"
            if skipped
            else "",
        )

    @property
    def kernel(self) -> bool:
        return bool(self.kernel_linears)

    def streamed(self, stream, blocks: list[nn.Module]):
        """`stream` (streaming.BlockStreamer) streams some of `blocks` from host memory: their Linears keep no fp8
        copy on the GPU (Fp8Weight.drop_copies). Returns the stream."""
        for index in stream.plan.blocks:
            for module in blocks[index].modules():
                if module in self.weights:
                    self.weights[module].drop_copies()
        return stream

    def remove(self) -> None:
        for module, previous in self.replaced:
            restore_forward(module, previous)
        self.replaced, self.weights = [], {}


def _forward(module: nn.Linear, weight: Fp8Weight, own_forward):
    # Only training takes the fp8 path: validation samples (no grad) go through the Linear's own forward,
    # so they show what ComfyUI's sampler will give the saved LoRA.
    def forward(x, *args, **kwargs):
        if not torch.is_grad_enabled():
            return own_forward(x, *args, **kwargs)
        return fp8_linear(x, weight, module.bias)

    return forward
