"""LoRA layers for MLX Linear and QuantizedLinear: y = base(x) + (α/r)·B(A(dropout(x))).

MLX modules are dicts and lists of children, so injection puts a `LoraLinear` in the target's
place on its parent and keeps the very same base object inside it (`base_layer`, frozen);
removal puts that object back. LoRA parameters sit at `<ComfyUI path>.lora_A` / `.lora_B`,
the names the torch backend uses, fp32, A from the shared seeded init, B zero.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...lora.files import LoraWeights
from ...lora.targets import init_lora_A, select_targets
from . import adapters

LINEAR_TYPES = (nn.Linear, nn.QuantizedLinear)


class DropoutKeys:
    """LoRA dropout for one run: the rate, and a PRNG key per layer while a training step is traced.

    Keys, not mx.random's global state, so a checkpointed block's recompute replays the same masks
    and the compiled step draws fresh ones each call (the keys are an input of the step).
    Outside a step `keys` is None: no dropout (sampling, plain forward calls).
    """

    def __init__(self, rate: float):
        self.rate = rate
        self.keys: mx.array | None = None  # [layers, 2] uint32


def linear_features(layer: nn.Module) -> tuple[int, int]:
    """(in_features, out_features); a QuantizedLinear packs 32/bits input values per uint32."""
    out_features, stored = layer.weight.shape
    if isinstance(layer, nn.QuantizedLinear):
        return stored * 32 // layer.bits, out_features
    return stored, out_features


class LoraLinear(nn.Module):
    roles = ("lora_A", "lora_B")

    def __init__(self, base: nn.Module, A, alpha: float, index: int, dropout: DropoutKeys, low_precision: bool):
        super().__init__()
        in_features, out_features = linear_features(base)
        rank = A.shape[0]
        if A.shape[1] != in_features:
            raise ValueError(f"LoRA A has {A.shape[1]} inputs, the layer {in_features}")
        self.base_layer = base
        self.lora_A = mx.array(A, dtype=mx.float32)  # [r, in]
        self.lora_B = mx.zeros((out_features, rank), dtype=mx.float32)  # [out, r]: step 0 = base
        self.alpha, self.scale, self.index = float(alpha), float(alpha) / rank, index
        self._dropout = dropout
        # bf16 mixed precision: the branch runs in the activation dtype on the fp32 masters (as torch
        # autocast does); otherwise in fp32. Either way its output is cast back (trap 5).
        self._low_precision = low_precision

    def __call__(self, x: mx.array) -> mx.array:
        out = self.base_layer(x)  # [..., out]
        h = x if self._low_precision else x.astype(mx.float32)
        keys, rate = self._dropout.keys, self._dropout.rate
        if keys is not None and rate > 0:
            keep = mx.random.bernoulli(1.0 - rate, h.shape, key=keys[self.index])
            h = mx.where(keep, h / (1.0 - rate), mx.zeros_like(h))
        hidden = h @ self.lora_A.astype(h.dtype).T  # [..., r]
        branch = (hidden @ self.lora_B.astype(h.dtype).T) * self.scale
        return out + branch.astype(out.dtype)

    def weights(self) -> LoraWeights:
        return LoraWeights(
            A=np.array(self.lora_A, dtype=np.float32), B=np.array(self.lora_B, dtype=np.float32), alpha=self.alpha
        )

    def load(self, weights, path: str) -> None:
        if getattr(weights, "kind", "lora") != "lora":
            raise ValueError(f"{path}: the saved adapter is {weights.kind}, this run trains lora (adapter differs)")
        for name, array in (("lora_A", weights.A), ("lora_B", weights.B)):
            current = getattr(self, name)
            if tuple(array.shape) != tuple(current.shape):
                raise ValueError(
                    f"{path}.{name}: shape {tuple(array.shape)} in the file, "
                    f"{tuple(current.shape)} in this run (rank or model differ)"
                )
            setattr(self, name, mx.array(np.asarray(array, dtype=np.float32)))


def _children(node) -> Iterator[tuple[str, object]]:
    if isinstance(node, dict):  # nn.Module is a dict of parameters and children
        return ((str(k), v) for k, v in node.items() if not str(k).startswith("_"))
    if isinstance(node, (list, tuple)):
        return ((str(i), v) for i, v in enumerate(node))
    return iter(())


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every module by dotted path, in model (attribute) order: the order torch's named_modules gives."""
    stack = [("", model)]
    while stack:
        prefix, node = stack.pop()
        if isinstance(node, nn.Module) and prefix:
            yield prefix, node
        children = [
            (f"{prefix}.{key}" if prefix else key, child)
            for key, child in _children(node)
            if isinstance(child, (dict, list, tuple))
        ]
        stack.extend(reversed(children))


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {path: module for path, module in named_modules(model) if isinstance(module, LINEAR_TYPES)}


def _parent(model: nn.Module, path: str):
    *parents, last = path.split(".")
    node = model
    for part in parents:
        node = node[int(part)] if isinstance(node, (list, tuple)) else node[part]
    return node, last


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, key = _parent(model, path)
    if isinstance(parent, tuple):
        raise ValueError(f"{path}: its parent holds children in a tuple, which cannot take a LoRA layer; use a list")
    parent[int(key) if isinstance(parent, list) else key] = module


class LoraSet:
    """All LoRA layers of one run, keyed by ComfyUI module path."""

    def __init__(
        self,
        model: nn.Module,
        patterns,
        *,
        rank: int,
        alpha: float,
        dropout: float,
        seed: int,
        low_precision: bool,
        adapter: str = "lora",
        lokr_factor: int = -1,
        lokr_full_w2: bool = False,
    ):
        layers = linear_layers(model)
        self.paths = select_targets(list(layers), list(patterns))  # raises before anything changes
        self.model = model
        self.dropout = DropoutKeys(dropout)
        self.layers: dict[str, nn.Module] = {}  # LoraLinear, or an adapters.AdapterLinear
        for index, path in enumerate(self.paths):
            base = layers[path]
            in_features, out_features = linear_features(base)
            if adapter == "lora":
                layer = LoraLinear(
                    base, init_lora_A(seed, path, rank, in_features), alpha, index, self.dropout, low_precision
                )
            else:
                layer = adapters.build(
                    adapter,
                    base,
                    path,
                    in_features,
                    out_features,
                    rank=rank,
                    alpha=alpha,
                    seed=seed,
                    lokr_factor=lokr_factor,
                    lokr_full_w2=lokr_full_w2,
                    low_precision=low_precision,
                )
            _replace(model, path, layer)
            self.layers[path] = layer

    def set_dropout_key(self, key: mx.array | None) -> None:
        """Inside a traced step: one key per layer from `key`; None switches dropout off."""
        use = key is not None and self.dropout.rate > 0
        self.dropout.keys = mx.random.split(key, len(self.layers)) if use else None

    def parameters(self) -> dict[str, mx.array]:
        """Stable order: module order, then each layer's roles (A before B); names as the torch backend's."""
        return {f"{path}.{role}": getattr(layer, role) for path, layer in self.layers.items() for role in layer.roles}

    def set_parameters(self, params: dict[str, mx.array]) -> None:
        for name, value in params.items():
            path, kind = name.rsplit(".", 1)
            setattr(self.layers[path], kind, value)

    def parameter_count(self) -> int:
        return sum(p.size for p in self.parameters().values())

    @contextmanager
    def disabled(self):
        """Within the block the model runs without its LoRA (the base model: DOP's target): the base layers
        sit on their parents, and the same LoRA layers go back afterwards (inside a traced step too)."""
        for path, layer in self.layers.items():
            _replace(self.model, path, layer.base_layer)
        try:
            yield
        finally:
            for path, layer in self.layers.items():
                _replace(self.model, path, layer)

    def remove(self) -> None:
        """Put every base layer back where its LoRA layer was: the model is as before injection."""
        for path, layer in self.layers.items():
            _replace(self.model, path, layer.base_layer)
        self.layers = {}
