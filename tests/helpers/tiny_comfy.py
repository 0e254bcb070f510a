"""Tiny ComfyUI models with seeded random weights, built in-process for the bridge tests.

Everything here is a real ComfyUI object (ModelPatcher, VAE, CLIP) so the bridge
is exercised exactly as inside ComfyUI; only the sizes are tiny:

  Flux2 (Klein or Dev)  hidden 256, 2 heads of 128, 2 double + 2 single blocks; written as a
                        ComfyUI-format safetensors file and loaded through comfy.sd.load_diffusion_model
                        (so ComfyUI's own shape-based detection runs). Dev = the same plus guidance_in.
  Z-Image               dim 256 NextDiT built by hand: ComfyUI only detects Z-Image at dim 3840
                        (comfy/model_detection.py), so supported_models.ZImage(unet_config).
  VAEs                  ComfyUI's own AutoencoderKL via comfy.sd.VAE(sd=...): SD-sized convs (ComfyUI
                        fixes ch=128), Flux2's with the batch-norm latent (128 ch, /16), Flux's 16 ch /8.
  Text encoders         ComfyUI's Klein / Z-Image Qwen3 text encoders and tokenizers with a tiny Qwen3
                        config (hidden 64, 1 head; Klein needs 28 layers for its layers 9/18/27).

Models are loaded under torch.inference_mode(), as ComfyUI loads them inside a prompt, so their
weights are inference tensors exactly as the Train LoRA node will meet them.
ComfyUI must be importable (tests/helpers/comfy_env.require_comfy() first).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

FLUX2_HIDDEN = 256
FLUX2_TE_HIDDEN = 64  # Klein context dim = 3 * hidden (layers 9, 18, 27 stacked)
FLUX2_CONTEXT_DIM = 3 * FLUX2_TE_HIDDEN
ZIMAGE_DIM = 256
ZIMAGE_TE_HIDDEN = 64  # Z-Image context dim = hidden (second-to-last layer)


def write_photos(folder: Path, count: int = 3) -> Path:
    """`count` seeded 64x64 noise photos `0.png`... with captions "photo 0"...: a headless run's dataset."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(count):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(f"photo {i}", encoding="utf-8")
    return folder


# ---------------------------------------------------------------- weights


def random_state_dict(shapes: dict[str, torch.Size], seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights that give well-scaled activations: matrices ~ N(0, 1/fan_in), norm scales
    ~ 1, biases and learned tokens small. Keys are visited in sorted order, so the values depend
    on the seed and the shapes only."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for key in sorted(shapes):
        shape = tuple(shapes[key])
        noise = torch.randn(shape, generator=generator)
        if key.endswith(("running_mean",)):
            out[key] = noise * 0.1
        elif key.endswith("running_var"):
            out[key] = 1.0 + noise.abs() * 0.1
        elif key.endswith("num_batches_tracked"):
            out[key] = torch.zeros(shape, dtype=torch.long)
        elif len(shape) >= 2 and not key.endswith("pad_token"):
            fan_in = math.prod(shape[1:])
            out[key] = noise / math.sqrt(fan_in)
        elif "norm" in key or key.endswith(".scale"):
            out[key] = 1.0 + 0.1 * noise
        else:  # biases, learned pad tokens
            out[key] = 0.02 * noise
    return out


def _meta_shapes(build) -> dict[str, torch.Size]:
    with torch.device("meta"):
        module = build()
    return {k: v.shape for k, v in module.state_dict().items()}


# ---------------------------------------------------------------- diffusion models


def flux2_config(dev: bool) -> dict:
    """What comfy/model_detection.py derives from a Flux2 file of this size."""
    return dict(
        image_model="flux2",
        axes_dim=[32, 32, 32, 32],
        num_heads=FLUX2_HIDDEN // 128,
        mlp_ratio=3.0,
        theta=2000,
        out_channels=128,
        global_modulation=True,
        mlp_silu_act=True,
        qkv_bias=False,
        ops_bias=False,
        default_ref_method="index",
        ref_index_scale=10.0,
        txt_ids_dims=[3],
        patch_size=1,
        in_channels=128,
        hidden_size=FLUX2_HIDDEN,
        context_in_dim=FLUX2_CONTEXT_DIM,
        vec_in_dim=None,
        depth=2,
        depth_single_blocks=2,
        guidance_embed=dev,
        yak_mlp=False,
        txt_norm=False,
    )


def write_flux2_file(path: Path, *, dev: bool = False, seed: int = 0, quantized: bool = False) -> Path:
    """A ComfyUI-format Flux2 diffusion-model file (`diffusion_model.`-less keys, as UNETLoader reads).
    quantized: the blocks' Linear weights stored as ComfyUI's own quantized checkpoints store them
    (Comfy-Org's fp8 files; comfy/ops.py mixed_precision_ops): float8_e4m3fn `weight`, a per-tensor
    `weight_scale`, and a `comfy_quant` JSON naming the format. ComfyUI then loads those layers into its
    mixed-precision Linear, which is not a torch.nn.Linear."""
    import json

    import comfy.ops
    import safetensors.torch
    from comfy.ldm.flux.model import Flux

    shapes = _meta_shapes(lambda: Flux(**flux2_config(dev), operations=comfy.ops.disable_weight_init))
    tensors = random_state_dict(shapes, seed)
    if quantized:
        quant = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
        for key in [k for k, v in tensors.items() if "blocks." in k and k.endswith(".weight") and v.ndim == 2]:
            weight, layer = tensors[key], key.removesuffix(".weight")
            scale = weight.abs().amax() / torch.finfo(torch.float8_e4m3fn).max
            tensors[key] = (weight / scale).to(torch.float8_e4m3fn)
            tensors[f"{layer}.weight_scale"], tensors[f"{layer}.comfy_quant"] = scale.float(), quant.clone()
    safetensors.torch.save_file(tensors, str(path))
    return path


def tiny_flux2(tmp_dir: Path, *, dev: bool = False, seed: int = 0):
    """ModelPatcher of a tiny Flux2 Klein (or Dev), loaded through ComfyUI's UNETLoader path."""
    import comfy.sd

    path = write_flux2_file(
        Path(tmp_dir) / f"tiny_flux2_{'dev' if dev else 'klein'}_{seed}.safetensors", dev=dev, seed=seed
    )
    with torch.inference_mode():
        return comfy.sd.load_diffusion_model(str(path))


def zimage_unet_config() -> dict:
    """comfy/model_detection.py's Z-Image config (dim 3840 there) at dim 256 (2 heads of 128)."""
    return dict(
        image_model="lumina2",
        patch_size=2,
        in_channels=16,
        dim=ZIMAGE_DIM,
        cap_feat_dim=ZIMAGE_TE_HIDDEN,
        n_layers=2,
        qk_norm=True,
        n_heads=ZIMAGE_DIM // 128,
        n_kv_heads=ZIMAGE_DIM // 128,
        axes_dims=[32, 48, 48],
        axes_lens=[1536, 512, 512],
        rope_theta=256.0,
        ffn_dim_multiplier=8.0 / 3.0,
        z_image_modulation=True,
        time_scale=1000.0,
        pad_tokens_multiple=32,
    )


def tiny_zimage(*, seed: int = 0):
    """ModelPatcher of a tiny Z-Image (ComfyUI detects Z-Image only at dim 3840)."""
    import comfy.supported_models
    from comfy.ldm.lumina.model import NextDiT

    return assembled(comfy.supported_models.ZImage, NextDiT, zimage_unet_config(), seed)


QWEN_CONTEXT_DIM = 48  # Qwen2.5-VL 7B gives 3584; tiny here


def qwen_image_unet_config(**extra) -> dict:
    """A tiny QwenImageTransformer2DModel: 2 blocks, 2 heads of 32 (RoPE axes 8+12+12 = head dim); `extra`:
    what model_detection adds for a variant (Qwen-Image-Edit 2511: default_ref_method="index_timestep_zero")."""
    return dict(
        image_model="qwen_image",
        num_layers=2,
        num_attention_heads=2,
        attention_head_dim=32,
        joint_attention_dim=QWEN_CONTEXT_DIM,
        in_channels=64,
        out_channels=16,
        axes_dims_rope=(8, 12, 12),
        **extra,
    )


def tiny_qwen_image(*, seed: int = 0, **extra):
    """ModelPatcher of a tiny Qwen-Image, assembled the way load_diffusion_model_state_dict does (ComfyUI
    detects Qwen-Image only at 24 heads of 128, so supported_models.QwenImage(unet_config))."""
    import comfy.supported_models
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    return assembled(
        comfy.supported_models.QwenImage, QwenImageTransformer2DModel, qwen_image_unet_config(**extra), seed
    )


def assembled(config_class, module_class, unet_config: dict, seed: int):
    """ModelPatcher of `module_class(**unet_config)` with seeded random weights, put together the way
    load_diffusion_model_state_dict does (for families ComfyUI detects only at full size)."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.ops

    shapes = _meta_shapes(lambda: module_class(**unet_config, operations=comfy.ops.disable_weight_init))
    sd = random_state_dict(shapes, seed)
    with torch.inference_mode():
        model_config = config_class(dict(unet_config))
        model_config.set_inference_dtype(torch.float32, None)
        model = model_config.get_model(sd, "")
        model.load_model_weights(sd, "")
        return comfy.model_patcher.ModelPatcher(
            model, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device()
        )


def write_zimage_adapter_file(path: Path, *, rank: int = 4, seed: int = 5) -> Path:
    """A training adapter for tiny_zimage() as ai-toolkit names the Z-Image one (split q/k/v, `to_out.0`,
    feed_forward w1..3, no alpha): small random LoRA weights, loadable by ComfyUI's LoRA loader."""
    import comfy.ops
    import safetensors.torch
    from comfy.ldm.lumina.model import NextDiT

    with torch.device("meta"):
        shapes = {
            k: v.shape
            for k, v in NextDiT(**zimage_unet_config(), operations=comfy.ops.disable_weight_init).state_dict().items()
        }
    generator, tensors, head = torch.Generator().manual_seed(seed), {}, ZIMAGE_DIM
    for layer in range(zimage_unet_config()["n_layers"]):
        prefix = f"layers.{layer}"
        parts = {f"attention.to_{n}": (head, head) for n in "qkv"}
        parts["attention.to_out.0"] = tuple(shapes[f"{prefix}.attention.out.weight"])
        parts.update(
            {f"feed_forward.{n}": tuple(shapes[f"{prefix}.feed_forward.{n}.weight"]) for n in ("w1", "w2", "w3")}
        )
        for name, (out_features, in_features) in parts.items():
            key = f"diffusion_model.{prefix}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    safetensors.torch.save_file(tensors, str(path))
    return path


# ---------------------------------------------------------------- VAEs


def _vae_state_dict(*, flux2: bool, seed: int) -> dict[str, torch.Tensor]:
    from comfy.ldm.models.autoencoder import AutoencoderKL

    z_channels = 32 if flux2 else 16
    ddconfig = {
        "double_z": True,
        "z_channels": z_channels,
        "resolution": 256,
        "in_channels": 3,
        "out_ch": 3,
        "ch": 128,
        "ch_mult": [1, 2, 4, 4],
        "num_res_blocks": 2,
        "attn_resolutions": [],
        "dropout": 0.0,
        "batch_norm_latent": flux2,
    }
    shapes = _meta_shapes(lambda: AutoencoderKL(ddconfig=ddconfig, embed_dim=z_channels))
    return random_state_dict(shapes, seed)


def tiny_vae(*, flux2: bool, seed: int = 0):
    """ComfyUI's VAE detected from a state dict: Flux2's (128 latent channels, /16) or Flux's (16, /8)."""
    import comfy.sd

    sd = _vae_state_dict(flux2=flux2, seed=seed)
    with torch.inference_mode():
        vae = comfy.sd.VAE(sd=sd)
    expected = (128, 16) if flux2 else (16, 8)
    assert (vae.latent_channels, vae.downscale_ratio) == expected, (vae.latent_channels, vae.downscale_ratio)
    return vae


# ---------------------------------------------------------------- text encoders


def _qwen3_config(layers: int) -> dict:
    # Qwen3_4BConfig fields; head_dim stays 128 (a class constant there).
    return {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
    }


def _tiny_clip(*, klein: bool, seed: int):
    import comfy.ops
    import comfy.sd
    import comfy.supported_models_base
    import comfy.text_encoders.flux as flux_te
    import comfy.text_encoders.llama as llama
    import comfy.text_encoders.z_image as zimage_te
    from comfy import sd1_clip

    layers = 28 if klein else 4
    config = _qwen3_config(layers)

    # The same SDClipModel arguments as ComfyUI's Qwen3_4BModel classes, with a tiny config.
    if klein:

        class TinyQwen3(sd1_clip.SDClipModel):
            def __init__(self, device="cpu", dtype=None, model_options=None):
                super().__init__(
                    device=device,
                    layer=[9, 18, 27],
                    layer_idx=None,
                    textmodel_json_config=config,
                    dtype=dtype,
                    special_tokens={"pad": 151643},
                    layer_norm_hidden_state=False,
                    model_class=llama.Qwen3_4B,
                    enable_attention_masks=True,
                    return_attention_masks=True,
                    model_options=model_options or {},
                )

        class TinyTE(flux_te.Flux2TEModel):
            def __init__(self, device="cpu", dtype=None, model_options=None):
                super().__init__(
                    device=device, dtype=dtype, name="qwen3_4b", clip_model=TinyQwen3, model_options=model_options or {}
                )

        tokenizer = flux_te.KleinTokenizer
    else:

        class TinyQwen3(sd1_clip.SDClipModel):
            def __init__(self, device="cpu", dtype=None, model_options=None):
                super().__init__(
                    device=device,
                    layer="hidden",
                    layer_idx=-2,
                    textmodel_json_config=config,
                    dtype=dtype,
                    special_tokens={"pad": 151643},
                    layer_norm_hidden_state=False,
                    model_class=llama.Qwen3_4B,
                    enable_attention_masks=True,
                    return_attention_masks=True,
                    model_options=model_options or {},
                )

        class TinyTE(sd1_clip.SD1ClipModel):
            def __init__(self, device="cpu", dtype=None, model_options=None):
                super().__init__(
                    device=device, dtype=dtype, name="qwen3_4b", clip_model=TinyQwen3, model_options=model_options or {}
                )

        tokenizer = zimage_te.ZImageTokenizer

    shapes = _meta_shapes(lambda: llama.Qwen3_4B(config, None, None, comfy.ops.disable_weight_init))
    sd = random_state_dict(shapes, seed)  # SDClipModel.load_sd takes the transformer's own keys
    target = comfy.supported_models_base.ClipTarget(tokenizer, TinyTE)
    with torch.inference_mode():
        return comfy.sd.CLIP(target=target, state_dict=[sd], model_options={"dtype": torch.float32})


def tiny_klein_clip(*, seed: int = 0):
    """ComfyUI's Klein text encoder (Qwen3, layers 9/18/27 stacked, 512-token padding), tiny."""
    return _tiny_clip(klein=True, seed=seed)


def tiny_zimage_clip(*, seed: int = 0):
    """ComfyUI's Z-Image text encoder (Qwen3, second-to-last hidden layer, no padding), tiny."""
    return _tiny_clip(klein=False, seed=seed)


def conditioning(clip, text: str):
    """CLIPTextEncode, as nodes.py does it."""
    with torch.inference_mode():
        return clip.encode_from_tokens_scheduled(clip.tokenize(text))


# ---------------------------------------------------------------- files for a ComfyUI server (test_server.py)


def write_vae_file(path: Path, *, flux2: bool, seed: int = 0) -> Path:
    """The tiny VAE of tiny_vae() as a safetensors file that ComfyUI's VAELoader loads and detects (fp16 on
    disk to halve the file; ComfyUI casts to its VAE dtype on load)."""
    import safetensors.torch

    sd = _vae_state_dict(flux2=flux2, seed=seed)
    safetensors.torch.save_file({k: v.half() if v.is_floating_point() else v for k, v in sd.items()}, str(path))
    return path
