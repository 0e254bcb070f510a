"""MLX optimizers as a dict registry, global-norm clipping, and optimizer state in and out.

AdamW is built to match torch.optim.AdamW: bias correction on (MLX's default is off) and the
configured weight decay (MLX's default is 0.01), REFERENCE.md MLX trap 2. The learning rate
lives in the optimizer state as an mx.array, so setting it each step never recompiles.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ...config import MLX_OPTIMIZER_NAMES

log = logging.getLogger("kiln")

Betas = tuple[float, float]


def _adamw(lr: float, betas: Betas, eps: float, weight_decay: float) -> optim.Optimizer:
    return optim.AdamW(learning_rate=lr, betas=list(betas), eps=eps, weight_decay=weight_decay, bias_correction=True)


def _adafactor(lr: float, betas: Betas, eps: float, weight_decay: float) -> optim.Optimizer:
    # The configured learning rate (not Adafactor's relative step), scaled by the weight RMS as
    # torch.optim.Adafactor does; MLX applies the weight decay with that scaled rate.
    return optim.Adafactor(learning_rate=lr, relative_step=False, weight_decay=weight_decay)


def _adamw8bit(lr: float, betas: Betas, eps: float, weight_decay: float) -> optim.Optimizer:
    # bitsandbytes is CUDA-only: fp32 AdamW, said once (a LoRA's state is small: ~0.3 GB for Klein 4B at rank 32)
    log.warning(
        "[Kiln] optimizer adamw8bit: bitsandbytes runs on CUDA only, not with backend 'mlx'; training with fp32 "
        "AdamW instead (a LoRA's AdamW state is small: about 0.3 GB for Klein 4B at rank 32)"
    )
    return _adamw(lr, betas, eps, weight_decay)


# Every entry takes the same flat values (lr, betas, eps, weight_decay) and uses those its optimizer has.
OPTIMIZERS: dict[str, Callable[..., optim.Optimizer]] = {
    "adamw": _adamw,
    "adamw8bit": _adamw8bit,
    "adafactor": _adafactor,
}
assert tuple(OPTIMIZERS) == MLX_OPTIMIZER_NAMES, "config.MLX_OPTIMIZER_NAMES and the MLX registry must agree"


def build_optimizer(name: str, *, lr: float, betas: Betas, eps: float, weight_decay: float) -> optim.Optimizer:
    if name not in OPTIMIZERS:
        raise ValueError(
            f"optimizer {name!r} is not available with backend 'mlx'; "
            f"choose one of {list(OPTIMIZERS)} or use backend 'torch'"
        )
    return OPTIMIZERS[name](lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def clip_global_norm(grads: dict, max_norm: float) -> tuple[dict, mx.array]:
    """Total L2 norm of all grads; scales them to max_norm if above (torch's clip_grad_norm_, eps 1e-6).

    max_norm 0 only measures."""
    leaves = [g for _, g in tree_flatten(grads)]
    total = mx.sqrt(mx.sum(mx.stack([mx.sum(mx.square(g.astype(mx.float32))) for g in leaves])))
    if max_norm <= 0:
        return grads, total
    coefficient = mx.minimum(max_norm / (total + 1e-6), 1.0)
    return _tree_map(lambda g: (g * coefficient).astype(g.dtype), grads), total


def _tree_map(fn, tree):
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tree_map(fn, v) for v in tree)
    return fn(tree)


def state_out(optimizer: optim.Optimizer, names: list[str], kind: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Tensors keyed '<param name>.<state key>' (e.g. '…qkv.lora_A.m'); step and lr as JSON meta."""
    tensors, scalars = {}, {}
    known = set(names)
    for key, value in tree_flatten(optimizer.state):
        name, _, entry = key.rpartition(".")
        if name in known:
            tensors[f"{name}.{entry}"] = np.array(value)
        else:
            scalars[key] = value.item()
    return tensors, {"backend": "mlx", "optimizer": kind, "names": list(names), "scalars": scalars}


def state_in(
    optimizer: optim.Optimizer, names: list[str], kind: str, tensors: dict[str, np.ndarray], meta: dict[str, Any]
) -> None:
    """Write saved state into the optimizer's own state tree, in place (a compiled step holds that tree)."""
    if meta.get("backend") != "mlx":
        raise ValueError(
            f"the optimizer state was saved by the {meta.get('backend', 'torch')!r} backend; "
            "resume with that backend (optimizer moments do not cross backends)"
        )
    if meta.get("names") != list(names) or meta.get("optimizer") != kind:
        raise ValueError(
            "optimizer state belongs to other LoRA parameters or another optimizer (targets, rank or optimizer changed)"
        )
    current = dict(tree_flatten(optimizer.state))
    updates = {**{key: np.asarray(array) for key, array in tensors.items()}, **meta["scalars"]}
    missing = sorted(set(current) - set(updates))
    if missing:
        raise ValueError(f"optimizer state lacks {len(missing)} entries, e.g. {missing[:3]}")
    for key, value in updates.items():
        if key not in current:
            raise ValueError(f"optimizer state has an entry this run does not: {key}")
        if np.shape(value) != tuple(current[key].shape):
            raise ValueError(f"optimizer state {key}: shape {np.shape(value)} saved, {tuple(current[key].shape)} here")
        _assign(optimizer.state, key, mx.array(value, dtype=current[key].dtype))


def _assign(tree, dotted: str, value: mx.array) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    tree[int(last) if isinstance(tree, list) else last] = value
