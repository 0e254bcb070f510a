"""The one file of the pack that touches ComfyUI's MODEL (ModelPatcher), CLIP, VAE, CONDITIONING,
LORA_MODEL and LOSS_MAP (with nodes/lora_patch.py for LoRAs through ComfyUI's loader, re-exported
here). Nodes stay thin and call these functions; trainer/ never sees ComfyUI.

Facts this relies on (read in ComfyUI 0.17):
- Flux2 and Z-Image use ComfyUI's CONST flow convention: denoised = x - sigma * model_output, so the
  diffusion model's raw output is the velocity noise - x0, and model_sampling.timestep(sigma) == sigma.
- Latents: a LATENT holds raw VAE latents; the model sees latent_format.process_in(latents).
- Every prompt runs under torch.inference_mode(): models loaded in a prompt hold inference tensors,
  which autograd cannot save, so a training session swaps them for normal copies (same values).
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import sys

import comfy.model_base
import comfy.model_management as mm
import comfy.model_sampling
import comfy.ops
import comfy.sample
import comfy.samplers
import comfy.supported_models
import comfy.utils
import folder_paths
import numpy as np
import torch
from comfy.cli_args import args
from PIL import Image

from . import comfy_paths  # which of ComfyUI's code paths training takes (attention, quantized matmuls)
# LoRAs through ComfyUI's loader live in lora_patch.py; re-exported so nodes call bridge.* throughout.
from .lora_patch import (apply_lora, load_lora_file, lora_model_from, lora_weights_from,  # noqa: F401
                         negate_lora, require_fit, training_adapter_merged, unmatched_lora_keys)

Interrupted = mm.InterruptProcessingException  # raised by the stop button (ProgressBar hook, comfy ops)
FLUX2_CONTEXT = 512                            # model_base.Flux2.extra_conds pads text to this


# ---------------------------------------------------------------- what the model is

def detect_arch(model) -> str:
    """'flux2_klein', 'flux2_dev' (has guidance_in), 'zimage' (the node picks turbo/base) or 'generic'."""
    base = model.model
    if isinstance(base, comfy.model_base.Flux2):
        return "flux2_dev" if base.diffusion_model.params.guidance_embed else "flux2_klein"
    config = base.model_config
    pixel = getattr(comfy.supported_models, "ZImagePixelSpace", ())
    if isinstance(base, comfy.model_base.Lumina2) and isinstance(config, comfy.supported_models.ZImage) \
            and not isinstance(config, pixel):
        return "zimage"
    return "generic"


def diffusion_model(model) -> torch.nn.Module:
    """The nn.Module the trainer injects LoRA into (module paths as in LoRA keys, minus 'diffusion_model.')."""
    return model.model.diffusion_model


def compute_dtype(model) -> torch.dtype:
    """The dtype ComfyUI runs the model in (manual-cast dtype for fp8 weights, else the weight dtype)."""
    return model.model.get_dtype_inference()


# ---------------------------------------------------------------- the training forward

def make_forward(model, arch_name: str):
    """forward(dm, x_t, sigmas, context, extras) -> velocity, built from ComfyUI's own preparation.

    Conds come from the model's own `extra_conds` (exactly as sampling prepares a prompt), the
    timestep from `model_sampling.timestep`, then `_apply_model`'s casts and call. A batch whose
    Z-Image captions differ in length runs as one call per length (ComfyUI never batches such conds:
    NextDiT masks no caption padding), each row trimmed to its own tokens; lengths come from
    extras['num_tokens'] given per row, else from the trailing all-zero rows of right-padded context.
    Flux2 rows are left-padded to 512 as ComfyUI pads one prompt, so they batch as they are.
    """
    sampling = model.get_model_object("model_sampling")
    if not isinstance(sampling, comfy.model_sampling.CONST):
        raise ValueError(f"{type(model.model).__name__} predicts with {type(sampling).__name__}, not ComfyUI's "
                         "flow-matching CONST convention; Kiln trains velocity (flow) models only")
    base, options = model.model, model.model_options.get("transformer_options", {})

    def forward(dm, x_t, sigmas, context, extras):
        extras = dict(extras)
        groups = _row_groups(arch_name, context, extras)
        if len(groups) == 1:
            return _call(base, sampling, dm, options, x_t, sigmas, context[:, groups[0][1]], extras)
        outputs, order = [], []
        for rows, tokens in groups:
            index = torch.tensor(rows, device=x_t.device)
            part = {k: v[index] if torch.is_tensor(v) and v.ndim and len(v) == len(x_t) else v
                    for k, v in extras.items()}
            rows_context = context[index][:, tokens]
            outputs.append(_call(base, sampling, dm, options, x_t[index], sigmas[index], rows_context, part))
            order += rows
        return torch.cat(outputs)[torch.tensor(order, device=x_t.device).argsort()]

    forward.compute_dtype = compute_dtype(model)
    return forward


def _row_groups(arch_name: str, context, extras: dict) -> list[tuple[list[int], slice]]:
    """[(rows, token slice)]: rows whose captions have one length share a call; pops grouping extras."""
    zimage, total = arch_name.startswith("zimage"), context.shape[1]
    mask, given = (extras.pop("attention_mask", None), extras.pop("num_tokens", None)) if zimage else (None, None)
    if mask is not None:
        lengths = torch.as_tensor(mask).sum(dim=1).tolist()
    elif given is not None and not isinstance(given, (int, np.integer)):
        lengths = list(given)
    elif zimage or (arch_name.startswith("flux2") and total > FLUX2_CONTEXT):
        nonzero = context.detach().abs().amax(dim=-1) > 0  # [B,T]; padding is exactly zero, real tokens never
        if zimage:  # right-padded: length = last nonzero token
            lengths = (nonzero * torch.arange(1, total + 1, device=context.device)).amax(dim=1).clamp(min=1).tolist()
        else:  # left-padded to the longest: ComfyUI pads each prompt to max(512, own length)
            first = torch.where(nonzero.any(dim=1), nonzero.float().argmax(dim=1), total).tolist()
            lengths = [max(FLUX2_CONTEXT, total - f) for f in first]
    else:
        return [(list(range(context.shape[0])), slice(None))]
    groups: dict[int, list[int]] = {}
    for row, length in enumerate(lengths):
        groups.setdefault(int(length), []).append(row)
    return [(rows, slice(0, n) if zimage else slice(total - n, None)) for n, rows in groups.items()]


def _call(base, sampling, dm, options: dict, x, sigma, context, extras: dict):
    """model_base.BaseModel.extra_conds + _apply_model, returning the raw model output (velocity)."""
    kwargs = {"cross_attn": context, "pooled_output": None, "noise": x, "device": x.device}
    guidance = extras.pop("guidance", None)
    if guidance is not None:  # Flux.extra_conds takes one float per prompt
        values = torch.as_tensor(guidance).float().flatten().unique()
        if values.numel() != 1:
            raise ValueError(f"one guidance value per batch is supported, got {values.tolist()}")
        kwargs["guidance"] = float(values[0])
    kwargs.update(extras)
    conds = {k: c.process_cond(batch_size=x.shape[0], area=None).cond for k, c in base.extra_conds(**kwargs).items()}
    dtype = base.get_dtype_inference()
    xc = sampling.calculate_input(sigma, x)
    concat = conds.pop("c_concat", None)
    if concat is not None:
        xc = torch.cat([xc, mm.cast_to_device(concat, xc.device, xc.dtype)], dim=1)
    ctx = conds.pop("c_crossattn", None)
    xc = xc.to(dtype)
    t = sampling.timestep(sigma).float()
    if ctx is not None:
        ctx = mm.cast_to_device(ctx, x.device, dtype)
    conds = {k: [comfy.model_base.convert_tensor(e, dtype, x.device) for e in v] if isinstance(v, list)
             else comfy.model_base.convert_tensor(v, dtype, x.device) for k, v in conds.items()}
    t = base.process_timestep(t, x=x, **conds)
    transformer_options = {**options, "sigmas": sigma}
    if _PREFETCH_FLAG:  # tells the blocks whether to prefetch dynamic-VRAM weights (False: Kiln trains loaded)
        transformer_options["prefetch_dynamic_vbars"] = base.current_patcher is not None \
            and base.current_patcher.is_dynamic()
    return dm(xc, t, context=ctx, control=None, transformer_options=transformer_options, **conds)


# Whether this ComfyUI's BaseModel._apply_model sets transformer_options["prefetch_dynamic_vbars"] (0.33
# does, 0.17 does not; the key is a constant of its code): _call mirrors the version it runs in, and
# tests/nodes/test_bridge.py compares the options with what ComfyUI's sampler hands the model.
_PREFETCH_FLAG = "prefetch_dynamic_vbars" in comfy.model_base.BaseModel._apply_model.__code__.co_consts


# ---------------------------------------------------------------- latents, images, text

def latents_in(model, latents, reverse: bool = False):
    """Raw VAE latents (a LATENT's samples, our caches) → what the diffusion model sees
    (latent_format.process_in); reverse=True goes back (process_out). numpy in, numpy out."""
    fmt = model.get_model_object("latent_format")
    convert = fmt.process_out if reverse else fmt.process_in
    if isinstance(latents, np.ndarray):
        return convert(torch.from_numpy(np.array(latents, np.float32))).numpy().astype(np.float32)
    return convert(latents)


def vae_encoder(vae):
    """(encode, identity): encode(pixels [B,H,W,3] float32 in [0,1]) -> raw VAE latents [B,C,h,w]
    float32, exactly VAEEncode's output (no process_in: caches stay model-independent)."""
    ratio = vae.downscale_ratio

    def encode(pixels: np.ndarray) -> np.ndarray:
        pixels = np.asarray(pixels, dtype=np.float32)
        if pixels.ndim != 4 or pixels.shape[-1] < 3:
            raise ValueError(f"expected images [B,H,W,3], got {list(pixels.shape)}")
        if isinstance(ratio, int) and (pixels.shape[1] % ratio or pixels.shape[2] % ratio):
            raise ValueError(f"image {pixels.shape[2]}x{pixels.shape[1]} is not a multiple of the VAE's {ratio} px; "
                             "ComfyUI would crop it, so the bucket plan would not match")
        with torch.inference_mode():
            latents = vae.encode(torch.from_numpy(np.ascontiguousarray(pixels[..., :3])))
        return latents.float().cpu().numpy()

    identity = _remembered(vae, lambda: _identity(
        "vae", type(vae.first_stage_model).__name__, vae.latent_channels, ratio, vae.vae_dtype,
        tensors=_weights(vae.patcher), patches=vae.patcher.patches))
    return encode, identity


def text_encoder(clip):
    """(encode, identity): encode(text) -> [T,D] float32, CLIPTextEncode's cond tensor for that text.

    The conditioning's other keys need not be kept: pooled_output is None for the Qwen/Mistral
    encoders, and attention_mask is unused by Flux2 (ComfyUI reads it only with
    attention_mask_img_shape) and all ones for one Z-Image prompt (so only num_tokens = T counts).
    """
    def encode(text: str) -> np.ndarray:
        with torch.inference_mode():
            conds = clip.encode_from_tokens_scheduled(clip.tokenize(text))
        if len(conds) != 1:
            raise ValueError(f"this CLIP gives {len(conds)} scheduled conds (CLIP hooks); Kiln caches one per caption")
        return conds[0][0][0].float().cpu().numpy()

    identity = _remembered(clip, lambda: _identity(
        "clip", type(clip.cond_stage_model).__name__, type(clip.tokenizer).__name__,
        clip.layer_idx, sorted(getattr(clip, "tokenizer_options", {}).items()),
        tensors=_weights(clip.patcher), patches=clip.patcher.patches))
    return encode, identity


def _remembered(owner, compute) -> str:
    """An encoder's identity, computed once per VAE/CLIP object: ComfyUI may cast an encoder's weights
    when it moves them to the GPU (seen on an H200 with an fp32 text encoder), and a later hash of
    the cast weights would miss the cache. Patching a VAE/CLIP (LoRA on CLIP) clones the object,
    so a changed encoder still gets a new identity."""
    cached = getattr(owner, "_kiln_identity", None)
    if cached is None:
        cached = compute()
        try:
            owner._kiln_identity = cached
        except AttributeError:  # an object that takes no attributes: recompute each time
            pass
    return cached


def _weights(patcher):
    """The model's own weights, with in-place-patched ones swapped back for their originals."""
    sd = patcher.model.state_dict()
    for key, backup in getattr(patcher, "backup", {}).items():
        if key in sd:
            sd[key] = backup.weight
    return sd


def _identity(kind: str, *facts, tensors: dict, patches: dict) -> str:
    """A stable cache key: facts, every tensor's name/shape/dtype and a strided sample of its values."""
    digest = hashlib.sha256(repr((kind, facts)).encode())

    def feed(name: str, value) -> None:
        if not torch.is_tensor(value):
            digest.update(f"{name}={value!r};".encode())
            return
        digest.update(f"{name}:{tuple(value.shape)}:{value.dtype};".encode())
        try:
            flat = value.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 64)][:64].float().cpu().numpy()
            digest.update(sample.tobytes())
        except Exception:  # noqa: BLE001  (quantized or meta tensors: shape and dtype only)
            pass

    for key in sorted(tensors):
        feed(key, tensors[key])
    for key in sorted(patches):
        for number, patch in enumerate(patches[key]):
            strength, data, strength_model = patch[0], patch[1], patch[2]
            feed(f"{key}#{number}", (strength, strength_model, type(data).__name__))
            for index, value in enumerate(getattr(data, "weights", data if isinstance(data, tuple) else ())):
                feed(f"{key}#{number}.{index}", value if torch.is_tensor(value) else repr(value)[:64])
    return f"{kind}-{digest.hexdigest()[:24]}"


# ---------------------------------------------------------------- a training session

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


_SESSIONS: list = []  # models in an open training_session (innermost last); sample() reloads it after


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


def loss_map(history_loss) -> dict:
    """LOSS_MAP as ComfyUI's LossGraph reads it: {'loss': [float, ...]} (non-finite values left out;
    LossGraph itself needs at least two distinct values)."""
    return {"loss": [float(v) for v in history_loss if np.isfinite(v)]}


# ---------------------------------------------------------------- sampling, progress, folders

def sample(model, positive, negative, vae, *, seed: int, steps: int, cfg: float, sampler_name: str,
           scheduler: str, width: int, height: int, reload_after=None) -> torch.Tensor:
    """One image through ComfyUI's own sampler (comfy.sample.sample) and vae.decode: IMAGE [1,H,W,3].

    Runs under no_grad with in_training off (the inference RoPE path) and the stop button live;
    LoRA side branches installed in the module forwards take part. Afterwards the model of the open
    training_session (or reload_after) is loaded fully again: sampling may have loaded another clone
    (e.g. the model without the training adapter) or evicted it for the VAE."""
    fmt = model.get_model_object("latent_format")
    down = getattr(fmt, "spacial_downscale_ratio", 8)
    if width % down or height % down:
        raise ValueError(f"sample size {width}x{height} must be a multiple of {down} px for this model")
    latent = torch.zeros([1, fmt.latent_channels, height // down, width // down])
    latent = comfy.sample.fix_empty_latent_channels(model, latent)
    noise = comfy.sample.prepare_noise(latent, seed)
    previous = mm.in_training
    try:
        mm.in_training = False
        with torch.no_grad(), _run_every_op(_RUN_EVERY_OP), comfy_paths.sampling(model):
            samples = comfy.sample.sample(model, noise, steps, cfg, sampler_name, scheduler, positive, negative,
                                          latent, denoise=1.0, disable_pbar=True, seed=seed)
            images = vae.decode(samples)
    finally:
        mm.in_training = previous
        training = reload_after if reload_after is not None else (_SESSIONS[-1] if _SESSIONS else None)
        if training is not None:
            reload_for_training(training)
    return images.reshape(-1, *images.shape[-3:])[..., :3]


def sampler_names() -> list[str]:
    return list(comfy.samplers.KSampler.SAMPLERS)


def scheduler_names() -> list[str]:
    return list(comfy.samplers.KSampler.SCHEDULERS)


def image_tensor(picture) -> torch.Tensor:
    """A PIL image → IMAGE [1,H,W,3] float in [0,1]."""
    return torch.from_numpy(np.asarray(picture.convert("RGB"), dtype=np.float32) / 255.0)[None]


def cat_images(images: list[torch.Tensor]) -> torch.Tensor:
    """IMAGE batches → one IMAGE batch; smaller images are padded (black) to the largest size."""
    height, width = max(i.shape[1] for i in images), max(i.shape[2] for i in images)
    return torch.cat([torch.nn.functional.pad(i, (0, 0, 0, width - i.shape[2], 0, height - i.shape[1]))
                      for i in images])


class Progress:
    """Per-step progress on the node (comfy.utils.ProgressBar) that also honours the stop button."""

    def __init__(self, total: int):
        self.bar = comfy.utils.ProgressBar(total)

    def update(self, step: int, preview=None, *, preview_pil=None) -> None:
        """preview: a PIL image or an IMAGE tensor (its first image), shown on the node."""
        mm.throw_exception_if_processing_interrupted()  # raises Interrupted; the hook may be throttled
        picture = preview if preview is not None else preview_pil
        if torch.is_tensor(picture):
            picture = Image.fromarray((picture.reshape(-1, *picture.shape[-3:])[0].clamp(0, 1) * 255)
                                      .round().byte().cpu().numpy())
        shown = None if picture is None else ("JPEG", picture, args.preview_size)
        self.bar.update_absolute(step, self.bar.total, shown)


def progress(total: int) -> Progress:
    return Progress(total)


def send_event(name: str, data) -> bool:
    """PromptServer.instance.send_sync(name, data) to every client; False when no server runs (tests)."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is None:
        return False
    instance.send_sync(name, data)
    return True


def folders() -> dict[str, str]:
    return {"input": folder_paths.get_input_directory(), "output": folder_paths.get_output_directory(),
            "loras": folder_paths.get_folder_paths("loras")[0]}


def lora_names() -> list[str]:
    """The files LoraLoader lists (relative names under every models/loras folder)."""
    return folder_paths.get_filename_list("loras")


def lora_path(name: str) -> str:
    """A LoraLoader name → its full path (raises if it is not there)."""
    return folder_paths.get_full_path_or_raise("loras", name)


def refresh_loras() -> None:
    """Forget the cached `loras` file list so LoraLoader's next listing (object_info) sees new files."""
    folder_paths.filename_list_cache.pop("loras", None)
    helper = getattr(folder_paths, "cache_helper", None)  # per-prompt cache, active while validating
    if helper is not None:
        helper.cache.pop("loras", None)
