"""Wan video models as ComfyUI runs them: comfy/ldm/wan/model.py WanModel (model_base.WAN21, WAN22).

One block kind: self-attention over the video's tokens, cross-attention to umT5-XXL's caption (context
[B,512,4096]: ComfyUI's tokenizer pads every prompt to 512 tokens with zeroed padding, no mask), an MLP
`ffn`, all modulated by the timestep (`modulation`, `time_projection`). x is a video latent
[B,C,t,h,w] (t = (frames-1)/4 + 1 latent frames; an image is one frame), patch (1,2,2) inside the model
(Kiln's `patch` is the spatial 2); timestep = sigma·1000 inside ComfyUI's CONST flow sampling
(model_base.WAN21, ModelType.FLOW). Wan 2.1 latents have 16 channels at /8 (latent_formats.Wan21);
Wan 2.2 TI2V 5B's have 48 at /16 (latent_formats.Wan22, supported_models.WAN22_T2V).

Wan 2.2 A14B is two Wan 2.1-shaped 14B models, one for high noise and one for low: ComfyUI loads each as
WAN21_T2V (image-to-video too: it has no CLIP-vision layers), so nothing in the file tells an expert apart from
Wan 2.1 14B, or the high expert from the low; the arch says which,
and with it the σ range the expert trains on (the Wan 2.2 boundary ai-toolkit and musubi-tuner use:
0.875 for text-to-video, 0.9 for image-to-video).
"""

from __future__ import annotations

import dataclasses
import re

from .base import Arch, ComfyModel, DiffusersRule, Sampling, caption_lengths
from .layout import BlockGroup, HeaderSpec, Layout, ModelDims

# Every Linear of a block, as musubi-tuner and ai-toolkit target them (their default: every Linear in
# WanAttentionBlock); the I2V cross-attention's image keys/values come with the I2V models.
SELF_ATTENTION = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o")
CROSS_ATTENTION = ("cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o")
IMAGE_ATTENTION = ("cross_attn.k_img", "cross_attn.v_img")
MLP = ("ffn.0", "ffn.2")
DEFAULT_TARGETS = SELF_ATTENTION + CROSS_ATTENTION + MLP

# ComfyUI (original Wan) names → diffusers' WanTransformer3DModel (loaders/lora_conversion_utils.py
# _convert_non_diffusers_wan_lora_to_diffusers, models/transformers/transformer_wan.py).
_BLOCK_NAMES = {
    "self_attn.q": "attn1.to_q",
    "self_attn.k": "attn1.to_k",
    "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0",
    "cross_attn.q": "attn2.to_q",
    "cross_attn.k": "attn2.to_k",
    "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0",
    "cross_attn.k_img": "attn2.add_k_proj",
    "cross_attn.v_img": "attn2.add_v_proj",
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
}
_TOP_LEVEL = {
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
}
DIFFUSERS_RULES = tuple(
    DiffusersRule(r"blocks\.(\d+)\." + re.escape(ours), ("blocks.{0}." + theirs,))
    for ours, theirs in _BLOCK_NAMES.items()
) + tuple(DiffusersRule(re.escape(ours), (theirs,)) for ours, theirs in _TOP_LEVEL.items())

# ---------------------------------------------------------------- memory-estimate layout

CAPTION_TOKENS = 512  # umT5's prompt padded to 512 (comfy/text_encoders/wan.py min_length)
TEXT_DIM = 4096  # umT5-XXL
CLIP_VISION_DIM = 1280  # the I2V models' img_emb takes CLIP ViT-H's penultimate states
CLIP_VISION_TOKENS = 257  # clip_vision_h at 224 px: 16 x 16 patches and the class token


def model_dims(variant: str, arch: str, hidden: int, blocks: int, ffn: int) -> ModelDims:
    """model_detection.py's wan2.1 branch: heads = dim / 128, ffn_dim and blocks read off the file."""
    return ModelDims(variant, arch, hidden, hidden // 128, 0, blocks, ffn, TEXT_DIM, CAPTION_TOKENS)


def linear_layers(dims: ModelDims, io: int, *, image: bool = False) -> dict[str, tuple[int, int]]:
    D, F = dims.hidden, dims.mlp_hidden
    layers = {
        "text_embedding.0": (dims.context_dim, D),
        "text_embedding.2": (D, D),
        "time_embedding.0": (256, D),
        "time_embedding.2": (D, D),
        "time_projection.1": (D, 6 * D),
    }
    names = SELF_ATTENTION + CROSS_ATTENTION + (IMAGE_ATTENTION if image else ())
    for i in range(dims.single_blocks):
        layers.update({f"blocks.{i}.{name}": (D, D) for name in names})
        layers.update({f"blocks.{i}.ffn.0": (D, F), f"blocks.{i}.ffn.2": (F, D)})
    layers["head.head"] = (D, io)
    if image:
        layers.update({"img_emb.proj.1": (CLIP_VISION_DIM, CLIP_VISION_DIM), "img_emb.proj.3": (CLIP_VISION_DIM, D)})
    return layers


def i2v_linear_layers(dims: ModelDims, io: int) -> dict[str, tuple[int, int]]:
    return linear_layers(dims, io, image=True)


def extra_params(dims: ModelDims, layers: dict[str, tuple[int, int]]) -> int:
    """Biases on every Linear; per block the q/k RMSNorms of both attentions (4D, 5D with I2V's image key
    norm), norm3's affine (2D) and the modulation (6D); the head's modulation (2D); the patch embedding
    Conv3d (in_dim·D·4 + D: in_dim = out_dim, 16 more channels and 4 of mask for I2V's start image); I2V's
    img_emb LayerNorms (2·1280 + 2D)."""
    D = dims.hidden
    image = "img_emb.proj.1" in layers
    per_block = (5 if image else 4) * D + 2 * D + 6 * D
    patch_in = layers["head.head"][1] + (20 * 4 if image else 0)  # in_dim x the 2x2 patch
    image_norms = 2 * CLIP_VISION_DIM + 2 * D if image else 0
    return sum(o for i, o in layers.values()) + dims.single_blocks * per_block + 2 * D + patch_in * D + D + image_norms


def blocks(dims: ModelDims, image_tokens: int, text_tokens: int) -> list[BlockGroup]:
    """Derived by trainer/estimate/torch_step.py's rules from ComfyUI's WanAttentionBlock, not yet measured on
    a GPU. Per video token:
      bf16  self_attn q/k/v in D (one input), q and k norm inputs 2D, SDPA q/k/v/out 4D, o in D; cross_attn
            q in D, its norm input D, SDPA q/out 2D, o in D; ffn.0 in D, GELU in F, ffn.2 in F  = 14D + 2F
      fp32  the modulated norm1, norm3, norm2 outputs                                        =  3D
    The caption's 512 tokens are counted as video tokens (an upper bound: a block keeps only their
    cross-attention keys and values), small beside a clip's tokens."""
    D, F = dims.hidden, dims.mlp_hidden
    return [BlockGroup(14 * D + 2 * F, 3 * D, dims.single_blocks, image_tokens + text_tokens)]


def i2v_blocks(dims: ModelDims, image_tokens: int, text_tokens: int) -> list[BlockGroup]:
    """Wan 2.1 I2V's blocks: as blocks, with the start image's 257 CLIP vision tokens beside the caption's
    (cross_attn's k_img/v_img read them), counted as video tokens too: an upper bound, as for the caption."""
    return blocks(dims, image_tokens, text_tokens + CLIP_VISION_TOKENS)


def _layout(name: str, variants: tuple[ModelDims, ...], *, image: bool) -> Layout:
    markers = ("blocks.0.self_attn.q.weight", "time_projection.1.weight", "head.head.weight")
    markers += ("img_emb.proj.1.weight",) if image else ()
    return Layout(
        name=name,
        variants=variants,
        linear_layers=i2v_linear_layers if image else linear_layers,
        extra_params=extra_params,
        blocks=i2v_blocks if image else blocks,
        widest_output=lambda dims: dims.mlp_hidden,  # ffn.0
        header=HeaderSpec(
            markers=markers,
            sizes={"hidden": ("head.head.weight", 1), "mlp_hidden": ("blocks.0.ffn.0.weight", 0)},
            counts={"single_blocks": "blocks."},
        ),
        text_note=" (umT5's 512 caption tokens" + (" and CLIP vision's 257" if image else "") + ", cross-attended)",
        measured=False,
    )


# The I2V layout first: its files hold every T2V marker too (variants.variant_from_header takes the first).
LAYOUT_I2V = _layout("Wan I2V", (model_dims("wan2.1-i2v-14b", "wan21_i2v", 5120, 40, 13824),), image=True)
LAYOUT = _layout(
    "Wan",
    (
        model_dims("wan2.1-t2v-1.3b", "wan21_t2v", 1536, 30, 8960),
        model_dims("wan2.1-t2v-14b", "wan21_t2v", 5120, 40, 13824),
        model_dims("wan2.2-ti2v-5b", "wan22_ti2v_5b", 3072, 30, 14336),
    ),
    image=False,
)
# Wan 2.2 A14B's experts are Wan 2.1 14B in shape (no header tells them apart): their estimate is that variant's.
LAYOUT_A14B = dataclasses.replace(LAYOUT, variants=(LAYOUT.variants[1],))

# ---------------------------------------------------------------- the archs

# Every supported_models.WAN21_T2V / WAN22_T2V samples with ModelSamplingSD3 shift 8: a static σ shift.
_COMMON = dict(
    family="wan",
    patch=2,
    block_lists=("blocks",),
    shift_mode="static",
    shift=8.0,
    # Every prompt is padded to 512 tokens; a longer caption (which ComfyUI keeps whole) runs alone.
    model_extras=caption_lengths,
    context_tokens=CAPTION_TOKENS,
    split_by_caption_length=True,
    clip_type="WAN",
    diffusers_rules=DIFFUSERS_RULES,
    caption_token_limit=CAPTION_TOKENS,  # diffusers' WanPipeline max_sequence_length
    frames_per_latent=4,  # the Wan VAEs' temporal compression: frames 4k+1 → k+1 latent frames
)
_WAN21 = dict(latent_channels=16, latent_downscale=8, bucket_divisor=16, **_COMMON)
# The patch embedding's input channels: 16 (the latent) for text-to-video; 36 (16 more of the start image's latent
# and 4 of mask) for image-to-video.
IN_DIM = "diffusion_model.patch_embedding.in_channels"
_T2V = dict(
    default_targets=DEFAULT_TARGETS,
    comfy=ComfyModel("WAN21", config_class="WAN21_T2V", attributes=((IN_DIM, 16),)),
    **_WAN21,
)
_I2V = dict(
    default_targets=DEFAULT_TARGETS + IMAGE_ATTENTION,
    comfy=ComfyModel("WAN21", config_class="WAN21_I2V"),
    layout=LAYOUT_I2V,
    start_image=True,  # a clip's first frame, as WanImageToVideo feeds it (concat latent and mask)
    clip_vision=True,  # and its CLIP vision features (clip_vision_h's penultimate states) through img_emb
    **_WAN21,
)
T2V_MODELSPEC = ("Wan2.1-T2V/lora", "https://github.com/Wan-Video/Wan2.1")
A14B_MODELSPEC = ("Wan2.2-A14B/lora", "https://github.com/Wan-Video/Wan2.2")
# Wan 2.2 A14B image-to-video reads no CLIP vision (no img_emb, no k_img/v_img): only the start image, concatenated
# (in_dim 36). ComfyUI's detection names "i2v" only a model with img_emb, so it loads these experts as WAN21_T2V,
# whose concat_cond feeds WanImageToVideo's start image all the same; the patch embedding's width tells them from
# text-to-video. Their layout is the 14B's (the 20 more patch channels are 0.4 M weights).
_I2V22 = dict(
    default_targets=DEFAULT_TARGETS,
    comfy=ComfyModel("WAN21", config_class="WAN21_T2V", attributes=((IN_DIM, 36),)),
    layout=LAYOUT_A14B,
    start_image=True,
    **_WAN21,
)
# ComfyUI's video_wan2_2_14B templates sample each expert with euler/simple over half the steps, with 4-step
# lightx2v LoRAs at cfg 1; without those (Wan 2.2's own: 40 steps, cfg 3-4), a preview is Kiln's choice of
# 20 euler steps at cfg 3.5. One expert samples the whole schedule here: a preview, not the paired result.
A14B_SAMPLING = Sampling(steps=20, cfg=3.5, sampler="euler", scheduler="simple")


def _experts(kind: str, boundary: float, common: dict) -> tuple[Arch, Arch]:
    """Wan 2.2 A14B's high-noise and low-noise experts: one model file each, trained on its side of the boundary."""
    return tuple(
        Arch(
            name=f"wan22_{kind}_{side}",
            sigma_range=sigma_range,
            modelspec=A14B_MODELSPEC,
            sampling=A14B_SAMPLING,
            description=f"Wan 2.2 A14B {kind.upper()} {side}-noise expert (σ {sigma_range[0]:g}-{sigma_range[1]:g})",
            **common,
        )
        for side, sigma_range in (("high", (boundary, 1.0)), ("low", (0.0, boundary)))
    )


ARCHS = (
    # The I2V arch first: guess_arch's marker for it (image keys) is the narrower one.
    Arch(
        name="wan21_i2v",
        module_marker=r"^blocks\.\d+\.cross_attn\.[kv]_img$",
        modelspec=("Wan2.1-I2V/lora", "https://github.com/Wan-Video/Wan2.1"),
        # ComfyUI's image_to_video_wan template (ModelSamplingSD3 8).
        sampling=Sampling(steps=20, cfg=6.0, sampler="uni_pc", scheduler="simple"),
        description="Wan 2.1 image-to-video 14B (umT5-XXL); a clip's first frame is its start image, with its "
        "CLIP vision features (clip_vision_h)",
        **_I2V,
    ),
    Arch(
        name="wan21_t2v",
        module_marker=r"^blocks\.\d+\.self_attn\.[qkvo]$",
        modelspec=T2V_MODELSPEC,
        layout=LAYOUT,
        # ComfyUI's text_to_video_wan template (1.3B; ModelSamplingSD3 8).
        sampling=Sampling(steps=30, cfg=6.0, sampler="uni_pc", scheduler="simple"),
        description="Wan 2.1 text-to-video 1.3B/14B (umT5-XXL); videos or still images",
        **_T2V,
    ),
    Arch(
        name="wan22_ti2v_5b",
        default_targets=DEFAULT_TARGETS,
        comfy=ComfyModel("WAN22", config_class="WAN22_T2V"),
        layout=LAYOUT,
        latent_channels=48,
        latent_downscale=16,
        # /16 × patch 2 would be 32, but a 16 px side is what every other family buckets at (the dataset's
        # divisor); ComfyUI's WanModel pads an odd latent side to the patch and crops it back, in sampling too.
        bucket_divisor=16,
        modelspec=("Wan2.2-TI2V-5B/lora", "https://github.com/Wan-Video/Wan2.2"),
        # ComfyUI's video_wan2_2_5B_ti2v template: 20 uni_pc steps at cfg 5 after ModelSamplingSD3 shift 8, which
        # is WAN22_T2V's own shift in both trees, so samples drawn on the model as loaded take it (test_wan checks
        # both). Wan 2.2's own config samples the 5B at shift 5 (diffusers' flow_shift); Kiln follows ComfyUI.
        sampling=Sampling(steps=20, cfg=5.0, sampler="uni_pc", scheduler="simple"),
        description="Wan 2.2 TI2V 5B (48-channel /16 latents, umT5-XXL); text-to-video",
        **_COMMON,
    ),
    *_experts("t2v", 0.875, {**_T2V, "layout": LAYOUT_A14B}),
    *_experts("i2v", 0.9, _I2V22),
)
