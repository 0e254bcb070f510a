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
from .flux2 import DOUBLE_ATTENTION_RULES
from .layout import BlockGroup, HeaderSpec, Layout, ModelDims

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
    *DOUBLE_ATTENTION_RULES,
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

# ---------------------------------------------------------------- memory-estimate layout

CAPTION_TOKENS = 512  # an upper bound: ComfyUI runs each caption at its own length, unpadded
APPROXIMATOR_IN, APPROXIMATOR_HIDDEN, APPROXIMATOR_LAYERS = 64, 5120, 5  # model_detection.py's Chroma constants


def model_dims(variant: str, hidden: int, double_blocks: int, single_blocks: int, context_dim: int) -> ModelDims:
    """model_detection.py's Chroma branch: Flux's heads of 128, mlp_ratio 4 (GELU MLP), hidden from img_in."""
    return ModelDims(
        variant, "chroma", hidden, hidden // 128, double_blocks, single_blocks, 4 * hidden, context_dim, CAPTION_TOKENS
    )


def linear_layers(dims: ModelDims, io: int) -> dict[str, tuple[int, int]]:
    D, M, A = dims.hidden, dims.mlp_hidden, APPROXIMATOR_HIDDEN
    layers = {
        "img_in": (io, D),
        "txt_in": (dims.context_dim, D),
        "distilled_guidance_layer.in_proj": (APPROXIMATOR_IN, A),
    }
    for i in range(APPROXIMATOR_LAYERS):
        layers.update(
            {
                f"distilled_guidance_layer.layers.{i}.in_layer": (A, A),
                f"distilled_guidance_layer.layers.{i}.out_layer": (A, A),
            }
        )
    layers["distilled_guidance_layer.out_proj"] = (A, D)
    for i in range(dims.double_blocks):
        for stream in ("img", "txt"):
            p = f"double_blocks.{i}.{stream}"
            layers.update(
                {f"{p}_attn.qkv": (D, 3 * D), f"{p}_attn.proj": (D, D), f"{p}_mlp.0": (D, M), f"{p}_mlp.2": (M, D)}
            )
    for i in range(dims.single_blocks):
        layers.update({f"single_blocks.{i}.linear1": (D, 3 * D + M), f"single_blocks.{i}.linear2": (D + M, D)})
    layers["final_layer.linear"] = (D, io)
    return layers


def extra_params(dims: ModelDims, layers: dict[str, tuple[int, int]]) -> int:
    """A bias on every Linear, the approximator's RMSNorms, QK RMSNorm scales: 2 per attention."""
    biases = sum(o for i, o in layers.values())
    norms = APPROXIMATOR_LAYERS * APPROXIMATOR_HIDDEN + dims.hidden // dims.heads * 2 * (
        2 * dims.double_blocks + dims.single_blocks
    )
    return biases + norms


def blocks(dims: ModelDims, image_tokens: int, text_tokens: int) -> list[BlockGroup]:
    """Derived from Flux2's measured blocks (flux2.py) for Flux.1's GELU MLP, not yet measured on a GPU; per token of
    either stream, both kinds see the joint sequence:
      double  bf16 qkv in D, qkv out 3D, SDPA 4D, proj in D, mlp.0 in D, GELU in M, mlp.2 in M = 10D + 2M; fp32 2D
      single  bf16 linear1 in D, out 3D + M, SDPA q/k/out 3D, linear2 in D + M             =  8D + 2M; fp32 1D
    The approximator's modulation is per sample: nothing per token."""
    D, M, joint = dims.hidden, dims.mlp_hidden, image_tokens + text_tokens
    return [
        BlockGroup(10 * D + 2 * M, 2 * D, dims.double_blocks, joint),
        BlockGroup(8 * D + 2 * M, D, dims.single_blocks, joint),
    ]


LAYOUT = Layout(
    name="Chroma",
    variants=(model_dims("chroma", 3072, 19, 38, 4096),),
    linear_layers=linear_layers,
    extra_params=extra_params,
    blocks=blocks,
    widest_output=lambda dims: 3 * dims.hidden + dims.mlp_hidden,  # single_blocks.linear1
    header=HeaderSpec(
        markers=("distilled_guidance_layer.in_proj.weight", "img_in.weight"),
        sizes={"hidden": ("img_in.weight", 0), "context_dim": ("txt_in.weight", 1)},
        counts={"double_blocks": "double_blocks.", "single_blocks": "single_blocks."},
    ),
    text_note=" (512 caption tokens is an upper bound)",
    measured=False,
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
        layout=LAYOUT,
        description="Chroma (8.9B Flux-shaped MMDiT, T5-XXL text encoder); PyTorch backend",
    ),
)
