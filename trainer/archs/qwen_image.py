"""Qwen-Image as ComfyUI runs it: comfy/ldm/qwen_image/model.py QwenImageTransformer2DModel.

A 20B MMDiT: 60 two-stream `transformer_blocks` (joint attention over caption + image tokens),
conditioned on Qwen2.5-VL 7B's last hidden state (context [B,T,3584], the chat template's tokens
cut off, no padding for one prompt: ComfyUI drops an all-ones attention mask). x is the Wan 2.1
latent [B,16,1,H/8,W/8] (a video VAE's single frame; Kiln caches [16,H/8,W/8] and the bridge adds
the frame axis the latent format declares), patch 2 inside the model; timestep = sigma; CONST flow
output (model_base.QwenImage, ModelType.FLUX). ComfyUI's module names are diffusers' own, so the
diffusers export renames nothing.
"""
from __future__ import annotations

import math
import re

from . import Arch, ComfyModel, DiffusersRule, caption_lengths, register

# The block Linears (diffusers and ComfyUI names alike). Targets leave out the modulation (img_mod,
# txt_mod: 6·D outputs each, a third of a block's weights) as the Flux2 defaults do.
ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
             "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
MLP = ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")
MODULATION = ("img_mod.1", "txt_mod.1")
DEFAULT_TARGETS = ATTENTION + MLP

# Same names on both sides: one identity rule per block Linear and per top-level Linear.
_TOP_LEVEL = ("img_in", "txt_in", "proj_out", "norm_out.linear",
              "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2")
DIFFUSERS_RULES = tuple(
    DiffusersRule(r"transformer_blocks\.(\d+)\." + re.escape(name), ("transformer_blocks.{0}." + name,))
    for name in ATTENTION + MLP + MODULATION
) + tuple(DiffusersRule(re.escape(name), (name,)) for name in _TOP_LEVEL)

register(Arch(
    name="qwen_image", family="qwen_image", latent_channels=16, latent_downscale=8, patch=2, bucket_divisor=16,
    default_targets=DEFAULT_TARGETS, block_lists=("transformer_blocks",),
    # ComfyUI samples Qwen-Image with ModelSamplingFlux at shift 1.15 (supported_models.QwenImage), a
    # static e^1.15 ≈ 3.16: training draws the timesteps the sampler visits.
    shift_mode="static", shift=math.exp(1.15),
    # Captions vary in length and ComfyUI runs each prompt alone, unpadded: rows of one length share a call.
    model_extras=caption_lengths, split_by_caption_length=True,
    comfy=ComfyModel("QwenImage", config_class="QwenImage"),  # not MageFlow, a QwenImage subclass
    clip_type="QWEN_IMAGE", module_marker=r"^transformer_blocks\.\d+\.(img|txt)_mlp\.net\.",
    modelspec=("Qwen-Image/lora", "https://github.com/QwenLM/Qwen-Image"),
    diffusers_rules=DIFFUSERS_RULES,
    description="Qwen-Image (20B MMDiT, Qwen2.5-VL text encoder); PyTorch backend",
))
