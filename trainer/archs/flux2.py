"""Flux2 (Klein 4B/9B, Dev) as ComfyUI runs it: comfy/ldm/flux/model.py.

x [B,128,H/16,W/16] (one token per latent pixel), timestep = sigma in [0,1],
context [B,512,ctx] (ComfyUI's model_base.Flux2 left-pads text to 512 tokens),
guidance [B] only for Dev (its guidance_in embedding); trained at 1.0.
"""
from __future__ import annotations

import math

import numpy as np

from . import Arch, DiffusersRule, register

CONTEXT_TOKENS = 512
TRAIN_GUIDANCE = 1.0  # Dev's distilled guidance embedding during training (ai-toolkit)


def left_pad(contexts: list[np.ndarray]) -> np.ndarray:
    """Rows [T_i,D] → [B,512,D], each row's zeros in front of its own tokens, exactly as
    ComfyUI's Flux2.extra_conds pads a single prompt (so a batch trains what sampling sees)."""
    tokens = max(CONTEXT_TOKENS, *(c.shape[0] for c in contexts))
    out = np.zeros((len(contexts), tokens, contexts[0].shape[1]), dtype=np.float32)
    for row, c in enumerate(contexts):
        out[row, tokens - c.shape[0]:] = c
    return out


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

_COMMON = dict(
    family="flux2", latent_channels=128, latent_downscale=16, patch=1, bucket_divisor=16,
    default_targets=DEFAULT_TARGETS, block_lists=("double_blocks", "single_blocks"),
    # ComfyUI samples Flux2 with mu 2.02 (ModelSamplingFlux): as a static shift that is e^2.02 ≈ 7.54.
    shift_mode="resolution", shift=math.exp(2.02), collate_context=left_pad,
    diffusers_rules=DIFFUSERS_RULES,
)

register(Arch(name="flux2_klein", model_extras=klein_extras,
              description="Flux2 Klein 4B/9B (base, undistilled); no guidance input", **_COMMON))
register(Arch(name="flux2_dev", model_extras=dev_extras,
              description="Flux2 Dev; guidance embedding fed 1.0 in training", **_COMMON))
