"""A training session on a ComfyUI MODEL: fully loaded, grad on, inference tensors made normal, the
stop button deferred to step boundaries; and the memory given back afterwards.

Every prompt runs under torch.inference_mode(): models loaded in a prompt hold inference tensors,
which autograd cannot save, so a training session swaps them for normal copies (same values). The
other models ComfyUI moves meanwhile (its evictions, a validation sample's loads) are mended back to
inference tensors afterwards (mend_moved_weights).
"""

from __future__ import annotations

import contextlib
import gc

import comfy.model_management as mm
import comfy.ops
import torch

from . import (
    paths as comfy_paths,  # which of ComfyUI's code paths training takes (attention, quantized matmuls)
)

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
            raise RuntimeError(
                f"this model runs with dynamic VRAM and ComfyUI cannot make a fully loaded copy "
                f"({error}); restart ComfyUI with --disable-dynamic-vram to train with Kiln"
            ) from error
    return model


@contextlib.contextmanager
def training_session(model, device=None, *, quantized_matmul: bool = False, step_room=None):
    """Grad on, inference mode off, `in_training` set, the model fully on its compute device.
    quantized_matmul: keep ComfyUI's fp8 matmuls on a quantized base (off: dequantized, see below).
    step_room(total GPU bytes) -> the bytes Kiln's step needs beside the weights, or None: where it is given and
    the model does not fit the GPU whole, ComfyUI's own partial load places what fits with that room left, and
    the rest stays on the host for Kiln's stream (stream_blocks, trainer/backends/torch_backend/memory_plan.py).

    Yields (diffusion_model module, torch.device). The stop button is honoured at step boundaries
    (Progress.update) rather than inside a forward or backward. On exit the flags come back; the
    model stays loaded and its weights keep their values (normal tensors during the session; inference
    tensors again after one in a prompt).
    """
    wanted = None if device in (None, "", "auto") else torch.device(device)
    if wanted is not None and (
        wanted.type != model.load_device.type or wanted.index not in (None, model.load_device.index)
    ):
        raise ValueError(
            f"ComfyUI loads this model on {model.load_device}, not {device}; set device to auto, or "
            "start ComfyUI on the device you want (--cpu, --cuda-device N)"
        )
    if model.is_dynamic():
        raise RuntimeError(
            "training_session needs bridge.trainable(model): this patcher uses dynamic VRAM, "
            "which never loads weights fully"
        )
    previous, in_a_prompt = mm.in_training, torch.is_inference_mode_enabled()
    partly = None  # what undoes a partial load's bookkeeping
    with (
        torch.inference_mode(False),
        torch.enable_grad(),
        _run_every_op(_deferring_run_every_op),
        comfy_paths.training(model, quantized_matmul=quantized_matmul),
    ):
        try:
            mm.in_training = True
            _SESSIONS.append(model)
            others = _prompt_models(model)
            partly = _load_partly(model, step_room) if step_room is not None else None
            if partly is None:
                _load_fully(model)  # evicts the others, outside inference mode (it loads none of them)
            mend_moved_weights(others)
            yield model.model.diffusion_model, model.load_device
        finally:
            if partly is not None:
                partly()
            _SESSIONS.remove(model)
            mm.in_training = previous
            if in_a_prompt:
                _as_a_prompt_left_them(model.model.diffusion_model)


_SESSIONS: list = []  # models in an open training_session (innermost last); sampling() reloads it after


def training_model():
    """The patcher of the innermost open training session, or None."""
    return _SESSIONS[-1] if _SESSIONS else None


@contextlib.contextmanager
def sampling(reload_after=None):
    """Sampling between training steps (or outside a session): no grad, in_training off (the inference
    RoPE path), the stop button live. Afterwards the model of the open training_session (or
    reload_after) is loaded fully again: sampling may have loaded another clone (e.g. the model without
    the training adapter) or evicted it for the VAE."""
    previous = mm.in_training
    training = reload_after if reload_after is not None else (_SESSIONS[-1] if _SESSIONS else None)
    moved = _prompt_models(training)
    try:
        mm.in_training = False
        with torch.no_grad(), _run_every_op(_RUN_EVERY_OP), _kept_loaded(training):
            yield
    finally:
        mm.in_training = previous
        moved += _prompt_models(training)  # the sampler's and the VAE's, which the reload may evict
        if training is not None:
            reload_for_training(training)  # loads only the training model
        mend_moved_weights(moved)


def _kept_loaded(training):
    """ComfyUI's free_memory with the training model kept loaded while a sample is taken: unloading it for the
    VAE would move weights Kiln placed (a streamed block's point into its GPU ring) and cost a whole reload after;
    ComfyUI's VAE decodes in tiles where it runs short instead."""

    def free_memory(memory_required, device, keep_loaded=(), *args, **kwargs):
        kept = [loaded for loaded in mm.current_loaded_models if training is not None and loaded.model is training]
        return _FREE_MEMORY(memory_required, device, [*keep_loaded, *kept], *args, **kwargs)

    return comfy_paths.swapped(mm, "free_memory", free_memory)


_FREE_MEMORY = mm.free_memory


def _load_partly(model, step_room):
    """A model too large for the GPU whole: ComfyUI's own partial load with `step_room` left free, each weight
    patched where it lies (force_patch_weights: no per-use patch functions), the rest on the host, where Kiln's
    stream takes it from without a second copy. None where the model fits whole (then _load_fully). Returns
    what undoes the session's bookkeeping: for the session ComfyUI counts the model as loaded whole (Kiln places
    its weights, and ComfyUI must not move them) and its offloaded Linears as plain ones."""
    from ...trainer.backends.torch_backend import levers

    device = model.load_device
    if device.type != "cuda":
        return None
    mm.free_memory(1e30, device)  # the others go, as for a full load (and this model's earlier load)
    free, total = levers.free_bytes(device)  # under a process cap (a simulated card), the cap's
    # weights already there count as free (a model built on the GPU, whose offload device is the GPU itself)
    there = sum(t.numel() * t.element_size() for t in model.model.state_dict().values() if t.device.type == device.type)
    room = step_room(total)
    if room is None or model.model_size() + room <= free + there:
        return None
    comfy_free = mm.get_free_memory(device)
    # ComfyUI loads up to its free memory less minimum_memory_required (its extra reserve added)
    keep = max(0, comfy_free - (free - room) - mm.extra_reserved_memory())
    with _fp32_patches(device):
        mm.load_models_gpu([model], minimum_memory_required=keep, force_patch_weights=True)
    inner = model.model
    if not getattr(inner, "model_lowvram", False):
        return None
    getattr(model, "unpin_all_weights", lambda: None)()  # Kiln's stream pins what it takes; its copies drop pins
    casts = [(m, m.comfy_cast_weights) for m in inner.modules() if hasattr(m, "prev_comfy_cast_weights")]
    for module, _ in casts:
        module.comfy_cast_weights = module.prev_comfy_cast_weights
    counted = inner.model_lowvram, inner.model_loaded_weight_memory
    inner.model_lowvram, inner.model_loaded_weight_memory = False, model.model_size()
    with torch.inference_mode(False):
        _copied(inner.diffusion_model, lambda tensor: tensor is not None and _inference(tensor))

    def undo() -> None:
        inner.model_lowvram, inner.model_loaded_weight_memory = counted
        for module, cast in casts:
            module.comfy_cast_weights = cast

    return undo


def reload_for_training(model) -> None:
    """Load the training model fully again (after sampling loaded another clone or evicted it)."""
    with torch.inference_mode(False):
        _load_fully(model, evict_others=False)


def _load_fully(model, evict_others: bool = True) -> None:
    """load_models_gpu with no lowvram offload (and, at the start, everything else evicted, as
    nodes_train.py does with memory_required=1e20); then inference tensors become normal ones."""
    try:
        with _fp32_patches(model.load_device):
            mm.load_models_gpu([model], memory_required=1e20 if evict_others else 0, force_full_load=True)
    except torch.OutOfMemoryError as error:
        size = model.model_size() / 2**30
        raise RuntimeError(
            f"the model ({size:.1f} GiB) does not fit on {model.load_device} for training; use an "
            "fp8 or smaller model, close other GPU work, or train on a larger GPU"
        ) from error
    dm = model.model.diffusion_model
    stray = sorted({str(p.device) for p in dm.parameters() if p.device != model.load_device})
    if getattr(model.model, "model_lowvram", False) or stray:
        raise RuntimeError(
            f"ComfyUI loaded the model only partly onto {model.load_device} (weights on {stray}); "
            "training needs it whole: free VRAM, use a smaller/fp8 model, or run with --highvram"
        )
    with torch.inference_mode(False):
        _copied(dm, lambda tensor: tensor is not None and _inference(tensor))


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


def _prompt_models(training=None) -> list[torch.nn.Module]:
    """The modules of the models ComfyUI has loaded now, except the training model's (and its clones')."""
    modules = []
    for loaded in list(mm.current_loaded_models):
        module = getattr(loaded.model, "model", None)  # LoadedModel.model: its patcher (a weak reference)
        if isinstance(module, torch.nn.Module) and (training is None or module is not training.model):
            modules.append(module)
    return modules


def mend_moved_weights(modules) -> int:
    """ComfyUI's models hold inference tensors (a prompt made them). Moved by ComfyUI's model management
    while a session has inference mode off (the eviction at its start, a validation sample's loads), a
    weight keeps its Parameter object with `.data` swapped (Module._apply): it says it is no inference
    tensor but has no version counter, and ops that read it fail in later prompts too ("Inference tensors
    do not track version counter": ComfyUI 0.33's VAE Decode after a run on an H100, bench/RESULTS.md).
    Each such weight becomes an inference tensor again, as the prompt left it, in a new Parameter (as
    ComfyUI's own set_attr_param does); tensor subclasses (quantized weights) are left alone. Returns how
    many were mended. Running ComfyUI's moves under inference mode instead would move the training model's
    normal weights there too, which ComfyUI's quantized Linear refuses ("Cannot set version_counter")."""
    unique = {id(module): module for module in modules}.values()
    with torch.inference_mode():
        return sum(
            _copied(module, lambda t: type(t) in (torch.Tensor, torch.nn.Parameter) and _moved_out(t))
            for module in unique
        )


def _as_a_prompt_left_them(module) -> None:
    """The training model's weights inference tensors again at the end of a session in a prompt, as ComfyUI's
    loaders made them (same values, new Parameters as ComfyUI's set_attr_param makes them). Left normal,
    ComfyUI's later loads and evictions, which run under inference mode, fail on a quantized base's weights
    (its Linear re-wraps each moved weight: "Cannot set version_counter for inference tensor", on a model
    trained on an fp8 checkpoint and unloaded and loaded again by a later prompt). A sharded base's DTensors
    are left alone: FSDP2 keeps each shard too, so a copy would hold every shard twice (Qwen-Image sharded over
    two 24 GB cards ran out of memory here after its last step), and a sharded model never returns to a prompt."""
    with torch.inference_mode():
        _copied(module, lambda t: t is not None and not t.is_inference() and not hasattr(t, "device_mesh"))


def _copied(module, chosen) -> int:
    """Each parameter and buffer of `module` for which `chosen` is true replaced by a clone made in the caller's
    mode (normal or inference tensor), a Parameter again with its requires_grad; returns how many."""
    count = 0
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for name, tensor in store.items():
                if chosen(tensor):
                    copy = tensor.clone()
                    store[name] = (
                        torch.nn.Parameter(copy, tensor.requires_grad)
                        if isinstance(tensor, torch.nn.Parameter)
                        else copy
                    )
                    count += 1
    return count


def _moved_out(tensor) -> bool:
    """A prompt's tensor whose Parameter had its .data swapped outside inference mode (no version counter)."""
    return not tensor.is_inference() and _inference(tensor)


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
