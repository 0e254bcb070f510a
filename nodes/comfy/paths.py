"""Which of ComfyUI's own code paths a training session takes, and how sampling inside a run goes back
to ComfyUI's: its SDPA entry point (whose kernel order would override Kiln's `attention` choice) and the
fp8 matmuls of quantized checkpoints. Used by nodes/comfy/'s training_session and sample().
"""

from __future__ import annotations

import contextlib

import comfy.ops
import torch

# ComfyUI's quantized checkpoints (fp8 files: comfy_quant weights) load into its mixed-precision Linear,
# which runs fp8 matmuls where the GPU has them, through comfy.ops.QuantLinearFunc when training. Kiln's
# side branches leave that path on (ComfyUI's own trainer, whose LoRA is a weight function, never takes
# it). On an H100 (ComfyUI 0.33, 1024 px) that path made a Klein 4B step 2.1x and a Z-Image step 1.25x
# slower than dequantizing each weight to the compute dtype (0.843 vs 0.402 s, 0.794 vs 0.635 s; bf16
# bases 0.390 and 0.520), and training_fp8_bwd added 2.6-3.3 GiB without speed (bench/RESULTS.md,
# "Quantized bases"). So a session dequantizes (`_full_precision_mm`; the fp8 storage and its memory saving
# stay) unless asked not to, and sampling inside a run goes back to ComfyUI's own path.
_COMFYS_FULL_PRECISION = "_kiln_comfys_full_precision_mm"


def _quantized_layers(model) -> list:
    return [
        m
        for m in model.model.diffusion_model.modules()
        if getattr(m, "layout_type", None) is not None and hasattr(m, "_full_precision_mm")
    ]


@contextlib.contextmanager
def _dequantized(model, on: bool):
    layers = _quantized_layers(model) if on else []
    for layer in layers:
        layer.__dict__.setdefault(_COMFYS_FULL_PRECISION, layer._full_precision_mm)
        layer._full_precision_mm = True
    try:
        yield
    finally:
        for layer in layers:
            layer._full_precision_mm = layer.__dict__.pop(_COMFYS_FULL_PRECISION)


@contextlib.contextmanager
def _comfys_own_matmul(model):
    """Within a training session's dequantizing: ComfyUI's own setting back for the block (sampling)."""
    layers = [m for m in _quantized_layers(model) if _COMFYS_FULL_PRECISION in m.__dict__]
    for layer in layers:
        layer._full_precision_mm = layer.__dict__[_COMFYS_FULL_PRECISION]
    try:
        yield
    finally:
        for layer in layers:
            layer._full_precision_mm = True


# ComfyUI's own SDPA entry point. From 0.2x on CUDA (0.17: on Windows only) it runs every call inside
# sdpa_kernel([flash, cuDNN, efficient, math], set_priority=True). In training that overrides the kernel
# Kiln's `attention` setting chose, and on an H100 (ComfyUI 0.33, torch 2.11) a checkpointed Z-Image block's
# forward and its recompute then ran different kernels (cuDNN vs flash: CheckpointError, saved tensors of
# other shapes). A training session calls SDPA plainly, under Kiln's choice; sampling keeps ComfyUI's.
_COMFY_SDPA = getattr(comfy.ops, "scaled_dot_product_attention", None)


def _training_sdpa(q, k, v, *args, **kwargs):
    """ComfyUI's SDPA call without its kernel order: grouped-query attention with a mask is expanded as
    ComfyUI expands it; everything else goes to torch as it comes."""
    attn_mask = args[0] if args else kwargs.get("attn_mask")
    if (
        kwargs.get("enable_gqa", False)
        and attn_mask is not None
        and q.shape[-3] != k.shape[-3]
        and hasattr(comfy.ops, "repeat_kv_for_gqa")
    ):  # (0.17 passes enable_gqa to torch as it is)
        k, v = comfy.ops.repeat_kv_for_gqa(k, v, q.shape[-3], -3)
        kwargs["enable_gqa"] = False
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, *args, **kwargs)


@contextlib.contextmanager
def swapped(owner, name: str, value):
    """`owner.name = value` for the block, the previous value back after (a no-op where owner has no name)."""
    if not hasattr(owner, name):
        yield
        return
    previous = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, previous)


@contextlib.contextmanager
def training(model, *, quantized_matmul: bool = False):
    """The paths a training step takes: SDPA under Kiln's kernel choice, a quantized base dequantized."""
    with swapped(comfy.ops, "scaled_dot_product_attention", _training_sdpa), _dequantized(model, not quantized_matmul):
        yield


@contextlib.contextmanager
def sampling(model):
    """Inside a training session, ComfyUI's own paths again for the block (validation samples)."""
    with swapped(comfy.ops, "scaled_dot_product_attention", _COMFY_SDPA), _comfys_own_matmul(model):
        yield
