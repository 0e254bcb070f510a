"""Seeded weights for tiny test models, with ComfyUI's exact key names and shapes; numpy only.

The MLX ports are checked against goldens that scripts/make_goldens.py makes by running ComfyUI on
these same weights, so CI needs neither torch nor ComfyUI to rebuild them. Values are well scaled
(matrices ~ N(0, 1/fan_in), norm scales ~ 1) so every block visibly changes the output: a port that
skipped a block or rotated the wrong RoPE pairs would miss its golden by far more than the tolerance.
"""

from __future__ import annotations

import math

import numpy as np

# ---------------------------------------------------------------- Flux2

FLUX2_HEAD_DIM = 128  # sum of ComfyUI's Flux2 axes_dim [32, 32, 32, 32]; heads = hidden / 128
FLUX2_MLP_RATIO = 3.0  # what comfy/model_detection.py sets for every Flux2
FLUX2_CONTEXT_DIM = 192  # tests/helpers/tiny_comfy.py: 3 stacked layers of a 64-wide tiny Qwen3


def flux2_shapes(
    *,
    hidden: int = 256,
    double: int = 2,
    single: int = 2,
    context_dim: int = FLUX2_CONTEXT_DIM,
    in_channels: int = 128,
    dev: bool = False,
) -> dict[str, tuple[int, ...]]:
    """{ComfyUI diffusion-model key: shape} of a Flux2 (Klein; Dev adds guidance_in). No biases."""
    if hidden % FLUX2_HEAD_DIM:
        raise ValueError(
            f"Flux2 hidden must be a multiple of {FLUX2_HEAD_DIM} (ComfyUI: heads = hidden/128), got {hidden}"
        )
    mlp = int(hidden * FLUX2_MLP_RATIO)
    head = FLUX2_HEAD_DIM
    shapes = {
        "img_in.weight": (hidden, in_channels),
        "txt_in.weight": (hidden, context_dim),
        "time_in.in_layer.weight": (hidden, 256),
        "time_in.out_layer.weight": (hidden, hidden),
        "double_stream_modulation_img.lin.weight": (6 * hidden, hidden),
        "double_stream_modulation_txt.lin.weight": (6 * hidden, hidden),
        "single_stream_modulation.lin.weight": (3 * hidden, hidden),
        "final_layer.linear.weight": (in_channels, hidden),
        "final_layer.adaLN_modulation.1.weight": (2 * hidden, hidden),
    }
    if dev:
        shapes["guidance_in.in_layer.weight"] = (hidden, 256)
        shapes["guidance_in.out_layer.weight"] = (hidden, hidden)
    for n in range(double):
        for stream in ("img", "txt"):
            prefix = f"double_blocks.{n}.{stream}_"
            shapes[prefix + "attn.qkv.weight"] = (3 * hidden, hidden)
            shapes[prefix + "attn.norm.query_norm.weight"] = (head,)
            shapes[prefix + "attn.norm.key_norm.weight"] = (head,)
            shapes[prefix + "attn.proj.weight"] = (hidden, hidden)
            shapes[prefix + "mlp.0.weight"] = (2 * mlp, hidden)  # SiLU-gated: gate and value halves
            shapes[prefix + "mlp.2.weight"] = (hidden, mlp)
    for n in range(single):
        prefix = f"single_blocks.{n}."
        shapes[prefix + "linear1.weight"] = (3 * hidden + 2 * mlp, hidden)  # qkv, then the gated MLP in
        shapes[prefix + "linear2.weight"] = (hidden, hidden + mlp)  # attention out ++ MLP out
        shapes[prefix + "norm.query_norm.weight"] = (head,)
        shapes[prefix + "norm.key_norm.weight"] = (head,)
    return shapes


def flux2_weights(
    seed: int,
    *,
    hidden: int = 256,
    double: int = 2,
    single: int = 2,
    context_dim: int = FLUX2_CONTEXT_DIM,
    in_channels: int = 128,
    dev: bool = False,
) -> dict[str, np.ndarray]:
    """A tiny Flux2 (Klein, or Dev with guidance_in) as float32 arrays keyed like a ComfyUI file."""
    shapes = flux2_shapes(
        hidden=hidden, double=double, single=single, context_dim=context_dim, in_channels=in_channels, dev=dev
    )
    return _seeded(shapes, seed)


def _seeded(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """Keys drawn in sorted order, so values depend on the seed and the shapes only."""
    rng = np.random.default_rng(seed)
    out = {}
    for key in sorted(shapes):
        shape = shapes[key]
        noise = rng.standard_normal(shape)
        if key.endswith("pad_token"):  # Z-Image's learned pad tokens: as large as real tokens
            value = noise
        elif len(shape) >= 2:
            value = noise / math.sqrt(math.prod(shape[1:]))
        elif "norm" in key:
            value = 1.0 + 0.1 * noise
        else:
            value = 0.02 * noise
        out[key] = value.astype(np.float32)
    return out


# ---------------------------------------------------------------- Z-Image


def zimage_weights(
    seed: int,
    *,
    dim: int = 256,
    n_layers: int = 2,
    n_refiner_layers: int = 2,
    cap_feat_dim: int = 64,
    in_channels: int = 16,
    patch: int = 2,
) -> dict[str, np.ndarray]:
    """A tiny Z-Image (ComfyUI's NextDiT, Z-Image config) as float32 arrays keyed like a ComfyUI file.

    heads = dim / 128 (RoPE axes 32+48+48), ffn = 256·ceil(int(dim·8/3)/256), modulation from min(dim, 256),
    time MLP hidden min(dim, 1024). Matrices ~ N(0, 1/fan_in), norm scales ~ 1 ± 0.1, biases ~ 0.02;
    the two learned pad tokens ~ N(0, 1), as large as real tokens, so their use shows in the output.
    """
    shapes = zimage_shapes(
        dim=dim,
        n_layers=n_layers,
        n_refiner_layers=n_refiner_layers,
        cap_feat_dim=cap_feat_dim,
        in_channels=in_channels,
        patch=patch,
    )
    return _seeded(shapes, seed)


def zimage_shapes(
    *,
    dim: int = 256,
    n_layers: int = 2,
    n_refiner_layers: int = 2,
    cap_feat_dim: int = 64,
    in_channels: int = 16,
    patch: int = 2,
) -> dict[str, tuple[int, ...]]:
    """{ComfyUI diffusion-model key: shape} of a Z-Image (zimage_weights says how its sizes follow from dim)."""
    if dim % 128:
        raise ValueError(f"Z-Image dim must be a multiple of 128 (heads of 128), got {dim}")
    head, mod, t_hidden = 128, min(dim, 256), min(dim, 1024)
    ffn = 256 * -(-int(dim * 8.0 / 3.0) // 256)
    patch_features = patch * patch * in_channels
    shapes: dict[str, tuple[int, ...]] = {
        "x_embedder.weight": (dim, patch_features),
        "x_embedder.bias": (dim,),
        "x_pad_token": (1, dim),
        "cap_pad_token": (1, dim),
        "cap_embedder.0.weight": (cap_feat_dim,),
        "cap_embedder.1.weight": (dim, cap_feat_dim),
        "cap_embedder.1.bias": (dim,),
        "t_embedder.mlp.0.weight": (t_hidden, 256),
        "t_embedder.mlp.0.bias": (t_hidden,),
        "t_embedder.mlp.2.weight": (mod, t_hidden),
        "t_embedder.mlp.2.bias": (mod,),
        "final_layer.linear.weight": (patch_features, dim),
        "final_layer.linear.bias": (patch_features,),
        "final_layer.adaLN_modulation.1.weight": (dim, mod),
        "final_layer.adaLN_modulation.1.bias": (dim,),
    }
    blocks = [(f"layers.{n}.", True) for n in range(n_layers)]
    blocks += [(f"noise_refiner.{n}.", True) for n in range(n_refiner_layers)]
    blocks += [(f"context_refiner.{n}.", False) for n in range(n_refiner_layers)]
    for prefix, modulated in blocks:
        shapes[prefix + "attention.qkv.weight"] = (3 * dim, dim)
        shapes[prefix + "attention.out.weight"] = (dim, dim)
        shapes[prefix + "attention.q_norm.weight"] = (head,)
        shapes[prefix + "attention.k_norm.weight"] = (head,)
        shapes[prefix + "feed_forward.w1.weight"] = (ffn, dim)
        shapes[prefix + "feed_forward.w2.weight"] = (dim, ffn)
        shapes[prefix + "feed_forward.w3.weight"] = (ffn, dim)
        for norm in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"):
            shapes[prefix + norm + ".weight"] = (dim,)
        if modulated:
            shapes[prefix + "adaLN_modulation.0.weight"] = (4 * dim, mod)
            shapes[prefix + "adaLN_modulation.0.bias"] = (4 * dim,)
    return shapes
