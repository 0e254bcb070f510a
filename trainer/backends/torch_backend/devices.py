"""Where a run computes: the device `device` names (auto: CUDA, else Apple's MPS, else the CPU) and the dtype
its activations run in."""

from __future__ import annotations

import torch
from torch import nn


def pick_device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype activations run in: the first parameter's, skipping fp8 storage (cast on forward)."""
    for param in model.parameters():
        if param.dtype in _COMPUTE_DTYPES:
            return param.dtype
    return torch.bfloat16
