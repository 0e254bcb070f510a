"""Differential output preservation's loss on the PyTorch backend (trainer/objective/preservation.py)."""

from __future__ import annotations

import torch

from ...objective.flow import interpolate, velocity_target
from .device_batch import flow_tensors


def loss(backend, batch) -> torch.Tensor:
    """Differential output preservation (trainer/objective/preservation.py): the base model's prediction on the
    class-word captions (LoRA off, no grad; a compiled block runs eagerly without grad, so nothing
    recompiles) is the target of the LoRA's, from one forward of the rows and their class-word rows."""
    kept, amp, flow = batch.preservation, backend._amp(), flow_tensors(batch, backend.device)
    x0, noise, sigmas, weights, mask = (flow[k] for k in ("x0", "noise", "sigmas", "weights", "mask"))
    x_t, target = interpolate(x0, noise, sigmas), velocity_target(x0, noise)
    x_in, rows = x_t.to(backend.dtype), x_t.shape[0]
    with torch.no_grad(), amp, backend.lora.disabled():  # not through DDP: no gradient to average
        base = backend.forward(
            backend.model, x_in, sigmas, backend._to_device(kept.context, backend.dtype), backend._extras(kept.extras)
        ).float()
    with amp:
        prediction = backend.call(
            torch.cat([x_in, x_in]),
            torch.cat([sigmas, sigmas]),
            backend._to_device(kept.joint_context, backend.dtype),
            backend._extras(kept.joint_extras),
        )
    squared = (prediction[:rows].float() - target).square()
    if mask is not None:  # masked training weighs the trained rows' cells; the preserved rows stay whole
        squared = squared * mask
    trained = squared.flatten(1).mean(dim=1)  # [B]
    preserved = (prediction[rows:].float() - base).square().flatten(1).mean(dim=1)  # [B]
    return (trained * weights).mean() + (preserved * backend._to_device(kept.weights, torch.float32)).mean()
