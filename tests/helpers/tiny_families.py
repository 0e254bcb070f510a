"""Tiny models of the image DiT families ComfyUI ships and Kiln trains through `generic` or its own arch file
(Chroma, HiDream, Lumina 2, SD 3.5, HunyuanImage 2.1), built with ComfyUI's own classes and seeded weights.

Where ComfyUI detects a family from a tiny file (SD 3.5's MMDiT, HunyuanImage 2.1), the file is written and
loaded through comfy.sd.load_diffusion_model, so its shape-based detection runs; where it detects a family
only at full size (Chroma's approximator, Lumina 2's dim 2304, HiDream's fixed config), the model is put
together from supported_models.X(unet_config) as load_diffusion_model_state_dict does.
Import after helpers.comfy_env.require_comfy(): it imports ComfyUI.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import tiny_comfy as tc

CONTEXT_DIM = 64  # every tiny text encoder's width (T5-XXL, Gemma2 2B, Qwen2.5-VL, Llama 3.1 are wider)
POOLED_DIM = 32  # SD 3.5's CLIP-L + CLIP-G pooled output (2048 at full size), HiDream's likewise


@dataclass(frozen=True)
class Family:
    """One family's tiny model and how ComfyUI conditions it."""

    name: str
    build: Callable[[Path], object]  # tmp dir -> ModelPatcher
    config_class: str  # the comfy.supported_models class ComfyUI gives it
    latent: tuple[int, int]  # (latent channels, pixels per latent cell)
    targets: tuple[str, ...]  # block Linears a LoRA trains (generic: the user's patterns)
    arch: str = "generic"  # what Kiln detects it as
    # cond keys beyond the cross-attention tensor, per batch size (what Encode Captions caches beside it)
    extra_conds: Callable[[int], dict] = field(default=lambda batch: {})


def _shapes(build):
    with torch.device("meta"):
        module = build()
    return {k: v.shape for k, v in module.state_dict().items()}


def _loaded_file(path: Path, module_class, config: dict, seed: int):
    """Seeded weights of module_class(**config), written as a ComfyUI diffusion-model file and loaded by ComfyUI."""
    import comfy.ops
    import comfy.sd
    import safetensors.torch

    shapes = _shapes(lambda: module_class(**config, operations=comfy.ops.disable_weight_init))
    safetensors.torch.save_file(tc.random_state_dict(shapes, seed), str(path))
    with torch.inference_mode():
        return comfy.sd.load_diffusion_model(str(path))


# ---------------------------------------------------------------- the families


def sd35(tmp: Path, seed: int = 0, *, context_dim: int = CONTEXT_DIM, pooled_dim: int = POOLED_DIM):
    """SD 3.5 Medium's shape (MMDiT-X: a second self-attention in the first x block, q/k RMS norms), depth 2 =
    hidden 128, 2 heads of 64; model_detection reads all of it back from the file."""
    from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT

    config = dict(
        in_channels=16,
        patch_size=2,
        depth=2,
        out_channels=16,
        adm_in_channels=pooled_dim,
        context_embedder_config={
            "target": "torch.nn.Linear",
            "params": {"in_features": context_dim, "out_features": 128},
        },
        num_patches=16 * 16,
        pos_embed_max_size=16,
        qk_norm="rms",
        x_block_self_attn_layers=[0],
    )
    return _loaded_file(tmp / "tiny_sd35.safetensors", MMDiT, config, seed)


def hunyuan_image21(tmp: Path, seed: int = 0):
    """HunyuanImage 2.1's shape (a 2-D patch [1,1] HunyuanVideo: 64 latent channels, /32), hidden 256 = 2 heads
    of 128, one double and one single block; detected from the file."""
    from comfy.ldm.hunyuan_video.model import HunyuanVideo

    config = dict(
        image_model="hunyuan_video",
        in_channels=64,
        out_channels=64,
        vec_in_dim=None,
        context_in_dim=CONTEXT_DIM,
        hidden_size=256,
        mlp_ratio=4.0,
        num_heads=2,
        depth=1,
        depth_single_blocks=1,
        axes_dim=[64, 64],
        theta=256,
        patch_size=[1, 1],
        qkv_bias=True,
        guidance_embed=False,
        byt5=False,
        meanflow=False,
        use_cond_type_embedding=False,
        vision_in_dim=None,
        meanflow_sum=False,
    )
    return _loaded_file(tmp / "tiny_hunyuan_image21.safetensors", HunyuanVideo, config, seed)


def chroma_config() -> dict:
    """model_detection.py's Chroma branch (a Flux without modulation Linears: the distilled_guidance_layer
    approximator gives every block its modulation) at hidden 256, 2 heads of 128."""
    return dict(
        image_model="chroma",
        in_channels=64,
        out_channels=64,
        context_in_dim=CONTEXT_DIM,
        hidden_size=256,
        mlp_ratio=4.0,
        num_heads=2,
        depth=2,
        depth_single_blocks=2,
        axes_dim=[16, 56, 56],
        theta=10000,
        patch_size=2,
        qkv_bias=True,
        in_dim=64,
        out_dim=256,
        hidden_dim=128,
        n_layers=2,
        txt_ids_dims=[],
        vec_in_dim=None,
    )


def chroma(tmp: Path, seed: int = 0):
    import comfy.supported_models
    from comfy.ldm.chroma.model import Chroma

    return tc.assembled(comfy.supported_models.Chroma, Chroma, chroma_config(), seed)


def lumina2_config() -> dict:
    """model_detection.py's `dim == 2304` branch (Lumina 2: grouped k/v heads, ffn multiplier 4, adaLN with
    SiLU) at dim 256: 2 heads of 128, 1 k/v head."""
    return dict(
        image_model="lumina2",
        patch_size=2,
        in_channels=16,
        dim=256,
        cap_feat_dim=CONTEXT_DIM,
        n_layers=2,
        qk_norm=True,
        n_heads=2,
        n_kv_heads=1,
        axes_dims=[32, 48, 48],
        axes_lens=[300, 512, 512],
        rope_theta=10000.0,
        ffn_dim_multiplier=4.0,
    )


def lumina2(tmp: Path, seed: int = 0):
    import comfy.supported_models
    from comfy.ldm.lumina.model import NextDiT

    return tc.assembled(comfy.supported_models.Lumina2, NextDiT, lumina2_config(), seed)


HIDREAM_LLAMA_LAYERS = 2


def hidream(tmp: Path, seed: int = 0, *, caption_channels=(CONTEXT_DIM, CONTEXT_DIM), pooled_dim: int = POOLED_DIM):
    """model_detection.py's HiDream config at 2 heads of 64: one double and one single block, 2 routed experts."""
    import comfy.supported_models
    from comfy.ldm.hidream.model import HiDreamImageTransformer2DModel

    config = dict(
        image_model="hidream",
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=64,
        num_attention_heads=2,
        caption_channels=list(caption_channels),
        text_emb_dim=pooled_dim,
        num_routed_experts=2,
        num_activated_experts=1,
        axes_dims_rope=(32, 16, 16),
        max_resolution=(32, 32),
        llama_layers=[0, 1],
    )
    return tc.assembled(comfy.supported_models.HiDream, HiDreamImageTransformer2DModel, config, seed)


def _pooled(batch: int) -> dict:
    return {"pooled_output": torch.linspace(-1, 1, POOLED_DIM).repeat(batch, 1)}


def _hidream_conds(batch: int) -> dict:
    llama = torch.linspace(-1, 1, 7 * CONTEXT_DIM).reshape(1, 1, 7, CONTEXT_DIM)
    return {**_pooled(batch), "conditioning_llama3": llama.repeat(batch, HIDREAM_LLAMA_LAYERS, 1, 1)}


FLUX_BLOCK_LINEARS = ("img_attn.qkv", "img_attn.proj", "txt_attn.qkv", "txt_attn.proj")
FAMILIES = {
    f.name: f
    for f in (
        Family("chroma", chroma, "Chroma", (16, 8), (), arch="chroma"),
        Family("lumina2", lumina2, "Lumina2", (16, 8), (), arch="lumina2"),
        Family(
            "sd35",
            sd35,
            "SD3",
            (16, 8),
            ("attn.qkv", "attn.proj", "attn2.qkv", "mlp.fc1", "mlp.fc2"),
            extra_conds=_pooled,
        ),
        Family(
            "hidream",
            hidream,
            "HiDream",
            (16, 8),
            ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out", "shared_experts.w1", "shared_experts.w2"),
            extra_conds=_hidream_conds,
        ),
        Family(
            "hunyuan_image21",
            hunyuan_image21,
            "HunyuanImage21",
            (64, 32),
            FLUX_BLOCK_LINEARS + ("linear1", "linear2"),
        ),
    )
}
