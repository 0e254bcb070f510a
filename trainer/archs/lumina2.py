"""Lumina Image 2.0 as ComfyUI runs it: comfy/ldm/lumina/model.py NextDiT (model_base.Lumina2).

The class Z-Image shares (zimage.py), at Lumina 2's size: dim 2304, 26 layers, 24 heads of 96 with 8 k/v
heads, adaLN modulation with a SiLU, conditioned on Gemma 2 2B's second-to-last hidden state (context
[B,T,2304], unpadded: ComfyUI runs each prompt at its own length and NextDiT masks no padding). x is the Flux
latent [B,16,H/8,W/8], patch 2 inside the model; the model embeds 1 - t and returns -output, so ComfyUI's
CONST flow convention holds. Told apart from Z-Image by its config class: supported_models.Lumina2 exactly
(ZImage is a Lumina2 subclass, which this arch never matches, nor Z-Image's this one).
"""

from __future__ import annotations

from . import nextdit
from .base import Arch, ComfyModel, DiffusersRule, Sampling, caption_lengths
from .layout import BlockGroup, HeaderSpec, Layout, ModelDims, ceil_to

# The block Linears (attention and the SwiGLU feed-forward) of every NextDiT block, refiners included, as
# ai-toolkit's and SimpleTuner's Lumina 2 LoRAs train them; adaLN modulation left out.
DEFAULT_TARGETS = (
    "attention.qkv",
    "attention.out",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)

HEAD_DIM, HEADS, KV_HEADS = 96, 24, 8  # qkv's rows: q 24 heads, k and v 8 heads each, of 96

# ComfyUI path → diffusers Lumina2Transformer2DModel names (its LuminaFeedForward: linear_1 = w1, linear_2 = w2,
# linear_3 = w3; grouped k/v heads make qkv's split unequal).
DIFFUSERS_RULES = tuple(
    rule
    for group in ("layers", "noise_refiner", "context_refiner")
    for rule in (
        DiffusersRule(
            group + r"\.(\d+)\.attention\.qkv",
            (group + ".{0}.attn.to_q", group + ".{0}.attn.to_k", group + ".{0}.attn.to_v"),
            split_sizes=(HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM),
        ),
        DiffusersRule(group + r"\.(\d+)\.attention\.out", (group + ".{0}.attn.to_out.0",)),
        DiffusersRule(group + r"\.(\d+)\.feed_forward\.w1", (group + ".{0}.feed_forward.linear_1",)),
        DiffusersRule(group + r"\.(\d+)\.feed_forward\.w2", (group + ".{0}.feed_forward.linear_2",)),
        DiffusersRule(group + r"\.(\d+)\.feed_forward\.w3", (group + ".{0}.feed_forward.linear_3",)),
    )
)

# ---------------------------------------------------------------- memory-estimate layout

CAPTION_TOKENS = 512  # an upper bound: ComfyUI runs each caption at its own length


def model_dims(variant: str, hidden: int, layers: int, context_dim: int) -> ModelDims:
    """model_detection.py's `dim == 2304` branch: heads of 96, ffn multiplier 4 rounded up to a multiple of 256,
    two refiners of each kind (NextDiT's default)."""
    return ModelDims(
        variant,
        "lumina2",
        hidden,
        hidden // HEAD_DIM,
        0,
        layers,
        ceil_to(4 * hidden, 256),
        context_dim,
        CAPTION_TOKENS,
        refiner_blocks=2,
    )


def linear_layers(dims: ModelDims, io: int) -> dict[str, tuple[int, int]]:
    T = min(dims.hidden, 1024)  # the t embedding's width; each adaLN Linear reads it after a SiLU
    shape = nextdit.NextDiTShape(kv_width=KV_HEADS * HEAD_DIM, modulation="adaLN_modulation.1", t_width=T, t_hidden=T)
    return nextdit.linear_layers(dims, io, shape)


def extra_params(dims: ModelDims, layers: dict[str, tuple[int, int]]) -> int:
    """Biases on every Linear outside the blocks' attention and feed-forward, 4 RMSNorms + q/k norms per block,
    the cap_embedder.0 RMSNorm (no pad tokens, unlike Z-Image)."""
    biases = sum(o for name, (i, o) in layers.items() if ".attention." not in name and ".feed_forward." not in name)
    blocks = 2 * dims.refiner_blocks + dims.single_blocks
    return biases + blocks * (4 * dims.hidden + 2 * HEAD_DIM) + dims.context_dim


def blocks(dims: ModelDims, image_tokens: int, text_tokens: int) -> list[BlockGroup]:
    """Derived from Z-Image's measured NextDiT block (zimage.py) with grouped k/v heads, not yet measured on a GPU:
    per token, qkv's output is D + 2kv instead of 3D:    13D + 2kv + 4M."""
    per_token = 13 * dims.hidden + 2 * KV_HEADS * HEAD_DIM + 4 * dims.mlp_hidden
    return nextdit.block_groups(dims, per_token, image_tokens, text_tokens)


LAYOUT = Layout(
    name="Lumina 2",
    variants=(model_dims("lumina2", 2304, 26, 2304),),
    linear_layers=linear_layers,
    extra_params=extra_params,
    blocks=blocks,
    widest_output=lambda dims: dims.mlp_hidden,  # feed_forward.w1 / w3
    # Z-Image's keys too, but its adaLN Linear is adaLN_modulation.0 (no SiLU before it): .1 is Lumina 2's alone.
    header=HeaderSpec(
        markers=("cap_embedder.1.weight", "noise_refiner.0.adaLN_modulation.1.weight"),
        sizes={"hidden": ("cap_embedder.1.weight", 0), "context_dim": ("cap_embedder.1.weight", 1)},
        counts={"single_blocks": "layers."},
    ),
    text_note=" (512 caption tokens is an upper bound)",
    measured=False,
)

ARCHS = (
    Arch(
        name="lumina2",
        family="lumina2",
        latent_channels=16,
        latent_downscale=8,
        patch=2,
        bucket_divisor=16,
        default_targets=DEFAULT_TARGETS,
        block_lists=("noise_refiner", "context_refiner", "layers"),
        # supported_models.Lumina2 samples with ModelSamplingDiscreteFlow at shift 6: a static shift.
        shift_mode="static",
        shift=6.0,
        pure_blocks=True,  # NextDiT's blocks, as Z-Image's
        model_extras=caption_lengths,
        split_by_caption_length=True,
        comfy=ComfyModel("Lumina2", config_class="Lumina2"),
        clip_type="LUMINA2",
        # No module_marker: a Lumina 2 LoRA has Z-Image's module names (guess_arch keeps them Z-Image's); Kiln's
        # files name their arch in the metadata.
        modelspec=("Lumina-Image-2.0/lora", "https://github.com/Alpha-VLLM/Lumina-Image-2.0"),
        diffusers_rules=DIFFUSERS_RULES,
        # ComfyUI's Lumina 2 (NetaYume) template: 30 steps, CFG 4, res_multistep on the simple schedule.
        sampling=Sampling(steps=30, cfg=4.0, sampler="res_multistep", scheduler="simple"),
        layout=LAYOUT,
        description="Lumina Image 2.0 (2.6B NextDiT, Gemma 2 2B text encoder); PyTorch backend",
    ),
)
