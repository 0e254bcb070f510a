"""Which SDPA kernel the model's attention runs on while Kiln trains it (config key `attention`).

ComfyUI's models call torch's scaled_dot_product_attention; torch picks the first kernel in its
priority order that supports the inputs (flash, then memory-efficient, math, cuDNN last). A choice
here moves one kernel to the front for the training step (forward, backward and checkpointing's
recompute) and leaves the rest of torch's order behind it, so an input the preferred kernel cannot
take still runs. Sampling and the rest of ComfyUI keep torch's own order.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # torch without the priority API: every choice is torch's own order
    SDPBackend = sdpa_kernel = None

# Kernel tried first per setting; "torch" keeps torch's own order. Names match config.CHOICES["attention"].
PREFERRED = {
    "torch": None,
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}

# "auto": the kernel measured fastest for training per CUDA compute capability (bench/RESULTS.md,
# "Attention kernel"); anything not listed, and CPU / MPS, keeps torch's order.
AUTO_BY_CAPABILITY = {(9, 0): "cudnn"}


def resolve(setting: str, device: torch.device) -> str:
    """The concrete choice ("torch", "cudnn", ...) for a config value on a device."""
    if setting != "auto":
        return setting
    if device.type == "cuda":
        return AUTO_BY_CAPABILITY.get(torch.cuda.get_device_capability(device), "torch")
    return "torch"


def priority(choice: str) -> list | None:
    """The backend order for sdpa_kernel(set_priority=True); None = torch's own."""
    name = PREFERRED[choice]
    if name is None or sdpa_kernel is None:
        return None
    first = getattr(SDPBackend, name)
    # Behind it, torch's order over the kernels enabled now (one a user switched off stays off).
    enabled = set(torch.nn.attention._cur_sdpa_kernel_backends())
    default = [SDPBackend(i) for i in torch._C._get_sdp_priority_order()]
    return [first] + [b for b in default if b != first and b in enabled]


def kernel_context(choice: str):
    """A context manager putting `choice`'s kernel first (a no-op for "torch")."""
    order = priority(choice)
    return nullcontext() if order is None else sdpa_kernel(order, set_priority=True)
