"""A training session on a ComfyUI MODEL: fully loaded, grad on, inference tensors made normal, the
stop button deferred to step boundaries; and the memory given back afterwards.

Every prompt runs under torch.inference_mode(): models loaded in a prompt hold inference tensors,
which autograd cannot save, so a training session swaps them for normal copies (same values).
ComfyUI's own model management (loads, evictions, validation sampling and its VAE decode) still runs
under inference mode, as in ComfyUI's nodes: a model whose weights were made in a prompt and moved
outside inference mode keeps Parameters without a version counter (`param.data = ...`), which later
prompts' ops refuse ("Inference tensors do not track version counter": ComfyUI 0.33's VAE Decode
after a run on an H100, bench/RESULTS.md).
"""
from __future__ import annotations

import contextlib
import gc

import comfy.model_management as mm
import comfy.ops
import torch

from . import paths as comfy_paths  # which of ComfyUI's code paths training takes (attention, quantized matmuls)

Interrupted = mm.InterruptProcessingException  # raised by the stop button (ProgressBar hook, comfy ops)


def trainable(model):
    """The patcher to train and sample on. ComfyUI ≥0.17 on NVIDIA runs models with dynamic VRAM
    (comfy-aimdo), which streams weights and never loads them whole; ComfyUI's own escape hatch,
    `get_non_dynamic_delegate()`, gives a plain patcher over a second copy of the weights (what its
    samplers use for hooked conds). Other patchers come back unchanged."""
    if model.is_dynamic():
        try:
            return model.get_non_dynamic_delegate()
        except RuntimeError as error:  # a patcher not made by a loader cannot be re-created
            raise RuntimeError(f"this model runs with dynamic VRAM and ComfyUI cannot make a fully loaded copy "
                               f"({error}); restart ComfyUI with --disable-dynamic-vram to train with Kiln") from error
    return model


@contextlib.contextmanager
def training_session(model, device=None, *, quantized_matmul: bool = False):
    """Grad on, inference mode off, `in_training` set, the model fully on its compute device.
    quantized_matmul: keep ComfyUI's fp8 matmuls on a quantized base (off: dequantized, see below).

    Yields (diffusion_model module, torch.device). The stop button is honoured at step boundaries
    (Progress.update) rather than inside a forward or backward. On exit the flags come back; the
    model stays loaded and its weights keep their values (inference tensors became normal tensors).
    """
    wanted = None if device in (None, "", "auto") else torch.device(device)
    if wanted is not None and (wanted.type != model.load_device.type
                               or wanted.index not in (None, model.load_device.index)):
        raise ValueError(f"ComfyUI loads this model on {model.load_device}, not {device}; set device to auto, or "
                         "start ComfyUI on the device you want (--cpu, --cuda-device N)")
    if model.is_dynamic():
        raise RuntimeError("training_session needs bridge.trainable(model): this patcher uses dynamic VRAM, "
                           "which never loads weights fully")
    previous = mm.in_training
    with torch.inference_mode(False), torch.enable_grad(), _run_every_op(_deferring_run_every_op), \
            comfy_paths.training(model, quantized_matmul=quantized_matmul):
        try:
            mm.in_training = True
            _SESSIONS.append(model)
            _load_fully(model)
            yield model.model.diffusion_model, model.load_device
        finally:
            _SESSIONS.remove(model)
            mm.in_training = previous


_SESSIONS: list = []  # models in an open training_session (innermost last); sampling() reloads it after


@contextlib.contextmanager
def sampling(reload_after=None):
    """Sampling between training steps (or outside a session): inference mode, in_training off (the
    inference RoPE path), the stop button live. Afterwards the model of the open training_session (or
    reload_after) is loaded fully again: sampling may have loaded another clone (e.g. the model without
    the training adapter) or evicted it for the VAE."""
    previous = mm.in_training
    try:
        mm.in_training = False
        # inference mode, as ComfyUI's KSampler and VAE Decode run: the models the sampler and the decode load
        # or evict are moved as in a prompt (module docstring); the LoRA branches live outside ComfyUI's modules
        with torch.inference_mode(), _run_every_op(_RUN_EVERY_OP):
            yield
    finally:
        mm.in_training = previous
        training = reload_after if reload_after is not None else (_SESSIONS[-1] if _SESSIONS else None)
        if training is not None:
            reload_for_training(training)


def reload_for_training(model) -> None:
    """Load the training model fully again (after sampling loaded another clone or evicted it)."""
    with torch.inference_mode(False):
        _load_fully(model, evict_others=False)


def _load_fully(model, evict_others: bool = True) -> None:
    """load_models_gpu with no lowvram offload (and, at the start, everything else evicted, as
    nodes_train.py does with memory_required=1e20); then inference tensors become normal ones."""
    try:
        # under inference mode, as ComfyUI loads: the models it evicts for this one stay as a prompt left them
        # (module docstring); what this model gets as inference tensors becomes normal below
        with _fp32_patches(model.load_device), torch.inference_mode():
            mm.load_models_gpu([model], memory_required=1e20 if evict_others else 0, force_full_load=True)
    except torch.OutOfMemoryError as error:
        size = model.model_size() / 2**30
        raise RuntimeError(f"the model ({size:.1f} GiB) does not fit on {model.load_device} for training; use an "
                           "fp8 or smaller model, close other GPU work, or train on a larger GPU") from error
    dm = model.model.diffusion_model
    stray = sorted({str(p.device) for p in dm.parameters() if p.device != model.load_device})
    if getattr(model.model, "model_lowvram", False) or stray:
        raise RuntimeError(f"ComfyUI loaded the model only partly onto {model.load_device} (weights on {stray}); "
                           "training needs it whole: free VRAM, use a smaller/fp8 model, or run with --highvram")
    with torch.inference_mode(False):
        for module in dm.modules():
            for store in (module._parameters, module._buffers):
                for name, tensor in store.items():
                    if tensor is not None and _inference(tensor):
                        copy = tensor.clone()
                        store[name] = torch.nn.Parameter(copy, tensor.requires_grad) \
                            if isinstance(tensor, torch.nn.Parameter) else copy


@contextlib.contextmanager
def _fp32_patches(device):
    """ComfyUI sums W + ΔW in lora_compute_dtype, fp16 on CUDA sm>=8 / MPS / ROCm; a training adapter
    is merged once for a whole run, so Kiln has it summed in fp32 (rounded once to the weight dtype)."""
    table = mm.LORA_COMPUTE_DTYPES
    had, previous = device in table, table.get(device)
    table[device] = torch.float32
    try:
        yield
    finally:
        if had:
            table[device] = previous
        else:
            table.pop(device, None)


def _inference(tensor) -> bool:
    """An inference tensor, or a Parameter whose .data was swapped for one (a load under inference
    mode moves weights with `param.data = ...`; is_inference() then says False, seen on CUDA)."""
    if tensor.is_inference():
        return True
    try:
        tensor._version  # noqa: B018 — inference storage has no version counter
    except RuntimeError:
        return True
    return False


_RUN_EVERY_OP = getattr(comfy.ops, "run_every_op", None)  # every comfy layer calls it; it raises on stop


def _deferring_run_every_op() -> None:
    try:
        _RUN_EVERY_OP()
    except Interrupted:
        mm.interrupt_current_processing(True)  # keep the request: Progress.update raises it at the step's end


def _run_every_op(function):
    """Swap comfy.ops.run_every_op for the block (the stop button deferred, or live again)."""
    return comfy_paths.swapped(comfy.ops, "run_every_op", function)


def free_memory() -> None:
    """After training: drop garbage and return cached device memory to the system."""
    gc.collect()
    mm.soft_empty_cache()
