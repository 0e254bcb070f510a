"""Where a run computes: the device `device` names (auto: CUDA, else Apple's MPS, else the CPU), the dtype
its activations run in, and the device's random state and peak memory."""

from __future__ import annotations

import numpy as np
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


def rng_state(device: torch.device) -> dict[str, np.ndarray]:
    out = {"torch_cpu": torch.get_rng_state().numpy()}
    if device.type == "cuda":
        out["torch_cuda"] = torch.cuda.get_rng_state(device).numpy()
    return out


def load_rng_state(device: torch.device, tensors: dict[str, np.ndarray]) -> None:
    if "torch_cpu" in tensors:
        torch.set_rng_state(torch.from_numpy(np.array(tensors["torch_cpu"], dtype=np.uint8)))
    if "torch_cuda" in tensors and device.type == "cuda":
        torch.cuda.set_rng_state(torch.from_numpy(np.array(tensors["torch_cuda"], dtype=np.uint8)), device)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "mps":
        return int(torch.mps.driver_allocated_memory())
    return 0
