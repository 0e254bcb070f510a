"""offload_activations: the inputs a checkpointed block keeps for its backward wait in pinned host memory instead of
on the GPU. With per-block checkpointing a step keeps one input per block: for a long clip that is most of the
step's memory (Wan 14B at 480x832 x 81 frames: 40 x 0.33 GB), and the host holds it for the price of two copies
per block (out in the forward, back in the backward), small beside a video block's compute.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

# A kept input at least this large moves to the host under offload_activations; the rest (timestep embeddings,
# a caption's context, the RoPE table) is small beside a clip's hidden states and stays.
OFFLOAD_MIN_BYTES = 1 << 20
OFFLOAD_FROM = ("cuda",)  # device types whose tensors move (tests add "cpu": a copy stands for the host's)


def _to_host(t: torch.Tensor):
    """saved_tensors_hooks pack: a large CUDA tensor copied into pinned host memory, queued on the compute stream
    (its memory is reused only by later kernels of that stream, which the copy precedes)."""
    if t.device.type not in OFFLOAD_FROM or t.numel() * t.element_size() < OFFLOAD_MIN_BYTES:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=t.device.type == "cuda")
    host.copy_(t, non_blocking=True)
    return (t.device, host)


def _from_host(packed):
    return packed if torch.is_tensor(packed) else packed[1].to(packed[0], non_blocking=True)


def offloaded(block):
    """`block` (eager on copies of its inputs, or compiled) under torch's reentrant checkpoint, whose kept inputs are
    saved tensors of its autograd node and so pass saved_tensors_hooks: on the host until the backward needs them
    (as OneTrainer's activation offloading and musubi-tuner's --gradient_checkpointing_cpu_offload). The non-reentrant checkpoint keeps its inputs in a
    closure no hook sees. Reentrant takes tensors positionally: keyword arguments ride along by name; one input
    requires grad so the block's LoRA gets its gradient where nothing upstream is trained (the first block)."""

    def offloaded(*args, **kwargs):
        names, count = list(kwargs), len(args)

        def run(*flat):
            return block(*flat[:count], **dict(zip(names, flat[count:])))

        flat = [*args, *kwargs.values()]
        if not any(torch.is_tensor(t) and t.requires_grad for t in flat):
            first = next((i for i, t in enumerate(flat) if torch.is_tensor(t) and t.is_floating_point()), None)
            if first is not None:
                flat[first] = flat[first].detach().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(_to_host, _from_host):
            return checkpoint(run, *flat, use_reentrant=True)

    return offloaded
