"""Optimizers as a dict registry, global-norm clipping as one batched reduction."""
from __future__ import annotations

from typing import Callable

import torch

from ...config import OPTIMIZER_NAMES, TrainConfig


class OptimizerUnavailable(RuntimeError):
    """The chosen optimizer needs a package that is not installed; says which and what to pick instead."""


def _adamw(params, cfg: TrainConfig, device: torch.device):
    # fused on CUDA (one kernel for all tensors); foreach elsewhere.
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                             fused=fused or None, foreach=None if fused else True)


def _adamw8bit(params, cfg: TrainConfig, device: torch.device):
    try:
        import bitsandbytes
    except ImportError as err:
        raise OptimizerUnavailable(
            "optimizer 'adamw8bit' needs bitsandbytes (NVIDIA GPUs): pip install bitsandbytes, "
            "or choose optimizer 'adamw'") from err
    return bitsandbytes.optim.AdamW8bit(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                        eps=cfg.adam_eps, weight_decay=cfg.weight_decay)


def _adafactor(params, cfg: TrainConfig, device: torch.device):
    return torch.optim.Adafactor(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                 foreach=True)


def _prodigy(params, cfg: TrainConfig, device: torch.device):
    try:
        from prodigyopt import Prodigy
    except ImportError as err:
        raise OptimizerUnavailable(
            "optimizer 'prodigy' needs prodigyopt: pip install prodigyopt, or choose optimizer 'adamw'") from err
    return Prodigy(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                   weight_decay=cfg.weight_decay, eps=cfg.adam_eps)


OPTIMIZERS: dict[str, Callable] = {
    "adamw": _adamw,
    "adamw8bit": _adamw8bit,
    "adafactor": _adafactor,
    "prodigy": _prodigy,
}
assert tuple(OPTIMIZERS) == OPTIMIZER_NAMES, "config.OPTIMIZER_NAMES and the torch registry must agree"


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, device: torch.device):
    return OPTIMIZERS[cfg.optimizer](params, cfg, device)


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
