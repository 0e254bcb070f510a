"""LoKr, LoHa and DoRA side branches: the same design as lora.py's LoraBranch (the base Linear's own
forward runs unchanged; the branch adds to its output, or for DoRA scales its input), parameters fp32.

Formulas and key names: trainer/lora/adapters.py. LoKr never builds kron(w1, w2): the input is viewed as
[..., in_m, in_n] and y = w1 · X · w2ᵀ. LoHa builds its [out, in] ΔW each step (a Hadamard product has
no cheaper form). DoRA's column norms ‖W + s·BA‖ come from ‖W‖² (kept once), Bᵀ·W [r, in] and BᵀB [r, r],
never from W + s·BA itself; the base weight is read, never copied or changed.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ...lora import adapters as kinds
from ...lora.adapters import AdapterWeights
from ..base import parameter_name, saved_name


def _input(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Under autocast the branch runs in bf16 on the fp32 masters; otherwise in fp32 (as LoraBranch)."""
    return x if torch.is_autocast_enabled(x.device.type) else x.to(like.dtype)


def _attribute(role: str) -> str:
    """A role's parameter name: DoRA's A/B are lora_A/lora_B inside a backend, as LoRA's (backends/base.py)."""
    return parameter_name("." + role)[1:]


class AdapterBranch(nn.Module):
    """Parameters named by role (trainer/lora/adapters.py); `hook` gives the module's new forward."""

    kind = ""

    def __init__(self, tensors: dict[str, np.ndarray], alpha: float, device: torch.device):
        super().__init__()
        self.roles = tuple(_attribute(role) for role in tensors)  # parameter names, e.g. lora_A, lokr_w1
        for role, array in tensors.items():
            setattr(self, _attribute(role), nn.Parameter(torch.from_numpy(np.array(array, np.float32)).to(device)))
        self.alpha = float(alpha)
        self.scale = AdapterWeights(self.kind, dict(tensors), alpha).scale  # alpha/r; 1 for a full LoKr w2
        self.dropout = nn.Identity()  # lora_dropout is LoRA's only (config refuses it here)

    def weights(self) -> AdapterWeights:
        return AdapterWeights(
            self.kind,
            {
                saved_name("." + name)[1:]: getattr(self, name).detach().float().cpu().numpy().copy()
                for name in self.roles
            },
            self.alpha,
        )

    @torch.no_grad()
    def load(self, weights, path: str) -> None:
        roles = {_attribute(role) for role in getattr(weights, "tensors", {})}
        if getattr(weights, "kind", "lora") != self.kind or roles != set(self.roles):
            raise ValueError(
                f"{path}: the saved adapter is {getattr(weights, 'kind', 'lora')}, this run trains "
                f"{self.kind} with {list(self.roles)} (adapter or lokr_full_w2 differ)"
            )
        for role, array in weights.tensors.items():
            param = getattr(self, _attribute(role))
            if tuple(array.shape) != tuple(param.shape):
                raise ValueError(
                    f"{path}.{role}: shape {tuple(array.shape)} in the file, {tuple(param.shape)} "
                    "in this run (rank, lokr_factor or model differ)"
                )
            param.copy_(torch.from_numpy(np.asarray(array, dtype=np.float32)))

    def hook(self, base_forward):
        def forward(x, *args, **kwargs):
            out = base_forward(x, *args, **kwargs)
            return out + self(x).to(out.dtype)

        return forward


class LokrBranch(AdapterBranch):
    kind = "lokr"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1 = self.lokr_w1  # [out_m, in_m]
        x = _input(x, w1)
        X = x.reshape(*x.shape[:-1], w1.shape[1], -1)  # [..., in_m, in_n]
        if "lokr_w2" in self.roles:
            h = X @ self.lokr_w2.t()  # [..., in_m, out_n]
        else:  # the scale on the rank-r hidden, the smallest tensor
            h = ((X @ self.lokr_w2_b.t()) * self.scale) @ self.lokr_w2_a.t()
        y = w1 @ h  # [..., out_m, out_n]
        return y.reshape(*x.shape[:-1], -1)  # [..., out]


class LohaBranch(AdapterBranch):
    kind = "loha"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _input(x, self.hada_w1_a)
        delta = (self.hada_w1_a @ self.hada_w1_b) * (self.hada_w2_a @ self.hada_w2_b)  # [out, in]
        return nn.functional.linear(x, delta * self.scale)


class DoraBranch(AdapterBranch):
    """y = base(x ⊙ g) + s·B(A(x ⊙ g)), g = m / (‖(W + s·BA)[:, j]‖ + eps) per input column j: the same as
    (W + s·BA)·diag(g)·x + bias, what ComfyUI's weight_decompose merges for a [1, in] dora_scale."""

    kind = "dora"

    def __init__(self, tensors, alpha, device, module: nn.Module):
        weight = module.weight
        if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"adapter dora reads the base weight, and this layer's is {weight.dtype}; load the "
                "model with weight_dtype default (not fp8/quantized) or use adapter lokr/loha/lora"
            )
        base = weight.detach().float()
        super().__init__({**tensors, "dora_scale": kinds.magnitude(base.cpu().numpy())}, alpha, device)
        self.register_buffer("base_norm_sq", (base * base).sum(0), persistent=False)  # [in], fp32
        self._module = [module]  # a list: the base Linear must not become a child (state_dict, .to)

    def gain(self) -> torch.Tensor:
        """g [in], in fp32 whatever autocast says (ComfyUI merges in fp32)."""
        A, B, s = self.lora_A, self.lora_B, self.scale
        weight = self._module[0].weight.detach()
        with torch.autocast(A.device.type, enabled=False):
            BtW = (B.t().to(weight.dtype) @ weight).to(A.dtype)  # [r, in]
            cross = (A * BtW).sum(0)  # [in]: Σ_o W[o,j]·(BA)[o,j]
            quad = (A * ((B.t() @ B) @ A)).sum(0)  # [in]: ‖(BA)[:, j]‖²
            norm_sq = self.base_norm_sq + 2 * s * cross + s * s * quad
            return self.dora_scale[0] / (norm_sq.clamp_min(0).sqrt() + kinds.EPS)

    def hook(self, base_forward):
        def forward(x, *args, **kwargs):
            scaled = x * self.gain().to(x.dtype)
            out = base_forward(scaled, *args, **kwargs)
            h = _input(scaled, self.lora_A)
            branch = nn.functional.linear(nn.functional.linear(h, self.lora_A) * self.scale, self.lora_B)
            return out + branch.to(out.dtype)

        return forward


_BRANCHES = {"lokr": LokrBranch, "loha": LohaBranch}


def build(
    kind: str,
    module: nn.Module,
    path: str,
    *,
    rank: int,
    alpha: float,
    seed: int,
    lokr_factor: int,
    lokr_full_w2: bool,
    device: torch.device,
) -> AdapterBranch:
    tensors = kinds.init_tensors(
        kind,
        seed,
        path,
        module.in_features,
        module.out_features,
        rank=rank,
        lokr_factor=lokr_factor,
        lokr_full_w2=lokr_full_w2,
    )
    if kind == "dora":
        return DoraBranch(tensors, alpha, device, module)
    return _BRANCHES[kind](tensors, alpha, device)
