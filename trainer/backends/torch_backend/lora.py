"""LoRA side branches on torch Linear layers: y = base(x) + (α/r)·B(A(dropout(x))).

The base layer is never copied and its weight never rebuilt per step: its own
forward (ComfyUI's cast-on-forward Linear included) runs unchanged and the
low-rank branch is added to its output. Injection replaces the instance's
`forward` attribute, so module paths and state_dict keys stay exactly as
ComfyUI knows them and removal is `del module.forward`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ...lora.files import LoraWeights
from ...lora.targets import init_lora_A, select_targets
from ..base import restore_forward
from . import adapters

# A/B switches for bench/ (both on in every run): the weights cast once per step under autocast, and no
# multiply at scale 1 (alpha = rank, the default). Each removes small kernels (bench/RESULTS.md).
STEP_WEIGHTS = True
SKIP_UNIT_SCALE = True


class LoraBranch(nn.Module):
    """The trainable low-rank pair for one Linear; parameters are fp32."""

    roles = ("lora_A", "lora_B")

    def __init__(self, A: torch.Tensor, out_features: int, alpha: float, dropout: float):
        super().__init__()
        rank = A.shape[0]
        self.lora_A = nn.Parameter(A)  # [r, in]
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, device=A.device))  # [out, r]: step 0 = base
        self.alpha = float(alpha)
        self.scale = self.alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    # Within a training step under autocast: (scale·A, B) in the compute dtype, made once per step for
    # every branch by LoraSet.step_weights; None otherwise (the fp32 masters, cast per use).
    step_weights: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] → [..., out].
        if self.step_weights is not None:
            A, B = self.step_weights
            return nn.functional.linear(nn.functional.linear(self.dropout(x), A), B)
        # Under autocast the matmuls run in bf16 on the fp32 masters and x is used as it comes (no fp32
        # copy for autograd to keep); otherwise the branch runs in fp32.
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.lora_A.dtype)
        # The scale goes on the rank-r hidden, not on the [tokens, out] result: one pass less over
        # the largest tensor of the branch, in forward, recompute and backward; none at scale 1.
        hidden = nn.functional.linear(self.dropout(x), self.lora_A)
        if self.scale != 1.0 or not SKIP_UNIT_SCALE:
            hidden = hidden * self.scale
        return nn.functional.linear(hidden, self.lora_B)

    def hook(self, base_forward):
        return _with_branch(base_forward, self)

    def weights(self) -> LoraWeights:
        return LoraWeights(
            A=self.lora_A.detach().float().cpu().numpy().copy(),
            B=self.lora_B.detach().float().cpu().numpy().copy(),
            alpha=self.alpha,
        )

    @torch.no_grad()
    def load(self, weights, path: str) -> None:
        if getattr(weights, "kind", "lora") != "lora":
            raise ValueError(f"{path}: the saved adapter is {weights.kind}, this run trains lora (adapter differs)")
        for name, array in (("lora_A", weights.A), ("lora_B", weights.B)):
            param = getattr(self, name)
            if tuple(array.shape) != tuple(param.shape):
                raise ValueError(
                    f"{path}.{name}: shape {tuple(array.shape)} in the file, "
                    f"{tuple(param.shape)} in this run (rank or model differ)"
                )
            param.copy_(torch.from_numpy(np.asarray(array, dtype=np.float32)))


@dataclass
class Injected:
    module: nn.Linear
    branch: nn.Module  # LoraBranch or an adapters.AdapterBranch
    had_own_forward: bool
    previous_forward: object


class _StepCast(torch.autograd.Function):
    """(A₁·s₁ … Aₙ·sₙ, B₁ … Bₙ) → the same in `dtype`, as new tensors (none aliasing another, so a compiled
    block sees ordinary inputs); backward casts the gradients back to the masters' dtype, ·sᵢ for Aᵢ."""

    @staticmethod
    def forward(ctx, dtype, scales, count, *masters):
        ctx.scales, ctx.count, ctx.master_dtype = scales, count, masters[0].dtype
        As, Bs = list(masters[:count]), list(masters[count:])
        if any(s != 1.0 for s in scales):
            As = list(torch._foreach_mul(As, list(scales)))
        return _cast_all(As + Bs, dtype)

    @staticmethod
    def backward(ctx, *grads):
        out = _cast_all(list(grads), ctx.master_dtype)
        if any(s != 1.0 for s in ctx.scales):
            torch._foreach_mul_(out[: ctx.count], list(ctx.scales))
        return (None, None, None, *out)


def _cast_all(tensors: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    out = [torch.empty(t.shape, dtype=dtype, device=t.device) for t in tensors]
    torch._foreach_copy_(out, [t.contiguous() for t in tensors])  # one multi-tensor kernel per ~100 on CUDA
    return tuple(out)


def _with_branch(base_forward, branch: LoraBranch):
    def forward(x, *args, **kwargs):
        out = base_forward(x, *args, **kwargs)
        return out + branch(x).to(out.dtype)

    return forward


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """Every Linear by module path, in model order: nn.Linear and its subclasses (ComfyUI's cast-on-forward
    ops), and modules that compute a Linear without being one: ComfyUI's mixed-precision Linear, which
    fp8-scaled and other quantized checkpoints load into (`comfy_quant` weights; a torch.nn.Module with
    in_features, out_features and a 2-D weight, in 0.17 and 0.33 alike). The side branch needs only those."""
    return {name: module for name, module in model.named_modules() if _is_linear(module)}


def _is_linear(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    weight = getattr(module, "weight", None)
    sizes = (getattr(module, "out_features", None), getattr(module, "in_features", None))
    return (
        all(isinstance(n, int) for n in sizes)
        and torch.is_tensor(weight)
        and weight.ndim == 2
        and tuple(weight.shape) == sizes
    )


class LoraSet:
    """All branches of one run, keyed by ComfyUI module path; `adapter` picks the kind (trainer/lora/adapters.py)."""

    def __init__(
        self,
        model: nn.Module,
        patterns,
        *,
        rank: int,
        alpha: float,
        dropout: float,
        seed: int,
        adapter: str = "lora",
        lokr_factor: int = -1,
        lokr_full_w2: bool = False,
    ):
        layers = linear_layers(model)
        self.paths = select_targets(list(layers), list(patterns))
        self.injected: dict[str, Injected] = {}
        for path in self.paths:
            module = layers[path]
            device = module.weight.device if module.weight.device.type != "meta" else torch.device("cpu")
            if adapter == "lora":
                A = torch.from_numpy(init_lora_A(seed, path, rank, module.in_features)).to(device)
                branch = LoraBranch(A, module.out_features, alpha, dropout)
            else:
                branch = adapters.build(
                    adapter,
                    module,
                    path,
                    rank=rank,
                    alpha=alpha,
                    seed=seed,
                    lokr_factor=lokr_factor,
                    lokr_full_w2=lokr_full_w2,
                    device=device,
                )
            had_own = "forward" in module.__dict__
            previous = module.__dict__.get("forward")
            module.forward = branch.hook(module.forward)
            self.injected[path] = Injected(module, branch, had_own, previous)

    def branches(self) -> dict[str, nn.Module]:
        return {path: item.branch for path, item in self.injected.items()}

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Stable order: module order, then each branch's roles (A before B)."""
        return [
            (f"{path}.{role}", getattr(item.branch, role))
            for path, item in self.injected.items()
            for role in item.branch.roles
        ]

    def parameter_count(self) -> int:
        return sum(p.numel() for _, p in self.named_parameters())

    @contextmanager
    def step_weights(self, dtype: torch.dtype):
        """Within the block every LoRA branch multiplies by (scale·A, B) cast to `dtype` once, for all
        branches in a few multi-tensor kernels, instead of autocast casting each weight at each use and
        the scale multiplying each hidden, forward and backward (~5 small kernels per branch a step,
        which at small buckets the host's launches pace: bench/RESULTS.md). Gradients reach the fp32
        masters through the cast's backward (the same bf16 → fp32 cast autocast's would do). Held
        over forward and backward: checkpointing's recompute must see the same weights."""
        branches = [item.branch for item in self.injected.values() if isinstance(item.branch, LoraBranch)]
        if not branches:
            yield
            return
        copies = _StepCast.apply(
            dtype,
            tuple(b.scale for b in branches),
            len(branches),
            *(b.lora_A for b in branches),
            *(b.lora_B for b in branches),
        )
        for index, branch in enumerate(branches):
            branch.step_weights = (copies[index], copies[len(branches) + index])
        try:
            yield
        finally:
            for branch in branches:
                branch.step_weights = None

    @contextmanager
    def disabled(self):
        """Within the block the model runs without its LoRA (the base model: DOP's target). The very same
        forward functions go back afterwards, so a compiled block's guards still hold (no recompile)."""
        hooked = [(item, item.module.__dict__["forward"]) for item in self.injected.values()]
        for item, _ in hooked:
            _unhook(item)
        try:
            yield
        finally:
            for item, forward in hooked:
                item.module.forward = forward

    def remove(self) -> None:
        """Take every branch out; the model is as it was before injection."""
        for item in self.injected.values():
            _unhook(item)
        self.injected.clear()


def _unhook(item: Injected) -> None:
    """Give the module back the forward it had before injection."""
    if item.had_own_forward:
        item.module.forward = item.previous_forward
    else:
        item.module.__dict__.pop("forward", None)


@contextmanager
def subtracted(model: nn.Module, weights: dict[str, LoraWeights]):
    """Within the block each module of `weights` (paths in `model`) answers as if that LoRA were not merged into
    its weight: a live branch adds −(α/r)·B·A·x to its output. How a streamed base samples without the training
    adapter merged into it: un-merging by re-patching would rewrite the weights the stream holds in its ring. Equal
    to the unmerged model up to the rounding of the merged weight (fp32 sum, rounded once to the weight dtype)."""
    hooked = []
    try:
        for path, lora in weights.items():
            module = model.get_submodule(path)
            A = torch.as_tensor(lora.A, dtype=torch.float32)
            B = torch.as_tensor(lora.B, dtype=torch.float32) * -lora.scale
            hooked.append((module, module.__dict__.get("forward")))
            module.forward = _minus(module.forward, A, B)
        yield
    finally:
        for module, previous in reversed(hooked):
            restore_forward(module, previous)


def _minus(base_forward, A: torch.Tensor, B: torch.Tensor):
    placed: dict = {}  # (device, dtype) -> the pair there, made once per context

    def forward(x, *args, **kwargs):
        out = base_forward(x, *args, **kwargs)
        key = (x.device, x.dtype)
        if key not in placed:
            placed[key] = (A.to(x.device, x.dtype), B.to(x.device, x.dtype))
        a, b = placed[key]
        return out + nn.functional.linear(nn.functional.linear(x, a), b).to(out.dtype)

    return forward
