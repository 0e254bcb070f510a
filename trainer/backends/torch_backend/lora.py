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

from ...lora_format import LoraWeights
from ...targets import init_lora_A, select_targets
from . import adapters


class LoraBranch(nn.Module):
    """The trainable low-rank pair for one Linear; parameters are fp32."""

    roles = ("lora_A", "lora_B")

    def __init__(self, A: torch.Tensor, out_features: int, alpha: float, dropout: float):
        super().__init__()
        rank = A.shape[0]
        self.lora_A = nn.Parameter(A)                                             # [r, in]
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, device=A.device))  # [out, r]: step 0 = base
        self.alpha = float(alpha)
        self.scale = self.alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] → [..., out]. Under autocast the matmuls run in bf16 on the fp32 masters and x
        # is used as it comes (no fp32 copy for autograd to keep); otherwise the branch runs in fp32.
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.lora_A.dtype)
        # The scale goes on the rank-r hidden, not on the [tokens, out] result: one pass less over
        # the largest tensor of the branch, in forward, recompute and backward.
        hidden = nn.functional.linear(self.dropout(x), self.lora_A) * self.scale
        return nn.functional.linear(hidden, self.lora_B)

    def hook(self, base_forward):
        return _with_branch(base_forward, self)

    def weights(self) -> LoraWeights:
        return LoraWeights(A=self.lora_A.detach().float().cpu().numpy().copy(),
                           B=self.lora_B.detach().float().cpu().numpy().copy(), alpha=self.alpha)

    @torch.no_grad()
    def load(self, weights, path: str) -> None:
        if getattr(weights, "kind", "lora") != "lora":
            raise ValueError(f"{path}: the saved adapter is {weights.kind}, this run trains lora (adapter differs)")
        for name, array in (("lora_A", weights.A), ("lora_B", weights.B)):
            param = getattr(self, name)
            if tuple(array.shape) != tuple(param.shape):
                raise ValueError(f"{path}.{name}: shape {tuple(array.shape)} in the file, "
                                 f"{tuple(param.shape)} in this run (rank or model differ)")
            param.copy_(torch.from_numpy(np.asarray(array, dtype=np.float32)))


@dataclass
class Injected:
    module: nn.Linear
    branch: nn.Module          # LoraBranch or an adapters.AdapterBranch
    had_own_forward: bool
    previous_forward: object


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
    return (all(isinstance(n, int) for n in sizes) and torch.is_tensor(weight) and weight.ndim == 2
            and tuple(weight.shape) == sizes)


class LoraSet:
    """All branches of one run, keyed by ComfyUI module path; `adapter` picks the kind (trainer/adapters.py)."""

    def __init__(self, model: nn.Module, patterns, *, rank: int, alpha: float, dropout: float, seed: int,
                 adapter: str = "lora", lokr_factor: int = -1, lokr_full_w2: bool = False):
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
                branch = adapters.build(adapter, module, path, rank=rank, alpha=alpha, seed=seed,
                                        lokr_factor=lokr_factor, lokr_full_w2=lokr_full_w2, device=device)
            had_own = "forward" in module.__dict__
            previous = module.__dict__.get("forward")
            module.forward = branch.hook(module.forward)
            self.injected[path] = Injected(module, branch, had_own, previous)

    def branches(self) -> dict[str, nn.Module]:
        return {path: item.branch for path, item in self.injected.items()}

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Stable order: module order, then each branch's roles (A before B)."""
        return [(f"{path}.{role}", getattr(item.branch, role))
                for path, item in self.injected.items() for role in item.branch.roles]

    def parameter_count(self) -> int:
        return sum(p.numel() for _, p in self.named_parameters())

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
