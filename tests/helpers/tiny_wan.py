"""A tiny Wan model and VAE built with ComfyUI's own classes (comfy/ldm/wan), for the Wan tests: the model as a
ComfyUI-format file loaded through comfy.sd.load_diffusion_model (ComfyUI's detection runs), the VAE detected from a
state dict by comfy.sd.VAE. ComfyUI must be importable (tests/helpers/comfy_env.require_comfy() first)."""

from __future__ import annotations

import numpy as np
import torch

from . import tiny_comfy as tc

TEXT_DIM = 4096  # umT5-XXL's width: WanModel's text_dim, which ComfyUI does not read off the file
DIM, FFN, LAYERS = 256, 256, 2  # 2 heads of 128 (ComfyUI: heads = dim / 128)


def write_wan_file(path, *, model_type="t2v", in_dim=16, out_dim=16, seed=0):
    """A ComfyUI-format Wan diffusion-model file; UNETLoader's detection (model_detection.py) reads it."""
    import comfy.ops
    import safetensors.torch
    from comfy.ldm.wan.model import WanModel

    config = dict(model_type=model_type, in_dim=in_dim, out_dim=out_dim, dim=DIM, ffn_dim=FFN, num_heads=DIM // 128)
    with torch.device("meta"):
        module = WanModel(**config, num_layers=LAYERS, text_dim=TEXT_DIM, operations=comfy.ops.disable_weight_init)
    tensors = tc.random_state_dict({k: v.shape for k, v in module.state_dict().items()}, seed)
    safetensors.torch.save_file(tensors, str(path))
    return path


def load(path):
    import comfy.sd

    with torch.inference_mode():
        return comfy.sd.load_diffusion_model(str(path))


def caption(tokens: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((tokens, TEXT_DIM)).astype(np.float32)


def cond(embedding: np.ndarray):
    """CONDITIONING as CLIPTextEncode gives it for one Wan prompt: umT5 pads to 512 tokens with zeros."""
    padded = np.zeros((512, TEXT_DIM), np.float32)
    padded[: len(embedding)] = embedding
    return [[torch.from_numpy(padded)[None], {}]]


def tiny_wan_vae(seed: int = 0):
    """ComfyUI's Wan 2.1 VAE, detected from a state dict of a WanVAE with tiny dims (dim 8: the head's gamma)."""
    import comfy.ldm.wan.vae
    import comfy.sd

    config = dict(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
    shapes = tc._meta_shapes(lambda: comfy.ldm.wan.vae.WanVAE(**config))
    sd = tc.random_state_dict(shapes, seed)
    with torch.inference_mode():
        vae = comfy.sd.VAE(sd=sd)
    assert vae.latent_dim == 3 and vae.latent_channels == 16
    return vae


# A CLIP ViT of clip_vision_h's width (Wan 2.1 I2V's img_emb reads 1280-wide penultimate states), two layers and
# 28 px images (4 patches + the class token): comfy/clip_model.py's CLIPVisionModelProjection under ComfyUI's
# ClipVisionModel, as CLIP Vision Loader gives it.
CLIP_VISION_CONFIG = dict(
    hidden_act="gelu",
    hidden_size=1280,
    image_size=28,
    intermediate_size=64,
    layer_norm_eps=1e-05,
    model_type="clip_vision_model",
    num_attention_heads=2,
    num_channels=3,
    num_hidden_layers=2,
    patch_size=14,
    projection_dim=32,
)


def tiny_clip_vision(folder, seed: int = 0):
    """ComfyUI's ClipVisionModel (the CLIP_VISION CLIP Vision Loader gives) with tiny seeded weights. Its config
    goes through a file: 0.17's ClipVisionModel reads only a path."""
    import json

    import comfy.clip_vision

    path = folder / "tiny_clip_vision.json"
    path.write_text(json.dumps(CLIP_VISION_CONFIG))
    model = comfy.clip_vision.ClipVisionModel(str(path))
    shapes = {key: value.shape for key, value in model.get_sd().items()}
    missing, unexpected = model.load_sd(tc.random_state_dict(shapes, seed))
    assert not missing and not unexpected
    return model
