"""Tiny SD 3.5 and HiDream text encoders — ComfyUI's own SD3ClipModel and HiDreamTEModel with a tiny CLIP-L (and
for HiDream a tiny Llama 3.1) in place of the full-size ones — and tiny models of those families sized to read
what they give: the pooled CLIP vector (`pooled_output`, the model's `y`) and HiDream's Llama layers
(`conditioning_llama3`). The encoders left out give what ComfyUI gives for a missing one (zeros of the full
width: CLIP-G's 1280 pooled values, T5's 4096-wide tokens), so the tiny models take those widths.
Import after helpers.comfy_env.require_comfy(): it imports ComfyUI.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import tiny_comfy as tc
from . import tiny_families as tf

CLIP_L_HIDDEN = 64
POOLED = CLIP_L_HIDDEN + 1280  # CLIP-L's pooled output beside a missing CLIG-G's zeros
T5_WIDTH = 4096  # SD3's CLIP tokens are padded to it; HiDream's missing T5 gives zeros of it
LLAMA_HIDDEN = 64
LLAMA_LAYERS = 2


def _clip_l_config(vocab: int = 49408) -> dict:
    return {
        "hidden_size": CLIP_L_HIDDEN,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_hidden_layers": 3,  # SD3 reads layer -2
        "vocab_size": vocab,
        "max_position_embeddings": 77,
        "hidden_act": "quick_gelu",
        "projection_dim": CLIP_L_HIDDEN,
        "layer_norm_eps": 1e-5,
        "eos_token_id": 49407,
        "bos_token_id": 0,
        "pad_token_id": 1,
    }


def _llama_config() -> dict:
    return {
        "vocab_size": 151936,  # the stand-in tokenizer's (Qwen 2.5's)
        "hidden_size": LLAMA_HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": LLAMA_LAYERS,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
    }


def _shapes(build) -> dict:
    with torch.device("meta"):
        module = build()
    return {k: v.shape for k, v in module.state_dict().items()}


def _clip(tokenizer, te_class, state_dicts):
    import comfy.sd
    import comfy.supported_models_base

    target = comfy.supported_models_base.ClipTarget(tokenizer, te_class)
    with torch.inference_mode():
        return comfy.sd.CLIP(target=target, state_dict=state_dicts, model_options={"dtype": torch.float32})


def _clip_l_state_dict(seed: int) -> dict:
    import comfy.clip_model
    import comfy.ops

    config = _clip_l_config()
    shapes = _shapes(lambda: comfy.clip_model.CLIPTextModel(config, None, None, comfy.ops.disable_weight_init))
    return tc.random_state_dict(shapes, seed)


def tiny_sd3_clip(seed: int = 0):
    """SD3ClipModel with a tiny CLIP-L alone (as SD3's clip_l layer -2, unprojected pooled output)."""
    import comfy.text_encoders.sd3_clip as sd3
    from comfy import sd1_clip

    class TinySD3TE(sd3.SD3ClipModel):
        def __init__(self, device="cpu", dtype=None, model_options=None):
            model_options = model_options or {}
            super().__init__(
                clip_l=False, clip_g=False, t5=False, device=device, dtype=dtype, model_options=model_options
            )
            self.clip_l = sd1_clip.SDClipModel(
                layer="hidden",
                layer_idx=-2,
                device=device,
                dtype=dtype,
                layer_norm_hidden_state=False,
                return_projected_pooled=False,
                textmodel_json_config=_clip_l_config(),
                model_options=model_options,
            )
            self.dtypes.add(dtype)

    return _clip(sd3.SD3Tokenizer, TinySD3TE, [_clip_l_state_dict(seed)])


def tiny_hidream_clip(seed: int = 0):
    """HiDreamTEModel with a tiny CLIP-L (projected pooled output) and a tiny Llama 3.1 (every layer's output)."""
    import comfy.ops
    from comfy import sd1_clip
    from comfy.text_encoders import hidream, llama

    class TinyHiDreamTE(hidream.HiDreamTEModel):
        def __init__(self, device="cpu", dtype=None, model_options=None):
            model_options = model_options or {}
            super().__init__(
                clip_l=False,
                clip_g=False,
                t5=False,
                llama=False,
                device=device,
                dtype=dtype,
                model_options=model_options,
            )
            self.clip_l = sd1_clip.SDClipModel(
                device=device,
                dtype=dtype,
                return_projected_pooled=True,
                textmodel_json_config=_clip_l_config(),
                model_options=model_options,
            )
            self.llama = sd1_clip.SDClipModel(
                device=device,
                layer="all",
                layer_idx=None,
                textmodel_json_config=_llama_config(),
                dtype=dtype,
                special_tokens={"pad": 151643},
                layer_norm_hidden_state=False,
                model_class=llama.Llama2,
                enable_attention_masks=True,
                return_attention_masks=True,
                model_options=model_options,
            )
            self.dtypes.add(dtype)

    class TinyHiDreamTokenizer(hidream.HiDreamTokenizer):
        """HiDream's tokenizers, with Qwen 2.5's BPE padded to 128 standing in for Llama 3.1's (the trees ship
        no llama_tokenizer/tokenizer.json); tokenize_with_weights is HiDream's own."""

        def __init__(self, embedding_directory=None, tokenizer_data=None):
            tokenizer_data = tokenizer_data or {}
            import comfy.text_encoders.sd3_clip as sd3
            from comfy import sdxl_clip
            from transformers import Qwen2Tokenizer

            self.clip_l = sd1_clip.SDTokenizer(embedding_directory=embedding_directory, tokenizer_data=tokenizer_data)
            self.clip_g = sdxl_clip.SDXLClipGTokenizer(
                embedding_directory=embedding_directory, tokenizer_data=tokenizer_data
            )
            self.t5xxl = sd3.T5XXLTokenizer(
                embedding_directory=embedding_directory, min_length=128, max_length=128, tokenizer_data=tokenizer_data
            )
            self.llama = sd1_clip.SDTokenizer(
                str(Path(hidream.__file__).parent / "qwen25_tokenizer"),
                pad_with_end=False,
                embedding_directory=embedding_directory,
                embedding_size=LLAMA_HIDDEN,
                embedding_key="llama",
                tokenizer_class=Qwen2Tokenizer,
                has_start_token=False,
                has_end_token=False,
                pad_to_max_length=False,
                max_length=99999999,
                min_length=128,
                pad_token=151643,
                tokenizer_data=tokenizer_data,
            )

    llama_shapes = _shapes(lambda: llama.Llama2(_llama_config(), None, None, comfy.ops.disable_weight_init))
    return _clip(
        TinyHiDreamTokenizer, TinyHiDreamTE, [_clip_l_state_dict(seed), tc.random_state_dict(llama_shapes, seed)]
    )


def sd35(tmp: Path, seed: int = 0):
    """tiny_families' SD 3.5 Medium shape, reading the tiny SD 3.5 encoder's context and pooled widths."""
    return tf.sd35(tmp, seed, context_dim=T5_WIDTH, pooled_dim=POOLED)


def hidream(tmp: Path, seed: int = 0):
    """tiny_families' HiDream shape, reading the tiny HiDream encoder's T5 (zeros) and Llama layers."""
    return tf.hidream(tmp, seed, caption_channels=[T5_WIDTH, LLAMA_HIDDEN], pooled_dim=POOLED)
