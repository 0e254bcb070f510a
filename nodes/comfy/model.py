"""What a ComfyUI MODEL is and Kiln's training forward through ComfyUI's own preparation.

Facts this relies on (read in ComfyUI 0.17 and 0.33):
- Flux2, Z-Image, Qwen-Image and Wan use ComfyUI's CONST flow convention: denoised = x - sigma * model_output,
  so the diffusion model's raw output is the velocity noise - x0; model_sampling.timestep(sigma) is sigma
  (Wan: sigma·1000, which the forward leaves to model_sampling as the sampler does).
- Latents: a LATENT holds raw VAE latents; the model sees latent_format.process_in(latents). A video VAE
  (Qwen-Image's and Wan's) gives an image one frame [B,C,1,h,w]: Kiln caches images [C,h,w] and puts the frame
  axis back where the latent format declares three latent dimensions; a clip [B,C,t,h,w] passes as it is.
"""

from __future__ import annotations

import comfy.clip_vision
import comfy.model_base
import comfy.model_management as mm
import comfy.model_sampling
import numpy as np
import torch

from ...trainer import archs
from ...trainer.data.companion_batch import CLIP_VISION

# ---------------------------------------------------------------- what the model is


def detect_arch(model, *, adapter: bool = False) -> str:
    """The trainer.archs name to train this MODEL as ('generic' when no family matches); with a training
    adapter, the arch that merges one (Z-Image Turbo)."""
    return archs.detect(*_model_facts(model), adapter=adapter)


def matching_archs(model) -> list[str]:
    """Every arch this MODEL can train as (Z-Image Turbo and base are one ComfyUI model)."""
    return archs.matching(*_model_facts(model))


def _model_facts(model):
    """(class names of model.model, its config class name, a reader of dotted attributes): what an
    Arch's ComfyModel compares, by name, so trainer/archs never imports ComfyUI."""
    base = model.model

    def read(path: str):
        value = base
        for part in path.split("."):
            value = getattr(value, part, None)
        return value

    return {c.__name__ for c in type(base).__mro__}, type(base.model_config).__name__, read


# Conditioning beside the cross-attention tensor that a model's extra_conds reads (comfy/model_base.py of both
# trees), by its exact comfy.model_base class: without it ComfyUI's model still runs (SD3's MMDiT leaves `y` out)
# but not as it was trained or as it samples, so training refuses rather than run silently without it.
NEEDED_CONDITIONING = {
    "SD3": ("SD 3.5", ("pooled_output",), "clip_l, clip_g and t5xxl (Triple CLIP Loader)"),
    "HiDream": (
        "HiDream",
        ("pooled_output", "conditioning_llama3"),
        "clip_l, clip_g, t5xxl and llama 3.1 (Quadruple CLIP Loader)",
    ),
}


def check_conditioning(model, names) -> None:
    """Refuse a caption cache without the conditioning this model's extra_conds reads (`names`: what the cache
    holds beside the embedding). Wan 2.1 I2V's CLIP vision features are the dataset's latent cache's, checked with
    the start images (trainer/data/companion_batch.py: check)."""
    family, needed, encoders = NEEDED_CONDITIONING.get(type(model.model).__name__, ("", (), ""))
    missing = [name for name in needed if name not in names]
    if missing:
        raise ValueError(
            f"Kiln Train LoRA: {family} takes {' and '.join(missing)} from its text encoder beside the caption "
            f"embedding, and the dataset's caption cache does not hold it (encoded with another text encoder, "
            f"or by an older Kiln): run Kiln Encode Captions again with {family}'s text encoder ({encoders})"
        )


def diffusion_model(model) -> torch.nn.Module:
    """The nn.Module the trainer injects LoRA into (module paths as in LoRA keys, minus 'diffusion_model.')."""
    return model.model.diffusion_model


# ---------------------------------------------------------------- the training forward


def make_forward(model, arch_name: str):
    """forward(dm, x_t, sigmas, context, extras) -> velocity, built from ComfyUI's own preparation.

    Conds come from the model's own `extra_conds` (exactly as sampling prepares a prompt), the
    timestep from `model_sampling.timestep`, then `_apply_model`'s casts and call. Where the arch says
    so (split_by_caption_length), rows whose padded captions differ in length run as one call per
    length (ComfyUI never batches such conds: NextDiT masks no caption padding), each row trimmed to its
    own tokens; lengths come from extras['num_tokens'] given per row, else from the all-zero padding on
    the arch's context side. Flux2 rows are left-padded to 512 as ComfyUI pads one prompt, so they batch
    as they are. Under a three-dimensional latent format the frame axis is put back around the call.
    """
    sampling = model.get_model_object("model_sampling")
    if not isinstance(sampling, comfy.model_sampling.CONST):
        raise ValueError(
            f"{type(model.model).__name__} predicts with {type(sampling).__name__}, not ComfyUI's "
            "flow-matching CONST convention; Kiln trains velocity (flow) models only"
        )
    base, options = model.model, model.model_options.get("transformer_options", {})
    arch, frames = archs.get_arch(arch_name), _frame_axis(model)

    def forward(dm, x_t, sigmas, context, extras):
        if frames and x_t.ndim == 4:  # [B,C,h,w] → the model's [B,C,1,h,w], and its output back
            return forward(dm, x_t.unsqueeze(2), sigmas, context, _one_frame(arch, extras)).squeeze(2)
        extras = dict(extras)
        groups = _row_groups(arch, context, extras)
        if len(groups) == 1:
            return _call(base, sampling, dm, options, x_t, sigmas, context[:, groups[0][1]], extras)
        outputs, order = [], []
        for rows, tokens in groups:
            index = torch.tensor(rows, device=x_t.device)
            part = {k: _rows(v, index, len(x_t)) for k, v in extras.items()}
            rows_context = context[index][:, tokens]
            outputs.append(_call(base, sampling, dm, options, x_t[index], sigmas[index], rows_context, part))
            order += rows
        return torch.cat(outputs)[torch.tensor(order, device=x_t.device).argsort()]

    return forward


def _rows(extra, index, batch: int):
    """A per-row extra for some rows: a [B,...] tensor, or each of a list of them (reference latents: one
    [B,C,h,w] per control slot, so rows of one caption length take their own references)."""
    if isinstance(extra, list):
        return [_rows(e, index, batch) for e in extra]
    return extra[index] if torch.is_tensor(extra) and extra.ndim and len(extra) == batch else extra


def _one_frame(arch, extras: dict) -> dict:
    """Cached image control latents [B,C,h,w] as the video VAE's one frame [B,C,1,h,w]: what VAEEncode gives
    TextEncodeQwenImageEdit / ReferenceLatent, and what the latent format's process_in takes."""
    references = extras.get(arch.reference_latents) if arch.reference_latents else None
    if not references:
        return extras
    return {**extras, arch.reference_latents: [r.unsqueeze(2) if r.ndim == 4 else r for r in references]}


def _frame_axis(model) -> bool:
    """A latent format of three dimensions (video VAEs: Wan 2.1 for Qwen-Image) over image latents."""
    return getattr(model.get_model_object("latent_format"), "latent_dimensions", 2) == 3


def _row_groups(arch, context, extras: dict) -> list[tuple[list[int], slice]]:
    """[(rows, token slice)]: rows whose padded captions have one length share a call; pops grouping extras."""
    total = context.shape[1]
    if not arch.split_by_caption_length:
        return [(list(range(context.shape[0])), slice(None))]
    mask, given = extras.pop("attention_mask", None), extras.pop("num_tokens", None)
    right = arch.context_side == "right"
    if mask is not None:
        lengths = torch.as_tensor(mask).sum(dim=1).tolist()
    elif given is not None and not isinstance(given, (int, np.integer)):
        lengths = list(given)
    elif total <= arch.context_tokens:  # every row padded to the same minimum: one call
        return [(list(range(context.shape[0])), slice(None))]
    else:
        nonzero = context.detach().abs().amax(dim=-1) > 0  # [B,T]; padding is exactly zero, real tokens never
        if right:  # length = last nonzero token
            lengths = (nonzero * torch.arange(1, total + 1, device=context.device)).amax(dim=1).clamp(min=1).tolist()
        else:  # left-padded: length = from the first nonzero token
            first = torch.where(nonzero.any(dim=1), nonzero.float().argmax(dim=1), total).tolist()
            lengths = [total - f for f in first]
    groups: dict[int, list[int]] = {}
    for row, length in enumerate(lengths):  # ComfyUI pads each prompt to max(context_tokens, own length)
        groups.setdefault(max(arch.context_tokens, int(length)), []).append(row)
    return [(rows, slice(0, n) if right else slice(total - n, None)) for n, rows in groups.items()]


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
    vision = kwargs.get(CLIP_VISION)
    if torch.is_tensor(vision):  # WAN21.extra_conds reads CLIPVisionEncode's output object, not a tensor
        kwargs[CLIP_VISION] = comfy.clip_vision.Output()
        kwargs[CLIP_VISION]["penultimate_hidden_states"] = vision
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
    conds = {
        k: [_convert(e, dtype, x.device) for e in v] if isinstance(v, list) else _convert(v, dtype, x.device)
        for k, v in conds.items()
    }
    t = base.process_timestep(t, x=x, **conds)
    transformer_options = {**options, "sigmas": sigma}
    if _PREFETCH_FLAG:  # tells the blocks whether to prefetch dynamic-VRAM weights (False: Kiln trains loaded)
        transformer_options["prefetch_dynamic_vbars"] = (
            base.current_patcher is not None and base.current_patcher.is_dynamic()
        )
    return dm(xc, t, context=ctx, control=None, transformer_options=transformer_options, **conds)


_CONSTANTS: dict = {}  # (device, dtype, shape, values) → the device copy of a small host cond


def _convert(extra, dtype, device):
    """comfy.model_base.convert_tensor, except for the small host tensors extra_conds builds from Python
    numbers (Flux's guidance: torch.FloatTensor([g])): their device copy is made once and kept. ComfyUI
    copies them from pageable memory at every call, which waits for the GPU once a step and cannot be
    recorded in a CUDA graph (step_graphs); kept, a recorded step reads the same device tensor each replay."""
    if not (
        torch.is_tensor(extra)
        and extra.device.type == "cpu"
        and extra.numel() <= 64
        and torch.device(device).type != "cpu"
    ):
        return comfy.model_base.convert_tensor(extra, dtype, device)
    key = (str(device), dtype, extra.dtype, tuple(extra.shape), tuple(extra.flatten().tolist()))
    if key not in _CONSTANTS:
        if len(_CONSTANTS) >= 256:  # never evicted (a recorded graph may read one): past a bound, not kept
            return comfy.model_base.convert_tensor(extra, dtype, device)
        _CONSTANTS[key] = comfy.model_base.convert_tensor(extra, dtype, device)
    return _CONSTANTS[key]


# Whether this ComfyUI's BaseModel._apply_model sets transformer_options["prefetch_dynamic_vbars"] (0.33
# does, 0.17 does not; the key is a constant of its code): _call mirrors the version it runs in, and
# tests/nodes/comfy/test_bridge.py compares the options with what ComfyUI's sampler hands the model.
_PREFETCH_FLAG = "prefetch_dynamic_vbars" in comfy.model_base.BaseModel._apply_model.__code__.co_consts


def item_latent_in(model, latent):
    """One cached item, an image [C,h,w] or a clip [C,t,h,w], in the model's latent format: through latents_in as
    a batch of one (four dimensions alone would be read as a batch of images)."""
    return latents_in(model, latent[None])[0]


def latents_in(model, latents, reverse: bool = False):
    """Raw VAE latents (a LATENT's samples, our caches) → what the diffusion model sees
    (latent_format.process_in); reverse=True goes back (process_out). numpy in, numpy out. Image
    latents [B,C,h,w] or one item [C,h,w] under a three-dimensional format (its statistics are shaped
    [1,C,1,1,1]) pass through it as one frame [B,C,1,h,w] and come back in their own shape. Clips go as a
    batch [B,C,t,h,w] (one clip [C,t,h,w] as clip[None]: four dimensions are an image batch)."""
    fmt = model.get_model_object("latent_format")
    convert = fmt.process_out if reverse else fmt.process_in
    if isinstance(latents, np.ndarray):
        return latents_in(model, torch.from_numpy(np.array(latents, np.float32)), reverse).numpy().astype(np.float32)
    if getattr(fmt, "latent_dimensions", 2) == 3 and latents.ndim in (3, 4):
        frames = convert((latents if latents.ndim == 4 else latents[None]).unsqueeze(2)).squeeze(2)
        return frames if latents.ndim == 4 else frames[0]
    return convert(latents)
