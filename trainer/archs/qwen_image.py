"""Qwen-Image as ComfyUI runs it: comfy/ldm/qwen_image/model.py QwenImageTransformer2DModel.

A 20B MMDiT: 60 two-stream `transformer_blocks` (joint attention over caption + image tokens),
conditioned on Qwen2.5-VL 7B's last hidden state (context [B,T,3584], the chat template's tokens
cut off, no padding for one prompt: ComfyUI drops an all-ones attention mask). x is the Wan 2.1
latent [B,16,1,H/8,W/8] (a video VAE's single frame; Kiln caches [16,H/8,W/8] and the bridge adds
the frame axis the latent format declares), patch 2 inside the model; timestep = sigma; CONST flow
output (model_base.QwenImage, ModelType.FLUX). ComfyUI's module names are diffusers' own, so the
diffusers export renames nothing.

Qwen-Image-Edit (2509, 2511) is this arch too: ComfyUI loads it as the same QwenImage class from the same
keys (2509's state dict is plain Qwen-Image's), so nothing on the MODEL tells edit from plain, and nothing
needs to: edit training is a dataset fact (control/ folders), fed as reference latents, and how the model
places them is the model's own (2511's `__index_timestep_zero__` key → default_ref_method
"index_timestep_zero", which ComfyUI's forward reads; Kiln calls that forward).
"""

from __future__ import annotations

import math
import re

from .base import Arch, ComfyModel, DiffusersRule, Sampling, caption_lengths
from .layout import BlockGroup, HeaderSpec, Layout, ModelDims

# The block Linears (diffusers and ComfyUI names alike). Targets leave out the modulation (img_mod,
# txt_mod: 6·D outputs each, a third of a block's weights) as the Flux2 defaults do.
ATTENTION = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)
MLP = ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")
MODULATION = ("img_mod.1", "txt_mod.1")
DEFAULT_TARGETS = ATTENTION + MLP

# Same names on both sides: one identity rule per block Linear and per top-level Linear.
_TOP_LEVEL = (
    "img_in",
    "txt_in",
    "proj_out",
    "norm_out.linear",
    "time_text_embed.timestep_embedder.linear_1",
    "time_text_embed.timestep_embedder.linear_2",
)
DIFFUSERS_RULES = tuple(
    DiffusersRule(r"transformer_blocks\.(\d+)\." + re.escape(name), ("transformer_blocks.{0}." + name,))
    for name in ATTENTION + MLP + MODULATION
) + tuple(DiffusersRule(re.escape(name), (name,)) for name in _TOP_LEVEL)

# ---------------------------------------------------------------- memory-estimate layout

CAPTION_TOKENS = 512  # an upper bound: ComfyUI runs each caption at its own length, uncapped


def model_dims(
    variant: str, hidden: int, blocks: int, context_dim: int, context_tokens: int = CAPTION_TOKENS
) -> ModelDims:
    """model_detection.py's qwen_image branch (in_channels from img_in, transformer_blocks counted) with the
    class defaults: 24 heads of 128, joint_attention_dim 3584 (Qwen2.5-VL 7B), FeedForward mult 4."""
    return ModelDims(variant, "qwen_image", hidden, hidden // 128, blocks, 0, 4 * hidden, context_dim, context_tokens)


def linear_layers(dims: ModelDims, io: int) -> dict[str, tuple[int, int]]:
    D, M = dims.hidden, dims.mlp_hidden
    layers = {
        "time_text_embed.timestep_embedder.linear_1": (256, D),
        "time_text_embed.timestep_embedder.linear_2": (D, D),
        "img_in": (io, D),
        "txt_in": (dims.context_dim, D),
    }
    for i in range(dims.double_blocks):
        p = f"transformer_blocks.{i}"
        for stream in ("img", "txt"):  # modulation: Linear(dim, 6 dim) after a SiLU, from the timestep vector
            layers.update(
                {
                    f"{p}.{stream}_mod.1": (D, 6 * D),
                    f"{p}.{stream}_mlp.net.0.proj": (D, M),
                    f"{p}.{stream}_mlp.net.2": (M, D),
                }
            )
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
            layers[f"{p}.attn.{name}"] = (D, D)
    layers.update({"norm_out.linear": (D, 2 * D), "proj_out": (D, io)})
    return layers


def extra_params(dims: ModelDims, layers: dict[str, tuple[int, int]]) -> int:
    """Biases on every Linear, the txt_norm RMSNorm, the 4 q/k RMSNorms of each block's attention; its
    LayerNorms have no affine."""
    biases = sum(o for i, o in layers.values())
    return biases + dims.context_dim + dims.double_blocks * 4 * (dims.hidden // dims.heads)


def blocks(dims: ModelDims, image_tokens: int, text_tokens: int) -> list[BlockGroup]:
    """Derived by trainer/estimate/torch_step.py's rules from ComfyUI's QwenImageTransformerBlock, not yet measured on a
    GPU. A two-stream block with joint attention like Flux2's double block; per token of either stream:
      bf16  to_q/k/v in D (one input), q and k norm inputs 2D (contiguous copies: unlike Flux2's fused
            qkv, v's output is not kept), SDPA q/k/v/out 4D, to_out in D, mlp.net.0 in D, GELU in M,
            mlp.net.2 in M (no gate)                        =  9D + 2M
      fp32  norm1 and norm2 inputs                          =  2D
    img_mod/txt_mod act on the one timestep vector of a sample: nothing per token. Targeted by a LoRA,
    their shift/scale/gate take gradients, and each stream keeps ~2D fp32 + 2D bf16 more (not counted).
    """
    D, M = dims.hidden, dims.mlp_hidden
    return [BlockGroup(9 * D + 2 * M, 2 * D, dims.double_blocks, image_tokens + text_tokens)]


LAYOUT = Layout(
    name="Qwen-Image",
    variants=(model_dims("qwen-image", 3072, 60, 3584),),
    linear_layers=linear_layers,
    extra_params=extra_params,
    blocks=blocks,
    widest_output=lambda dims: dims.mlp_hidden,  # img_mlp.net.0.proj
    # model_detection.py keys on txt_norm, which Mage-Flow shares (told apart by its 2560-wide text): here
    # Linears only, and the text width from txt_in
    header=HeaderSpec(
        markers=("transformer_blocks.0.img_mod.1.weight", "txt_in.weight"),
        sizes={"hidden": ("img_in.weight", 0), "context_dim": ("txt_in.weight", 1)},
        counts={"double_blocks": "transformer_blocks."},
    ),
    text_note=" (512 caption tokens is an upper bound; ComfyUI does not cap them)",
    measured=False,
)


ARCHS = (
    Arch(
        name="qwen_image",
        family="qwen_image",
        latent_channels=16,
        latent_downscale=8,
        patch=2,
        bucket_divisor=16,
        default_targets=DEFAULT_TARGETS,
        block_lists=("transformer_blocks",),
        # ComfyUI samples Qwen-Image with ModelSamplingFlux at shift 1.15 (supported_models.QwenImage), a
        # static e^1.15 ≈ 3.16: training draws the timesteps the sampler visits.
        shift_mode="static",
        shift=math.exp(1.15),
        # Captions vary in length and ComfyUI runs each prompt alone, unpadded: rows of one length share a call.
        model_extras=caption_lengths,
        split_by_caption_length=True,
        comfy=ComfyModel("QwenImage", config_class="QwenImage"),  # not MageFlow, a QwenImage subclass
        clip_type="QWEN_IMAGE",
        module_marker=r"^transformer_blocks\.\d+\.(img|txt)_mlp\.net\.",
        modelspec=("Qwen-Image/lora", "https://github.com/QwenLM/Qwen-Image"),
        diffusers_rules=DIFFUSERS_RULES,
        layout=LAYOUT,
        caption_token_limit=1024,  # diffusers' QwenImagePipeline: 1024 tokens after its template's are dropped
        sampling=Sampling(steps=20, cfg=2.5, sampler="euler", scheduler="simple"),  # ComfyUI's Qwen-Image template
        # Edit training (Qwen-Image-Edit 2509/2511): control latents go where TextEncodeQwenImageEdit(Plus) and
        # ReferenceLatent put them (QwenImage.extra_conds → ref_latents, through the Wan 2.1 latent format; the
        # model appends their tokens at RoPE index 1, 2, ... and returns the target's). Both trees do.
        reference_latents="reference_latents",
        description="Qwen-Image (20B MMDiT, Qwen2.5-VL text encoder); PyTorch backend",
    ),
)
