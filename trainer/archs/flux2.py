"""Flux2 (Klein 4B/9B, Dev) as ComfyUI runs it: comfy/ldm/flux/model.py.

x [B,128,H/16,W/16] (one token per latent pixel), timestep = sigma in [0,1],
context [B,512,ctx] (ComfyUI's model_base.Flux2 left-pads text to 512 tokens),
guidance [B] only for Dev (its guidance_in embedding); trained at 1.0.
"""
from __future__ import annotations

import math

import numpy as np

from . import Arch, ComfyModel, DiffusersRule, register

CONTEXT_TOKENS = 512  # model_base.Flux2.extra_conds left-pads one prompt to this (a batch trains what sampling sees)
TRAIN_GUIDANCE = 1.0  # Dev's distilled guidance embedding during training (ai-toolkit)
IMPLEMENTATION = "https://github.com/black-forest-labs/flux2"


def dev_extras(batch_size: int, lengths: list[int]) -> dict:
    return {"guidance": np.full((batch_size,), TRAIN_GUIDANCE, dtype=np.float32)}


def klein_extras(batch_size: int, lengths: list[int]) -> dict:
    return {}


DEFAULT_TARGETS = (
    "img_attn.qkv", "img_attn.proj", "txt_attn.qkv", "txt_attn.proj",
    "img_mlp.0", "img_mlp.2", "txt_mlp.0", "txt_mlp.2",
    "linear1", "linear2",
)

# ComfyUI path → diffusers Flux2Transformer2DModel names (comfy/utils.py flux2 map).
DIFFUSERS_RULES = (
    DiffusersRule(r"double_blocks\.(\d+)\.img_attn\.qkv",
                  ("transformer_blocks.{0}.attn.to_q", "transformer_blocks.{0}.attn.to_k",
                   "transformer_blocks.{0}.attn.to_v")),
    DiffusersRule(r"double_blocks\.(\d+)\.txt_attn\.qkv",
                  ("transformer_blocks.{0}.attn.add_q_proj", "transformer_blocks.{0}.attn.add_k_proj",
                   "transformer_blocks.{0}.attn.add_v_proj")),
    DiffusersRule(r"double_blocks\.(\d+)\.img_attn\.proj", ("transformer_blocks.{0}.attn.to_out.0",)),
    DiffusersRule(r"double_blocks\.(\d+)\.txt_attn\.proj", ("transformer_blocks.{0}.attn.to_add_out",)),
    DiffusersRule(r"double_blocks\.(\d+)\.img_mlp\.0", ("transformer_blocks.{0}.ff.linear_in",)),
    DiffusersRule(r"double_blocks\.(\d+)\.img_mlp\.2", ("transformer_blocks.{0}.ff.linear_out",)),
    DiffusersRule(r"double_blocks\.(\d+)\.txt_mlp\.0", ("transformer_blocks.{0}.ff_context.linear_in",)),
    DiffusersRule(r"double_blocks\.(\d+)\.txt_mlp\.2", ("transformer_blocks.{0}.ff_context.linear_out",)),
    DiffusersRule(r"single_blocks\.(\d+)\.linear1", ("single_transformer_blocks.{0}.attn.to_qkv_mlp_proj",)),
    DiffusersRule(r"single_blocks\.(\d+)\.linear2", ("single_transformer_blocks.{0}.attn.to_out",)),
)

MODULE_MARKER = r"^(double_blocks|single_blocks)\.\d+\."  # ComfyUI module paths of a Flux2 LoRA

_COMMON = dict(
    family="flux2", latent_channels=128, latent_downscale=16, patch=1, bucket_divisor=16,
    default_targets=DEFAULT_TARGETS, block_lists=("double_blocks", "single_blocks"),
    # ComfyUI samples Flux2 with mu 2.02 (ModelSamplingFlux): as a static shift that is e^2.02 ≈ 7.54.
    shift_mode="resolution", shift=math.exp(2.02),
    # Left-padded to 512: a longer caption pads the batch further, and such rows run alone (as ComfyUI's).
    context_side="left", context_tokens=CONTEXT_TOKENS, split_by_caption_length=True,
    clip_type="FLUX2", mlx_model="flux2", diffusers_rules=DIFFUSERS_RULES,
)

# Klein and Dev are one ComfyUI class; Dev has the guidance embedding (comfy/model_detection.py).
register(Arch(name="flux2_klein", model_extras=klein_extras, module_marker=MODULE_MARKER,
              comfy=ComfyModel("Flux2", attributes=(("diffusion_model.params.guidance_embed", False),)),
              modelspec=("Flux.2-klein/lora", IMPLEMENTATION),
              description="Flux2 Klein 4B/9B (base, undistilled); no guidance input", **_COMMON))
register(Arch(name="flux2_dev", model_extras=dev_extras,
              comfy=ComfyModel("Flux2", attributes=(("diffusion_model.params.guidance_embed", True),)),
              modelspec=("Flux.2-dev/lora", IMPLEMENTATION),
              description="Flux2 Dev; guidance embedding fed 1.0 in training", **_COMMON))
