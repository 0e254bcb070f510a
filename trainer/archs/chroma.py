"""Chroma as ComfyUI runs it: comfy/ldm/chroma/model.py Chroma (model_base.Chroma, a Flux subclass).

A Flux.1-schnell-shaped MMDiT (19 double, 38 single blocks, hidden 3072) without per-block modulation
Linears: one `distilled_guidance_layer` approximator gives every block its shift/scale/gate. x is the Flux
latent [B,16,H/8,W/8] (patch 2 inside the model), context T5-XXL's unpadded tokens [B,T,4096] (ComfyUI's
PixArt tokenizer: no padding, so each prompt runs at its own length and masks nothing), timestep = sigma,
CONST flow output (ModelType.FLUX). Guidance: extra_conds puts 0 when the prompt carries none, as the bridge
leaves it.
"""

from __future__ import annotations

import math

from .base import Arch, ComfyModel, DiffusersRule, Sampling, caption_lengths

# ai-toolkit, musubi-tuner and SimpleTuner train every Linear of the double and single blocks (Chroma's blocks
# hold no modulation Linears); the approximator, embedders and final layer stay frozen.
DEFAULT_TARGETS = (
    "img_attn.qkv",
    "img_attn.proj",
    "txt_attn.qkv",
    "txt_attn.proj",
    "img_mlp.0",
    "img_mlp.2",
    "txt_mlp.0",
    "txt_mlp.2",
    "linear1",
    "linear2",
)

HIDDEN, MLP_HIDDEN = 3072, 4 * 3072  # Chroma's one size: single-block linear1 = q, k, v, then the MLP input

# ComfyUI path → diffusers ChromaTransformer2DModel names (Flux.1's layout: comfy/utils.py flux_to_diffusers).
DIFFUSERS_RULES = (
    DiffusersRule(
        r"double_blocks\.(\d+)\.img_attn\.qkv",
        ("transformer_blocks.{0}.attn.to_q", "transformer_blocks.{0}.attn.to_k", "transformer_blocks.{0}.attn.to_v"),
    ),
    DiffusersRule(
        r"double_blocks\.(\d+)\.txt_attn\.qkv",
        (
            "transformer_blocks.{0}.attn.add_q_proj",
            "transformer_blocks.{0}.attn.add_k_proj",
            "transformer_blocks.{0}.attn.add_v_proj",
        ),
    ),
    DiffusersRule(r"double_blocks\.(\d+)\.img_attn\.proj", ("transformer_blocks.{0}.attn.to_out.0",)),
    DiffusersRule(r"double_blocks\.(\d+)\.txt_attn\.proj", ("transformer_blocks.{0}.attn.to_add_out",)),
    DiffusersRule(r"double_blocks\.(\d+)\.img_mlp\.0", ("transformer_blocks.{0}.ff.net.0.proj",)),
    DiffusersRule(r"double_blocks\.(\d+)\.img_mlp\.2", ("transformer_blocks.{0}.ff.net.2",)),
    DiffusersRule(r"double_blocks\.(\d+)\.txt_mlp\.0", ("transformer_blocks.{0}.ff_context.net.0.proj",)),
    DiffusersRule(r"double_blocks\.(\d+)\.txt_mlp\.2", ("transformer_blocks.{0}.ff_context.net.2",)),
    DiffusersRule(
        r"single_blocks\.(\d+)\.linear1",
        (
            "single_transformer_blocks.{0}.attn.to_q",
            "single_transformer_blocks.{0}.attn.to_k",
            "single_transformer_blocks.{0}.attn.to_v",
            "single_transformer_blocks.{0}.proj_mlp",
        ),
        split_sizes=(HIDDEN, HIDDEN, HIDDEN, MLP_HIDDEN),
    ),
    DiffusersRule(r"single_blocks\.(\d+)\.linear2", ("single_transformer_blocks.{0}.proj_out",)),
)

ARCHS = (
    Arch(
        name="chroma",
        family="chroma",
        latent_channels=16,
        latent_downscale=8,
        patch=2,
        bucket_divisor=16,
        default_targets=DEFAULT_TARGETS,
        block_lists=("double_blocks", "single_blocks"),
        # ComfyUI loads Chroma with ModelSamplingFlux at its default shift 1.15 (sampling_settings set none): a
        # static e^1.15 ≈ 3.16, the σ schedule its sampler visits.
        shift_mode="static",
        shift=math.exp(1.15),
        model_extras=caption_lengths,
        split_by_caption_length=True,
        blocks_write_norm_inputs=True,  # Flux's `img += ...` blocks (comfy/ldm/flux/layers.py), as Flux2
        comfy=ComfyModel("Chroma", config_class="Chroma"),  # not ChromaRadiance, its pixel-space subclass
        clip_type="CHROMA",
        modelspec=("Chroma/lora", "https://huggingface.co/lodestones/Chroma"),
        diffusers_rules=DIFFUSERS_RULES,
        # ComfyUI's Chroma template: 26 steps, CFG 3.5, euler on the beta schedule.
        sampling=Sampling(steps=26, cfg=3.5, sampler="euler", scheduler="beta"),
        description="Chroma (8.9B Flux-shaped MMDiT, T5-XXL text encoder); PyTorch backend",
    ),
)
