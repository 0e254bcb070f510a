"""LoKr, LoHa and DoRA layers for MLX: the torch backend's side branches (torch_backend/adapters.py), same
parameter names, init and formulas (trainer/lora/adapters.py). Like LoraLinear, each holds the very base layer
(`base_layer`, frozen) and takes its place on the parent; fp32 parameters; the branch runs in the
activation dtype under bf16 mixed precision and is cast back to the base's output dtype."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx import nn

from ...lora import adapters as kinds
from ...lora.adapters import AdapterWeights
from ..base import parameter_name, saved_name


def _attribute(role: str) -> str:
    return parameter_name("." + role)[1:]  # DoRA's A/B are lora_A/lora_B, as LoRA's


class AdapterLinear(nn.Module):
    kind = ""

    def __init__(self, base: nn.Module, tensors: dict[str, np.ndarray], alpha: float, low_precision: bool):
        super().__init__()
        self.base_layer = base
        self._roles = tuple(_attribute(role) for role in tensors)
        for role, array in tensors.items():
            setattr(self, _attribute(role), mx.array(np.asarray(array, np.float32)))
        self.alpha = float(alpha)
        self.scale = AdapterWeights(self.kind, dict(tensors), alpha).scale
        self._low_precision = low_precision

    @property
    def roles(self) -> tuple[str, ...]:
        return self._roles

    def weights(self) -> AdapterWeights:
        return AdapterWeights(
            self.kind,
            {saved_name("." + name)[1:]: np.array(getattr(self, name), dtype=np.float32) for name in self._roles},
            self.alpha,
        )

    def load(self, weights, path: str) -> None:
        roles = {_attribute(role) for role in getattr(weights, "tensors", {})}
        if getattr(weights, "kind", "lora") != self.kind or roles != set(self._roles):
            raise ValueError(
                f"{path}: the saved adapter is {getattr(weights, 'kind', 'lora')}, this run trains "
                f"{self.kind} with {list(self._roles)} (adapter or lokr_full_w2 differ)"
            )
        for role, array in weights.tensors.items():
            current = getattr(self, _attribute(role))
            if tuple(array.shape) != tuple(current.shape):
                raise ValueError(
                    f"{path}.{role}: shape {tuple(array.shape)} in the file, {tuple(current.shape)} "
                    "in this run (rank, lokr_factor or model differ)"
                )
            setattr(self, _attribute(role), mx.array(np.asarray(array, dtype=np.float32)))

    def _h(self, x: mx.array) -> mx.array:
        return x if self._low_precision else x.astype(mx.float32)

    def __call__(self, x: mx.array) -> mx.array:
        out = self.base_layer(x)
        return out + self.branch(self._h(x)).astype(out.dtype)


class LokrLinear(AdapterLinear):
    kind = "lokr"

    def branch(self, x: mx.array) -> mx.array:
        w1 = self.lokr_w1.astype(x.dtype)  # [out_m, in_m]
        X = x.reshape(*x.shape[:-1], w1.shape[1], -1)  # [..., in_m, in_n]
        if "lokr_w2" in self._roles:
            h = X @ self.lokr_w2.astype(x.dtype).T
        else:
            h = ((X @ self.lokr_w2_b.astype(x.dtype).T) * self.scale) @ self.lokr_w2_a.astype(x.dtype).T
        return (w1 @ h).reshape(*x.shape[:-1], -1)  # [..., out]


class LohaLinear(AdapterLinear):
    kind = "loha"

    def branch(self, x: mx.array) -> mx.array:
        delta = (self.hada_w1_a @ self.hada_w1_b) * (self.hada_w2_a @ self.hada_w2_b) * self.scale  # [out, in]
        return x @ delta.astype(x.dtype).T


class DoraLinear(AdapterLinear):
    kind = "dora"

    def __init__(self, base, tensors, alpha, low_precision):
        if isinstance(base, nn.QuantizedLinear) or getattr(base, "weight", None) is None:
            raise ValueError(
                "adapter dora reads the base weight, and this layer is quantized; set base_quantize "
                "to none or use adapter lokr/loha/lora"
            )
        weight = np.array(base.weight.astype(mx.float32))
        super().__init__(base, {**tensors, "dora_scale": kinds.magnitude(weight)}, alpha, low_precision)
        self._base_norm_sq = mx.array((weight.astype(np.float64) ** 2).sum(0).astype(np.float32))  # [in]

    def gain(self) -> mx.array:
        A, B, s = self.lora_A, self.lora_B, self.scale
        BtW = (B.T.astype(self.base_layer.weight.dtype) @ self.base_layer.weight).astype(A.dtype)  # [r, in]
        norm_sq = self._base_norm_sq + 2 * s * (A * BtW).sum(0) + s * s * (A * ((B.T @ B) @ A)).sum(0)
        return self.dora_scale[0] / (mx.sqrt(mx.maximum(norm_sq, 0)) + kinds.EPS)

    def __call__(self, x: mx.array) -> mx.array:
        scaled = x * self.gain().astype(x.dtype)
        out = self.base_layer(scaled)
        h = self._h(scaled)
        branch = ((h @ self.lora_A.astype(h.dtype).T) * self.scale) @ self.lora_B.astype(h.dtype).T
        return out + branch.astype(out.dtype)


LAYERS = {"lokr": LokrLinear, "loha": LohaLinear, "dora": DoraLinear}


def build(
    kind: str,
    base: nn.Module,
    path: str,
    in_features: int,
    out_features: int,
    *,
    rank: int,
    alpha: float,
    seed: int,
    lokr_factor: int,
    lokr_full_w2: bool,
    low_precision: bool,
) -> AdapterLinear:
    tensors = kinds.init_tensors(
        kind, seed, path, in_features, out_features, rank=rank, lokr_factor=lokr_factor, lokr_full_w2=lokr_full_w2
    )
    return LAYERS[kind](base, tensors, alpha, low_precision)
