"""Optimizers as a dict registry, global-norm clipping as one batched reduction.

Every registry entry takes the same flat values, (params, lr, betas, eps, weight_decay, device), and
uses those its optimizer has; the backend reads them off the config."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ...config import OPTIMIZER_NAMES


class OptimizerUnavailable(RuntimeError):
    """The chosen optimizer needs a package that is not installed; says which and what to pick instead."""


Betas = tuple[float, float]


def _adamw(params, lr: float, betas: Betas, eps: float, weight_decay: float, device: torch.device):
    # fused on CUDA (one kernel for all tensors); foreach elsewhere.
    fused = device.type == "cuda"
    return torch.optim.AdamW(
        params,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        fused=fused or None,
        foreach=None if fused else True,
    )


def _adamw8bit(params, lr: float, betas: Betas, eps: float, weight_decay: float, device: torch.device):
    try:
        import bitsandbytes
    except ImportError as err:
        raise OptimizerUnavailable(
            "optimizer 'adamw8bit' needs bitsandbytes (NVIDIA GPUs): pip install bitsandbytes, "
            "or choose optimizer 'adamw'"
        ) from err
    return bitsandbytes.optim.AdamW8bit(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def _adafactor(params, lr: float, betas: Betas, eps: float, weight_decay: float, device: torch.device):
    return torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay, foreach=True)


def _prodigy(params, lr: float, betas: Betas, eps: float, weight_decay: float, device: torch.device):
    try:
        from prodigyopt import Prodigy
    except ImportError as err:
        raise OptimizerUnavailable(
            "optimizer 'prodigy' needs prodigyopt: pip install prodigyopt, or choose optimizer 'adamw'"
        ) from err
    return Prodigy(params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)


OPTIMIZERS: dict[str, Callable] = {
    "adamw": _adamw,
    "adamw8bit": _adamw8bit,
    "adafactor": _adafactor,
    "prodigy": _prodigy,
}
assert tuple(OPTIMIZERS) == OPTIMIZER_NAMES, "config.OPTIMIZER_NAMES and the torch registry must agree"


def build_optimizer(
    params: list[torch.nn.Parameter],
    name: str,
    *,
    lr: float,
    betas: Betas,
    eps: float,
    weight_decay: float,
    device: torch.device,
):
    return OPTIMIZERS[name](params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, device=device)


@torch.no_grad()
def clip_global_norm(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Total L2 norm of all grads (a device scalar, no host sync); scales them to max_norm if above.

    Per-tensor norms come from one foreach kernel and are stacked into one
    reduction: no Python loop that chains hundreds of small ops. Same result as
    torch.nn.utils.clip_grad_norm_ (eps 1e-6). max_norm 0 only measures.
    """
    if not grads:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if max_norm > 0:
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coefficient)
    return total


def optimizer_arrays(optimizer: torch.optim.Optimizer, names: list[str]):
    """The optimizer's state as tensors keyed '<param name>.<state key>' (`names` in parameter order);
    everything else as JSON-able meta."""
    index_to_name = dict(enumerate(names))
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entries in state["state"].items():
        name = index_to_name[index]
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"{name}.{key}"] = value.detach().cpu().numpy()
            else:
                scalars[f"{name}.{key}"] = value
    meta = {
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]],
        "scalars": scalars,
        "names": list(names),
    }
    return tensors, meta


def load_optimizer_arrays(optimizer: torch.optim.Optimizer, names: list[str], tensors, meta) -> None:
    """optimizer_arrays' output back into `optimizer`, whose parameters must be the same `names`."""
    if meta.get("names") != names:
        raise ValueError("optimizer state belongs to other LoRA parameters (targets or rank changed)")
    template = optimizer.state_dict()
    index_of = {name: index for index, name in enumerate(names)}
    state: dict[int, dict] = {}
    # Keys are '<param name>.<state key>'; state keys hold no dots.
    for key, array in tensors.items():
        name, entry = key.rsplit(".", 1)
        state.setdefault(index_of[name], {})[entry] = torch.from_numpy(np.array(array))
    for key, value in meta["scalars"].items():
        name, entry = key.rsplit(".", 1)
        state.setdefault(index_of[name], {})[entry] = value
    groups = [
        {**saved, "params": group["params"]} for saved, group in zip(meta["param_groups"], template["param_groups"])
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
