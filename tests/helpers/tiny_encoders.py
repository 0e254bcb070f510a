"""ComfyUI's umT5 (Wan) and Qwen2.5-VL (Qwen-Image) text encoders and its Wan 2.2 VAE at a tiny size, for the server
test's Wan and Qwen-Image-Edit example workflows (tests/nodes/server_nodes returns them).

ComfyUI builds each of these from a fixed full-size config whatever a file holds (CLIPLoader: umT5-XXL at d_model
4096, Qwen2.5-VL 7B with its 1280-wide vision tower; VAELoader: the Wan 2.2 VAE at dim 160), so no tiny file loads
through the loaders; these are ComfyUI's own classes with tiny configs, i.e. a real comfy.sd.CLIP / comfy.sd.VAE.
Import after helpers.comfy_env.require_comfy(): it imports ComfyUI.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import torch

from . import tiny_comfy as tc
from .tiny_wan import TEXT_DIM

UMT5_DIM = 32  # repeated to Wan's TEXT_DIM: ComfyUI builds a Wan model's text_embedding at 4096 wide
QWEN_VL_HIDDEN = tc.QWEN_CONTEXT_DIM  # tiny_qwen_image's joint_attention_dim


def _clip(tokenizer, te_class, sd, tokenizer_data=None):
    import comfy.sd
    import comfy.supported_models_base

    target = comfy.supported_models_base.ClipTarget(tokenizer, te_class)
    with torch.inference_mode():
        return comfy.sd.CLIP(
            target=target, state_dict=[sd], tokenizer_data=tokenizer_data or {}, model_options={"dtype": torch.float32}
        )


def tiny_umt5_clip(seed: int = 0):
    """ComfyUI's Wan text encoder (WanT5Model: umT5, 512-token padding, masked tokens zeroed) at d_model 32, one layer.
    Its tokenizer is ComfyUI's T5 sentencepiece model from the tree (a real umT5 file carries its own)."""
    import comfy.ops
    import comfy.text_encoders.t5 as t5
    import comfy.text_encoders.wan as wan
    from comfy import sd1_clip

    config = dict(
        d_ff=64,
        d_kv=32,
        d_model=UMT5_DIM,
        num_heads=1,
        num_layers=1,
        vocab_size=32128,
        dense_act_fn="gelu_pytorch_tanh",
        is_gated_act=True,
        layer_norm_epsilon=1e-6,
        model_type="umt5",
        relative_attention_num_buckets=32,
    )

    class WideT5(t5.T5):
        def forward(self, *args, **kwargs):
            out, intermediate = super().forward(*args, **kwargs)
            widen = TEXT_DIM // UMT5_DIM
            return out.repeat(1, 1, widen), None if intermediate is None else intermediate.repeat(1, 1, widen)

    class TinyUMT5(sd1_clip.SDClipModel):
        def __init__(self, device="cpu", dtype=None, model_options=None):
            super().__init__(
                device=device,
                layer="last",
                layer_idx=None,
                textmodel_json_config=config,
                dtype=dtype,
                special_tokens={"end": 1, "pad": 0},
                model_class=WideT5,
                enable_attention_masks=True,
                zero_out_masked=True,
                model_options=model_options or {},
            )

    class TinyTE(wan.WanT5Model):
        def __init__(self, device="cpu", dtype=None, model_options=None):
            sd1_clip.SD1ClipModel.__init__(
                self, device=device, dtype=dtype, name="umt5xxl", clip_model=TinyUMT5, model_options=model_options or {}
            )

    shapes = tc._meta_shapes(lambda: t5.T5(config, None, None, comfy.ops.disable_weight_init))
    spiece = Path(t5.__file__).parent / "t5_pile_tokenizer" / "tokenizer.model"
    sd = tc.random_state_dict(shapes, seed)
    return _clip(
        wan.WanT5Tokenizer,
        TinyTE,
        sd,
        {"spiece_model": torch.frombuffer(bytearray(spiece.read_bytes()), dtype=torch.uint8)},
    )


def tiny_qwen25vl_clip(seed: int = 0):
    """ComfyUI's Qwen-Image text encoder (QwenImageTEModel: Qwen2.5-VL's language model, the system template cut off)
    with a tiny config and no vision tower (the example encodes text alone)."""
    import comfy.ops
    import comfy.text_encoders.llama as llama
    import comfy.text_encoders.qwen_image as qwen_image
    from comfy import sd1_clip

    config = dict(
        hidden_size=QWEN_VL_HIDDEN,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
    )

    class TextOnlyVL(llama.Qwen25_7BVLI):
        def __init__(self, config_dict, dtype, device, operations):
            torch.nn.Module.__init__(self)  # Qwen25_7BVLI's own __init__ builds the full-size vision tower
            full = llama.Qwen25_7BVLI_Config(**config_dict)
            self.num_layers = full.num_hidden_layers
            self.model = llama.Llama2_(full, device=device, dtype=dtype, ops=operations)
            self.dtype = dtype

    class TinyVL(sd1_clip.SDClipModel):
        def __init__(self, device="cpu", dtype=None, model_options=None):
            super().__init__(
                device=device,
                layer="last",
                layer_idx=None,
                textmodel_json_config=config,
                dtype=dtype,
                special_tokens={"pad": 151643},
                layer_norm_hidden_state=False,
                model_class=TextOnlyVL,
                enable_attention_masks=True,
                return_attention_masks=True,
                model_options=model_options or {},
            )

    class TinyTE(qwen_image.QwenImageTEModel):
        def __init__(self, device="cpu", dtype=None, model_options=None):
            sd1_clip.SD1ClipModel.__init__(
                self, device=device, dtype=dtype, name="qwen25_7b", clip_model=TinyVL, model_options=model_options or {}
            )

    shapes = tc._meta_shapes(lambda: TextOnlyVL(config, None, None, comfy.ops.disable_weight_init))
    return _clip(qwen_image.QwenImageTokenizer, TinyTE, tc.random_state_dict(shapes, seed))


def tiny_wan22_vae(seed: int = 0):
    """ComfyUI's Wan 2.2 VAE (48 latent channels, /16) as comfy.sd.VAE detects it from a state dict, built at dim 8:
    the detection's fixed dim 160 is narrowed while it runs."""
    import comfy.ldm.wan.vae2_2 as vae22
    import comfy.sd

    real, small = vae22.WanVAE, dict(dim=8, dec_dim=8)
    config = dict(z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
    sd = tc.random_state_dict(tc._meta_shapes(lambda: real(**config, **small)), seed)
    with mock.patch.object(vae22, "WanVAE", lambda **ddconfig: real(**{**ddconfig, **small})), torch.inference_mode():
        vae = comfy.sd.VAE(sd=sd)
    assert vae.latent_dim == 3 and vae.latent_channels == 48
    return vae


def write_wan21_vae_file(path: Path, seed: int = 0) -> Path:
    """tiny_wan.tiny_wan_vae()'s Wan 2.1 VAE as a file VAELoader detects (it reads the width off decoder.head);
    Qwen-Image's VAE is the same architecture."""
    import comfy.ldm.wan.vae
    import safetensors.torch

    config = dict(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
    shapes = tc._meta_shapes(lambda: comfy.ldm.wan.vae.WanVAE(**config))
    safetensors.torch.save_file(tc.random_state_dict(shapes, seed), str(path))
    return path
