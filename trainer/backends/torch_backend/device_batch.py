"""A micro-batch's arrays on the training device: the flow tensors in fp32, the context in the model's dtype,
and the model's extras where ComfyUI expects each kind."""

from __future__ import annotations

import numpy as np
import torch

from ...data.companion_batch import RAW_EXTRAS


def to_device(array: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor.to(device, dtype=dtype)
    # One host pass into pinned memory already in the dtype the GPU wants (a bf16 context crosses at
    # half its fp32 size, not cast again there; the same rounding), then an async copy. The pinned
    # block is the caching host allocator's, reused once the copy from it has run. At small buckets
    # the host paces the step, and this pass was a share of it (bench/RESULTS.md).
    staged = torch.empty(tensor.shape, dtype=dtype or tensor.dtype, pin_memory=True)
    staged.copy_(tensor)
    return staged.to(device, non_blocking=True)


def flow_tensors(batch, device: torch.device) -> dict:
    """The micro-batch's latents, noise, σ, weights and mask on the device in fp32 (every loss's). A clip's
    latents [B,C,T,H,W] take an image mask [B,1,H,W] on every frame ([B,1,1,H,W])."""
    mask = batch.mask
    if mask is not None and mask.ndim == 4 and batch.latents.ndim == 5:
        mask = mask[:, :, None]
    return {
        "x0": to_device(batch.latents, device, torch.float32),
        "noise": to_device(batch.noise, device, torch.float32),
        "sigmas": to_device(batch.sigmas, device, torch.float32),
        "weights": to_device(batch.weights, device, torch.float32),
        "mask": None if mask is None else to_device(mask, device, torch.float32),
    }


def extras_on_device(extras: dict, device: torch.device, dtype: torch.dtype) -> dict:
    # Per-row numbers stay on the host: integers (token counts) choose shapes, and ComfyUI reads a
    # per-row float (Dev's guidance) as a Python number; on the GPU either would be read back once a
    # step, stalling the host (bench/RESULTS.md, lever "no host sync") and any step graph's recording.
    # Other float extras go to the device in the model dtype. Reference latents (edit training, a
    # list) and a start image's (image-to-video, RAW_EXTRAS): raw fp32 VAE latents and CLIP vision features, as
    # ComfyUI's conds hold them.
    return {
        k: (
            torch.from_numpy(np.ascontiguousarray(v))
            if np.issubdtype(v.dtype, np.integer)
            else to_device(v, device, torch.float32)
            if k in RAW_EXTRAS
            else torch.from_numpy(np.ascontiguousarray(v)).to(dtype)
            if v.ndim == 1
            else to_device(v, device, dtype)
        )
        if isinstance(v, np.ndarray)
        else [to_device(a, device, torch.float32) for a in v]
        if isinstance(v, list)
        else v
        for k, v in extras.items()
    }
