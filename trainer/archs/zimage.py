"""Z-Image (Turbo and base) as ComfyUI runs it: comfy/ldm/lumina/model.py NextDiT.

x [B,16,H/8,W/8] (patch 2 inside the model), timesteps = sigma, context
[B,T,2560], num_tokens = T; the model embeds 1 - t and returns -output, so
ComfyUI's flow velocity convention (denoised = x - sigma*v) holds unchanged.
Turbo is distilled: its training adapter is merged at +1 for training, removed
for validation samples, never saved.
"""
from __future__ import annotations

from . import Arch, ComfyModel, DiffusersRule, caption_lengths, register


DEFAULT_TARGETS = (
    "attention.qkv", "attention.out",
    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
)

# ComfyUI path → diffusers ZImageTransformer2DModel names (comfy/utils.py z_image map).
DIFFUSERS_RULES = tuple(
    rule
    for group in ("layers", "noise_refiner", "context_refiner")
    for rule in (
        DiffusersRule(group + r"\.(\d+)\.attention\.qkv",
                      (group + ".{0}.attention.to_q", group + ".{0}.attention.to_k",
                       group + ".{0}.attention.to_v")),
        DiffusersRule(group + r"\.(\d+)\.attention\.out", (group + ".{0}.attention.to_out.0",)),
        DiffusersRule(group + r"\.(\d+)\.feed_forward\.(w[123])", (group + ".{0}.feed_forward.{1}",)),
    )
)

_COMMON = dict(
    family="zimage", latent_channels=16, latent_downscale=8, patch=2, bucket_divisor=16,
    default_targets=DEFAULT_TARGETS,
    block_lists=("noise_refiner", "context_refiner", "layers"),
    shift_mode="static", shift=3.0, diffusers_rules=DIFFUSERS_RULES, pure_blocks=True,
    # Per-row caption lengths: ComfyUI runs each prompt alone (NextDiT ignores masks and attends to
    # its zero padding), so a forward splits rows of different lengths into separate calls.
    model_extras=caption_lengths, split_by_caption_length=True,
    # A Lumina2 model with the ZImage config (not ZImagePixelSpace); the Lumina2 text encoder slot.
    comfy=ComfyModel("Lumina2", config_class="ZImage"), clip_type="LUMINA2", mlx_model="zimage",
)
_IMPLEMENTATION = "https://github.com/Tongyi-MAI/Z-Image"

# Turbo and base are one ComfyUI model: Turbo is what a model with a training adapter trains as.
register(Arch(name="zimage_turbo", training_adapter="merge", modelspec=("Z-Image-Turbo/lora", _IMPLEMENTATION),
              description="Z-Image Turbo (distilled): training adapter merged for training", **_COMMON))
register(Arch(name="zimage", modelspec=("Z-Image/lora", _IMPLEMENTATION),
              module_marker=r"^(layers|noise_refiner|context_refiner)\.\d+\.(attention|feed_forward)",
              description="Z-Image base", **_COMMON))
