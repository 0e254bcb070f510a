"""Flux2 (Klein 4B/9B, Dev) as ComfyUI runs it: comfy/ldm/flux/model.py.

x [B,128,H/16,W/16] (one token per latent pixel), timestep = sigma in [0,1],
context [B,512,ctx] (ComfyUI's model_base.Flux2 left-pads text to 512 tokens),
guidance [B] only for Dev (its guidance_in embedding); trained at 1.0.
"""

from __future__ import annotations

import math

import numpy as np

from .base import Arch, ComfyModel, DiffusersRule, Sampling
from .layout import BlockGroup, HeaderSpec, Layout, ModelDims

CONTEXT_TOKENS = 512  # model_base.Flux2.extra_conds left-pads one prompt to this (a batch trains what sampling sees)
TRAIN_GUIDANCE = 1.0  # Dev's distilled guidance embedding during training (ai-toolkit)
IMPLEMENTATION = "https://github.com/black-forest-labs/flux2"


def dev_extras(batch_size: int, lengths: list[int]) -> dict:
    return {"guidance": np.full((batch_size,), TRAIN_GUIDANCE, dtype=np.float32)}


def klein_extras(batch_size: int, lengths: list[int]) -> dict:
    return {}


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

# A double block's attention in diffusers, Flux.1's names, which Flux2 and Chroma (chroma.py) keep.
DOUBLE_ATTENTION_RULES = (
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
)

# ComfyUI path → diffusers Flux2Transformer2DModel names (comfy/utils.py flux2 map).
DIFFUSERS_RULES = (
    *DOUBLE_ATTENTION_RULES,
    DiffusersRule(r"double_blocks\.(\d+)\.img_mlp\.0", ("transformer_blocks.{0}.ff.linear_in",)),
    DiffusersRule(r"double_blocks\.(\d+)\.img_mlp\.2", ("transformer_blocks.{0}.ff.linear_out",)),
    DiffusersRule(r"double_blocks\.(\d+)\.txt_mlp\.0", ("transformer_blocks.{0}.ff_context.linear_in",)),
    DiffusersRule(r"double_blocks\.(\d+)\.txt_mlp\.2", ("transformer_blocks.{0}.ff_context.linear_out",)),
    DiffusersRule(r"single_blocks\.(\d+)\.linear1", ("single_transformer_blocks.{0}.attn.to_qkv_mlp_proj",)),
    DiffusersRule(r"single_blocks\.(\d+)\.linear2", ("single_transformer_blocks.{0}.attn.to_out",)),
)

MODULE_MARKER = r"^(double_blocks|single_blocks)\.\d+\."  # ComfyUI module paths of a Flux2 LoRA

# ---------------------------------------------------------------- memory-estimate layout


def model_dims(
    variant: str,
    arch: str,
    hidden: int,
    double_blocks: int,
    single_blocks: int,
    context_dim: int,
    context_tokens: int = CONTEXT_TOKENS,
    guidance_embed: bool = False,
) -> ModelDims:
    """model_detection.py's flux2 branch: heads = hidden/128, mlp_ratio 3.0 (gated SiLU MLP), global
    modulation, no biases; hidden from img_in, blocks counted."""
    return ModelDims(
        variant,
        arch,
        hidden,
        hidden // 128,
        double_blocks,
        single_blocks,
        3 * hidden,
        context_dim,
        context_tokens,
        guidance_embed=guidance_embed,
    )


def linear_layers(dims: ModelDims, io: int) -> dict[str, tuple[int, int]]:
    D, M = dims.hidden, dims.mlp_hidden
    layers = {"img_in": (io, D), "time_in.in_layer": (256, D), "time_in.out_layer": (D, D)}
    if dims.guidance_embed:
        layers.update({"guidance_in.in_layer": (256, D), "guidance_in.out_layer": (D, D)})
    layers["txt_in"] = (dims.context_dim, D)
    for i in range(dims.double_blocks):
        for stream in ("img", "txt"):
            p = f"double_blocks.{i}.{stream}"
            layers.update(
                {f"{p}_attn.qkv": (D, 3 * D), f"{p}_attn.proj": (D, D), f"{p}_mlp.0": (D, 2 * M), f"{p}_mlp.2": (M, D)}
            )  # mlp.0: gate | up
    for i in range(dims.single_blocks):
        layers.update(
            {
                f"single_blocks.{i}.linear1": (D, 3 * D + 2 * M),  # qkv | gate | up
                f"single_blocks.{i}.linear2": (D + M, D),
            }
        )  # attn | mlp -> D
    layers.update(
        {
            "final_layer.linear": (D, io),
            "final_layer.adaLN_modulation.1": (D, 2 * D),
            "double_stream_modulation_img.lin": (D, 6 * D),
            "double_stream_modulation_txt.lin": (D, 6 * D),
            "single_stream_modulation.lin": (D, 3 * D),
        }
    )
    return layers


def extra_params(dims: ModelDims, layers: dict[str, tuple[int, int]]) -> int:
    """No biases; QK RMSNorm scales: 2 per attention."""
    return dims.hidden // dims.heads * 2 * (2 * dims.double_blocks + dims.single_blocks)


def blocks(dims: ModelDims, image_tokens: int, text_tokens: int) -> list[BlockGroup]:
    """Measured (trainer/estimate/torch_step.py), per token of either stream; both kinds see the joint sequence.
    Double block:
      bf16  qkv in D, qkv out 3D, SDPA q/k/v/out 4D, proj in D, mlp.0 in D,
            mlp.0 out 2M (gate|up), silu M, mlp.2 in M      = 10D + 4M
      fp32  norm1 and norm2 inputs                          =  2D
    Single block:
      bf16  linear1 in D, out 3D + 2M (SDPA's v is a view of it), SDPA q/k/out 3D,
            silu M, linear2 in D + M                        =  8D + 4M
      fp32  pre_norm input                                  =  1D
    """
    D, M, joint = dims.hidden, dims.mlp_hidden, image_tokens + text_tokens
    return [
        BlockGroup(10 * D + 4 * M, 2 * D, dims.double_blocks, joint),
        BlockGroup(8 * D + 4 * M, D, dims.single_blocks, joint),
    ]


LAYOUT = Layout(
    name="Flux2",
    variants=(
        model_dims("flux2-klein-4b", "flux2_klein", 3072, 5, 20, 7680),
        model_dims("flux2-klein-9b", "flux2_klein", 4096, 8, 24, 12288),
        model_dims("flux2-dev", "flux2_dev", 6144, 8, 48, 15360, guidance_embed=True),
    ),
    linear_layers=linear_layers,
    extra_params=extra_params,
    blocks=blocks,
    widest_output=lambda dims: 3 * dims.hidden + 2 * dims.mlp_hidden,  # single_blocks' fused linear1
    header=HeaderSpec(
        markers=("double_stream_modulation_img.lin.weight", "img_in.weight"),
        sizes={"hidden": ("img_in.weight", 0)},
        counts={"double_blocks": "double_blocks.", "single_blocks": "single_blocks."},
    ),
    text_note=" (context padded to 512)",
)

_COMMON = dict(
    family="flux2",
    latent_channels=128,
    latent_downscale=16,
    patch=1,
    bucket_divisor=16,
    default_targets=DEFAULT_TARGETS,
    block_lists=("double_blocks", "single_blocks"),
    # ComfyUI samples Flux2 with mu 2.02 (ModelSamplingFlux): as a static shift that is e^2.02 ≈ 7.54.
    shift_mode="resolution",
    shift=math.exp(2.02),
    # Left-padded to 512: a longer caption pads the batch further, and such rows run alone (as ComfyUI's).
    context_side="left",
    context_tokens=CONTEXT_TOKENS,
    split_by_caption_length=True,
    clip_type="FLUX2",
    mlx_model="flux2",
    diffusers_rules=DIFFUSERS_RULES,
    layout=LAYOUT,
    blocks_write_norm_inputs=True,
    fp8_quantize_kernel=("linear2",),
    # Edit training: control latents go where ReferenceLatent puts them (Flux.extra_conds → ref_latents; the
    # model then appends their tokens at RoPE index 10, 20, ... by its default_ref_method "index",
    # comfy/ldm/flux/model.py, and returns the target's tokens only). ComfyUI 0.17 and 0.33 both do.
    reference_latents="reference_latents",
)

# Klein and Dev are one ComfyUI class; Dev has the guidance embedding (comfy/model_detection.py).
KLEIN = Arch(
    name="flux2_klein",
    model_extras=klein_extras,
    module_marker=MODULE_MARKER,
    comfy=ComfyModel("Flux2", attributes=(("diffusion_model.params.guidance_embed", False),)),
    modelspec=("Flux.2-klein/lora", IMPLEMENTATION),
    # 20 euler steps at cfg 1 suit the distilled 4B/9B files (made for 4) and give the base a usable
    # preview; the base samples best at cfg ~4 with a negative (sample_cfg, sample_negative).
    sampling=Sampling(steps=20, cfg=1.0, sampler="euler", scheduler="simple"),
    # Qwen3 at 512 tokens (diffusers' Flux2KleinPipeline), 12 of them ComfyUI's chat template.
    caption_token_limit=CONTEXT_TOKENS - 12,
    description="Flux2 Klein 4B/9B (base, undistilled); no guidance input",
    **_COMMON,
)
ARCHS = (
    KLEIN,
    Arch(
        name="flux2_dev",
        model_extras=dev_extras,
        comfy=ComfyModel("Flux2", attributes=(("diffusion_model.params.guidance_embed", True),)),
        modelspec=("Flux.2-dev/lora", IMPLEMENTATION),
        # ComfyUI's Flux2 Dev template: 20 euler steps, cfg 1 (the guidance embedding takes ComfyUI's default).
        sampling=Sampling(steps=20, cfg=1.0, sampler="euler", scheduler="simple"),
        # Mistral Small 3 at 512 tokens (diffusers' Flux2Pipeline), ~42 of them the system prompt.
        caption_token_limit=CONTEXT_TOKENS - 42,
        description="Flux2 Dev; guidance embedding fed 1.0 in training",
        **_COMMON,
    ),
)
