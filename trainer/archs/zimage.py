"""Z-Image (Turbo and base) as ComfyUI runs it: comfy/ldm/lumina/model.py NextDiT.

x [B,16,H/8,W/8] (patch 2 inside the model), timesteps = sigma, context
[B,T,2560], num_tokens = T; the model embeds 1 - t and returns -output, so
ComfyUI's flow velocity convention (denoised = x - sigma*v) holds unchanged.
Turbo is distilled: its training adapter is merged at +1 for training, removed
for validation samples, never saved.
"""

from __future__ import annotations

from . import nextdit
from .base import Arch, ComfyModel, DiffusersRule, Sampling, caption_lengths
from .layout import BlockGroup, HeaderSpec, Layout, ModelDims, ceil_to

DEFAULT_TARGETS = (
    "attention.qkv",
    "attention.out",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)

# ComfyUI path → diffusers ZImageTransformer2DModel names (comfy/utils.py z_image map).
DIFFUSERS_RULES = tuple(
    rule
    for group in ("layers", "noise_refiner", "context_refiner")
    for rule in (
        DiffusersRule(
            group + r"\.(\d+)\.attention\.qkv",
            (group + ".{0}.attention.to_q", group + ".{0}.attention.to_k", group + ".{0}.attention.to_v"),
        ),
        DiffusersRule(group + r"\.(\d+)\.attention\.out", (group + ".{0}.attention.to_out.0",)),
        DiffusersRule(group + r"\.(\d+)\.feed_forward\.(w[123])", (group + ".{0}.feed_forward.{1}",)),
    )
)

# ---------------------------------------------------------------- memory-estimate layout

CAPTION_TOKENS = 512  # an upper bound: ComfyUI runs each caption at its own length


def model_dims(
    variant: str, hidden: int, layers: int, refiners: int, context_dim: int, context_tokens: int = CAPTION_TOKENS
) -> ModelDims:
    """model_detection.py's `dim == 3840` branch (heads = dim/128, ffn multiplier 8/3, z_image_modulation)
    and lumina/model.py NextDiT's refiners; FeedForward: int(8/3 * dim) rounded up to a multiple of 256."""
    return ModelDims(
        variant,
        "zimage",
        hidden,
        hidden // 128,
        0,
        layers,
        ceil_to(int(8.0 / 3.0 * hidden), 256),
        context_dim,
        context_tokens,
        refiner_blocks=refiners,
    )


# z_image_modulation: adaLN from the 256-wide t embedding, no SiLU before it.
NEXTDIT = nextdit.NextDiTShape(modulation="adaLN_modulation.0", t_width=256, t_hidden=1024)


def linear_layers(dims: ModelDims, io: int) -> dict[str, tuple[int, int]]:
    return nextdit.linear_layers(dims, io, NEXTDIT)


def extra_params(dims: ModelDims, layers: dict[str, tuple[int, int]]) -> int:
    """Biases on every Linear outside the blocks' attention and feed-forward, 4 RMSNorms + q/k norms per
    block, the cap_embedder.0 RMSNorm and the x/cap pad tokens."""
    biases = sum(o for name, (i, o) in layers.items() if ".attention." not in name and ".feed_forward." not in name)
    head_dim, blocks = dims.hidden // dims.heads, 2 * dims.refiner_blocks + dims.single_blocks
    return biases + blocks * (4 * dims.hidden + 2 * head_dim) + dims.context_dim + 2 * dims.hidden


def blocks(dims: ModelDims, image_tokens: int, text_tokens: int) -> list[BlockGroup]:
    """Measured (trainer/estimate/torch_step.py), per token; layers, noise_refiner (image tokens) and context_refiner
    (text tokens) alike:
      bf16  norm1 in D, qkv in D, qkv out 3D, SDPA 4D, out in D, norm2 in D,
            ffn_norm1 in D, w1 and w3 in 2D (a copy per branch), w1/w3/silu
            out 3M, w2 in M, ffn_norm2 in D                 = 15D + 4M
    (w1 and w3 now share their input: D per token less than counted, ~4 % of a block.)
    """
    return nextdit.block_groups(dims, 15 * dims.hidden + 4 * dims.mlp_hidden, image_tokens, text_tokens)


LAYOUT = Layout(
    name="Z-Image",
    variants=(model_dims("zimage", 3840, 30, 2, 2560),),  # Turbo and base share these dims
    linear_layers=linear_layers,
    extra_params=extra_params,
    blocks=blocks,
    widest_output=lambda dims: 3 * dims.hidden,  # attention.qkv
    header=HeaderSpec(
        # adaLN_modulation.0 (no SiLU before it): Lumina 2's NextDiT files hold the same keys but .1 (lumina2.py)
        markers=(
            "cap_embedder.1.weight",
            "noise_refiner.0.attention.qkv.weight",
            "noise_refiner.0.adaLN_modulation.0.weight",
        ),
        sizes={"hidden": ("cap_embedder.1.weight", 0)},
        counts={"single_blocks": "layers."},
    ),
    token_multiple=32,  # pad_tokens_multiple
    text_note=" (512 caption tokens is an upper bound)",
)

_COMMON = dict(
    family="zimage",
    latent_channels=16,
    latent_downscale=8,
    patch=2,
    bucket_divisor=16,
    default_targets=DEFAULT_TARGETS,
    block_lists=("noise_refiner", "context_refiner", "layers"),
    shift_mode="static",
    shift=3.0,
    diffusers_rules=DIFFUSERS_RULES,
    pure_blocks=True,
    # Per-row caption lengths: ComfyUI runs each prompt alone (NextDiT ignores masks and attends to
    # its zero padding), so a forward splits rows of different lengths into separate calls.
    model_extras=caption_lengths,
    split_by_caption_length=True,
    # A Lumina2 model with the ZImage config (not ZImagePixelSpace); the Lumina2 text encoder slot.
    comfy=ComfyModel("Lumina2", config_class="ZImage"),
    clip_type="LUMINA2",
    mlx_model="zimage",
    layout=LAYOUT,
    # Qwen3 4B at 512 tokens (diffusers' ZImagePipeline), 8 of them ComfyUI's chat template.
    caption_token_limit=CAPTION_TOKENS - 8,
)
_IMPLEMENTATION = "https://github.com/Tongyi-MAI/Z-Image"

# Turbo and base are one ComfyUI model: Turbo is what a model with a training adapter trains as.
TURBO = Arch(
    name="zimage_turbo",
    training_adapter="merge",
    modelspec=("Z-Image-Turbo/lora", _IMPLEMENTATION),
    # Turbo is distilled for 8 steps without CFG (ComfyUI's template, the example workflow).
    sampling=Sampling(steps=8, cfg=1.0, sampler="res_multistep", scheduler="simple"),
    description="Z-Image Turbo (distilled): training adapter merged for training",
    **_COMMON,
)
ARCHS = (
    TURBO,
    Arch(
        name="zimage",
        modelspec=("Z-Image/lora", _IMPLEMENTATION),
        module_marker=r"^(layers|noise_refiner|context_refiner)\.\d+\.(attention|feed_forward)",
        # The undistilled base needs CFG and more steps.
        sampling=Sampling(steps=30, cfg=4.0, sampler="res_multistep", scheduler="simple"),
        description="Z-Image base",
        **_COMMON,
    ),
)
