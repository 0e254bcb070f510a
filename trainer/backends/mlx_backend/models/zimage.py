"""Z-Image (Turbo and base) in MLX: our port of ComfyUI's NextDiT with the Z-Image config.

Module and parameter paths are ComfyUI's (comfy/ldm/lumina/model.py), so a ComfyUI
state dict loads as it is and LoRA targets resolve at the same dotted paths:
`layers.N.attention.{qkv,out}`, `layers.N.feed_forward.{w1,w2,w3}`,
`layers.N.adaLN_modulation.0`, `noise_refiner.N.*`, `context_refiner.N.*`,
`x_embedder`, `cap_embedder.{0,1}`, `t_embedder.mlp.{0,2}`,
`final_layer.{linear,adaLN_modulation.1}`, `x_pad_token`, `cap_pad_token`.

    model(x [B,16,H,W], timesteps [B] = sigma, context [B,T,cap_dim], num_tokens) -> [B,16,H,W]

What ComfyUI does and this port repeats: the model embeds t = 1 − sigma (×1000)
and returns −output (so the flow velocity convention holds); captions and image
tokens are each padded to a multiple of 32 with a learned pad token and every
token attends to every other one (no mask: num_tokens and attention_mask are
ignored by ComfyUI, and so here); RoPE over 3 axes (32, 48, 48), theta 256:
caption token i sits at (i + 1, 0, 0), image token (r, c) at (Lc + 1, r, c)
with Lc the padded caption length, image pad tokens at (0, 0, 0).
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten

ARCH_NAMES = ("zimage", "zimage_turbo")
AXES_DIMS = (32, 48, 48)  # head_dim = 128 = sum(AXES_DIMS): ComfyUI asserts it
ROPE_THETA = 256.0
TIME_SCALE = 1000.0
PAD_TOKENS_MULTIPLE = 32
NORM_EPS = 1e-5
# q_norm / k_norm are torch.nn.RMSNorm(eps=None): torch uses the fp32 machine epsilon (its opmath
# type) for fp32 and bf16 inputs alike.
QK_NORM_EPS = float(np.finfo(np.float32).eps)
FREQ_EMBED_DIM = 256


# ---------------------------------------------------------------- positions


def timestep_embedding(t: mx.array, dim: int = FREQ_EMBED_DIM, max_period: float = 10000.0) -> mx.array:
    """[B] → [B,dim] fp32 [cos | sin] features, as comfy's diffusionmodules.util.timestep_embedding."""
    half = dim // 2
    freqs = mx.array(np.exp(-math.log(max_period) * np.arange(half, dtype=np.float64) / half).astype(np.float32))
    args = t.astype(mx.float32)[:, None] * freqs[None]
    return mx.concatenate([mx.cos(args), mx.sin(args)], axis=-1)


@lru_cache(maxsize=64)
def rope_tables(cap_len: int, rows: int, cols: int, img_len: int) -> tuple[mx.array, mx.array]:
    """(cos, sin) [Lc + img_len, 64] fp32 for a padded caption of cap_len tokens and rows×cols image
    tokens padded to img_len: flux's rope() angles pos·theta^(−2i/d) per axis, computed in float64."""
    positions = np.zeros((cap_len + img_len, 3), np.float64)
    positions[:cap_len, 0] = np.arange(cap_len) + 1.0
    image = slice(cap_len, cap_len + rows * cols)  # the pad tokens after it stay at (0, 0, 0)
    positions[image, 0] = cap_len + 1.0
    positions[image, 1] = np.repeat(np.arange(rows), cols)
    positions[image, 2] = np.tile(np.arange(cols), rows)
    angles = []
    for axis, dim in enumerate(AXES_DIMS):
        omega = 1.0 / ROPE_THETA ** np.linspace(0.0, (dim - 2) / dim, dim // 2, dtype=np.float64)
        angles.append(positions[:, axis : axis + 1] * omega[None])
    angle = np.concatenate(angles, axis=-1)  # [L, 64]
    return mx.array(np.cos(angle).astype(np.float32)), mx.array(np.sin(angle).astype(np.float32))


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x [B,L,H,D] in fp32; back in x's dtype."""
    B, L, H, D = x.shape
    pairs = x.astype(mx.float32).reshape(B, L, H, D // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None], sin[None, :, None]  # [1,L,1,D/2]
    rotated = mx.stack([cos * even - sin * odd, sin * even + cos * odd], axis=-1)
    return rotated.reshape(B, L, H, D).astype(x.dtype)


def pad_tokens(tokens: mx.array, pad_token: mx.array) -> mx.array:
    """[B,L,D] → [B,L',D], L' the next multiple of 32, filled with the learned pad token [1,D]."""
    extra = (-tokens.shape[1]) % PAD_TOKENS_MULTIPLE
    if extra == 0:
        return tokens
    fill = mx.broadcast_to(pad_token.astype(tokens.dtype)[None], (tokens.shape[0], extra, tokens.shape[2]))
    return mx.concatenate([tokens, fill], axis=1)


# ---------------------------------------------------------------- blocks


class JointAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.out = nn.Linear(heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=QK_NORM_EPS)
        self.k_norm = nn.RMSNorm(head_dim, eps=QK_NORM_EPS)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        B, L, _ = x.shape
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = mx.split(self.qkv(x), [q_size, q_size + kv_size], axis=-1)
        q = apply_rope(self.q_norm(q.reshape(B, L, self.heads, self.head_dim)), cos, sin)
        k = apply_rope(self.k_norm(k.reshape(B, L, self.kv_heads, self.head_dim)), cos, sin)
        v = v.reshape(B, L, self.kv_heads, self.head_dim)
        # (B, heads, L, head_dim); fewer kv heads are shared as ComfyUI's repeat does (GQA)
        out = mx.fast.scaled_dot_product_attention(
            q.transpose(0, 2, 1, 3),
            k.transpose(0, 2, 1, 3),
            v.transpose(0, 2, 1, 3),
            scale=1.0 / math.sqrt(self.head_dim),
        )
        return self.out(out.transpose(0, 2, 1, 3).reshape(B, L, q_size))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(nn.silu(self.w1(x)) * self.w3(x))


class JointTransformerBlock(nn.Module):
    """Sandwich-norm block; with modulation: x += tanh(gate)·norm2(f(norm1(x)·(1 + scale)))."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, ffn_dim: int, mod_dim: int | None):
        super().__init__()
        self.attention = JointAttention(dim, heads, kv_heads, head_dim)
        self.feed_forward = FeedForward(dim, ffn_dim)
        self.attention_norm1 = nn.RMSNorm(dim, eps=NORM_EPS)
        self.ffn_norm1 = nn.RMSNorm(dim, eps=NORM_EPS)
        self.attention_norm2 = nn.RMSNorm(dim, eps=NORM_EPS)
        self.ffn_norm2 = nn.RMSNorm(dim, eps=NORM_EPS)
        if mod_dim is not None:  # Z-Image modulation: a bare Linear on the time embedding (no SiLU)
            self.adaLN_modulation = [nn.Linear(mod_dim, 4 * dim)]

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, adaln: mx.array | None = None) -> mx.array:
        if adaln is None:  # context_refiner
            x = x + self.attention_norm2(self.attention(self.attention_norm1(x), cos, sin))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        scale_msa, gate_msa, scale_mlp, gate_mlp = mx.split(self.adaLN_modulation[0](adaln)[:, None], 4, axis=-1)
        attended = self.attention(self.attention_norm1(x) * (1 + scale_msa), cos, sin)
        x = x + mx.tanh(gate_msa) * self.attention_norm2(attended)
        fed = self.feed_forward(self.ffn_norm1(x) * (1 + scale_mlp))
        return x + mx.tanh(gate_mlp) * self.ffn_norm2(fed)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, out: int):
        super().__init__()
        self.mlp = [nn.Linear(FREQ_EMBED_DIM, hidden), nn.SiLU(), nn.Linear(hidden, out)]

    def __call__(self, t: mx.array, dtype: mx.Dtype) -> mx.array:
        h = timestep_embedding(t).astype(dtype)
        for layer in self.mlp:
            h = layer(h)
        return h


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out: int, mod_dim: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, eps=1e-6, affine=False)
        self.linear = nn.Linear(dim, out)
        self.adaLN_modulation = [nn.SiLU(), nn.Linear(mod_dim, dim)]

    def __call__(self, x: mx.array, adaln: mx.array) -> mx.array:
        scale = self.adaLN_modulation[1](self.adaLN_modulation[0](adaln))
        return self.linear(self.norm_final(x) * (1 + scale[:, None]))


# ---------------------------------------------------------------- the model


class ZImage(nn.Module):
    """NextDiT, Z-Image config (patch 2, 16 latent channels, pad tokens to 32, theta 256)."""

    def __init__(
        self,
        *,
        dim: int,
        n_layers: int,
        n_refiner_layers: int,
        heads: int,
        kv_heads: int,
        ffn_dim: int,
        cap_feat_dim: int,
        in_channels: int = 16,
        patch: int = 2,
        t_hidden: int | None = None,
        mod_dim: int | None = None,
        dtype: mx.Dtype = mx.bfloat16,
    ):
        super().__init__()
        head_dim = dim // heads
        t_hidden, mod_dim = t_hidden or min(dim, 1024), mod_dim or min(dim, 256)
        self.patch, self.in_channels, self.dim, self.dtype = patch, in_channels, dim, dtype
        self.checkpoint_blocks = False  # True: recompute each block in the backward (nn.utils.checkpoint)

        def blocks(count: int, modulated: bool) -> list[JointTransformerBlock]:
            return [
                JointTransformerBlock(dim, heads, kv_heads, head_dim, ffn_dim, mod_dim if modulated else None)
                for _ in range(count)
            ]

        self.x_embedder = nn.Linear(patch * patch * in_channels, dim)
        self.noise_refiner = blocks(n_refiner_layers, True)
        self.context_refiner = blocks(n_refiner_layers, False)
        self.t_embedder = TimestepEmbedder(t_hidden, mod_dim)
        self.cap_embedder = [nn.RMSNorm(cap_feat_dim, eps=NORM_EPS), nn.Linear(cap_feat_dim, dim)]
        self.layers = blocks(n_layers, True)
        self.final_layer = FinalLayer(dim, patch * patch * in_channels, mod_dim)
        self.x_pad_token = mx.zeros((1, dim))
        self.cap_pad_token = mx.zeros((1, dim))

    def _block(self, block: JointTransformerBlock):
        return nn.utils.checkpoint(block) if self.checkpoint_blocks else block

    def __call__(self, x, timesteps, context, num_tokens=None, attention_mask=None) -> mx.array:
        """x [B,C,H,W], timesteps = sigma [B], context [B,T,cap_dim] → what NextDiT.forward returns (the flow
        velocity) [B,C,H,W]. attention_mask is ignored, as ComfyUI ignores it. num_tokens: one count, or
        one per row (Kiln's batches): ComfyUI runs each prompt alone and attends to any zero padding,
        so rows with different caption lengths run as separate groups, each trimmed to its length."""
        lengths = _row_lengths(num_tokens)
        if lengths is None or len(set(lengths)) == 1:
            if lengths is not None:
                context = context[:, : lengths[0]]
            return self._forward(x, timesteps, context)
        x, context = mx.array(x), mx.array(context)
        sigma = mx.broadcast_to(mx.array(timesteps).reshape(-1), (x.shape[0],))
        outputs, order = [], []
        for length in sorted(set(lengths)):
            rows = [i for i, n in enumerate(lengths) if n == length]
            index = mx.array(rows)
            outputs.append(self._forward(x[index], sigma[index], context[index, :length]))
            order += rows
        inverse = mx.array(np.argsort(np.asarray(order)))
        return mx.concatenate(outputs, axis=0)[inverse]

    def _forward(self, x, timesteps, context) -> mx.array:
        x = mx.array(x).astype(self.dtype)
        context = mx.array(context).astype(self.dtype)
        sigma = mx.array(timesteps).astype(mx.float32).reshape(-1)
        B, C, H, W = x.shape
        p = self.patch
        if sigma.shape[0] == 1 and B > 1:
            sigma = mx.broadcast_to(sigma, (B,))
        adaln = self.t_embedder((1.0 - sigma) * TIME_SCALE, self.dtype)  # [B, mod_dim]

        # comfy.ldm.common_dit.pad_to_patch_size: circular padding on the bottom/right
        if H % p:
            x = mx.concatenate([x, x[:, :, : p - H % p]], axis=2)
        if W % p:
            x = mx.concatenate([x, x[:, :, :, : p - W % p]], axis=3)
        rows, cols = x.shape[2] // p, x.shape[3] // p
        patches = x.reshape(B, C, rows, p, cols, p).transpose(0, 2, 4, 3, 5, 1).reshape(B, rows * cols, p * p * C)
        img = pad_tokens(self.x_embedder(patches), self.x_pad_token)  # [B, Li, dim]
        cap = context
        for layer in self.cap_embedder:
            cap = layer(cap)
        cap = pad_tokens(cap, self.cap_pad_token)  # [B, Lc, dim]
        cap_len = cap.shape[1]
        cos, sin = rope_tables(cap_len, rows, cols, img.shape[1])

        for block in self.context_refiner:
            cap = self._block(block)(cap, cos[:cap_len], sin[:cap_len])
        for block in self.noise_refiner:
            img = self._block(block)(img, cos[cap_len:], sin[cap_len:], adaln)
        h = mx.concatenate([cap, img], axis=1)
        for block in self.layers:
            h = self._block(block)(h, cos, sin, adaln)

        out = self.final_layer(h[:, cap_len : cap_len + rows * cols], adaln)  # [B, rows·cols, p·p·C]
        out = out.reshape(B, rows, cols, p, p, C).transpose(0, 5, 1, 3, 2, 4).reshape(B, C, rows * p, cols * p)
        return -out[:, :, :H, :W]


def _row_lengths(num_tokens) -> list[int] | None:
    """num_tokens as per-row caption lengths (None: use the whole context). Must be concrete values:
    a compiled step passes them as a constant, so each length pattern is its own graph."""
    if num_tokens is None:
        return None
    if isinstance(num_tokens, (int, np.integer)):
        return [int(num_tokens)]
    return [int(n) for n in np.asarray(num_tokens).reshape(-1).tolist()]


# ---------------------------------------------------------------- build from a state dict


def _count(keys, prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    return len({int(m.group(1)) for key in keys if (m := pattern.match(key))})


def config_from_weights(weights: dict) -> dict:
    """ZImage keyword arguments inferred from tensor shapes, as comfy/model_detection.py reads them."""
    required = (
        "cap_embedder.1.weight",
        "x_embedder.weight",
        "layers.0.attention.qkv.weight",
        "layers.0.attention.q_norm.weight",
        "layers.0.feed_forward.w1.weight",
        "t_embedder.mlp.0.weight",
        "t_embedder.mlp.2.weight",
        "x_pad_token",
    )
    missing = [k for k in required if k not in weights]
    if missing:
        hint = (
            " (strip the 'model.diffusion_model.' prefix)"
            if any(k.endswith("diffusion_model." + missing[0]) for k in weights)
            else ""
        )
        raise ValueError(f"not a ComfyUI Z-Image diffusion model: missing {missing}{hint}")
    dim, cap_feat_dim = weights["cap_embedder.1.weight"].shape
    head_dim = weights["layers.0.attention.q_norm.weight"].shape[0]
    if head_dim != sum(AXES_DIMS) or dim % head_dim:
        raise ValueError(
            f"Z-Image needs heads of {sum(AXES_DIMS)} (RoPE axes {AXES_DIMS}) and dim a multiple "
            f"of it; these weights have head_dim {head_dim}, dim {dim}"
        )
    heads = dim // head_dim
    kv_heads = (weights["layers.0.attention.qkv.weight"].shape[0] // head_dim - heads) // 2
    patch_features = weights["x_embedder.weight"].shape[1]
    patch = 2  # ComfyUI fixes patch 2 for lumina2/Z-Image
    return {
        "dim": dim,
        "n_layers": _count(weights, "layers"),
        "n_refiner_layers": _count(weights, "noise_refiner"),
        "heads": heads,
        "kv_heads": kv_heads,
        "ffn_dim": weights["layers.0.feed_forward.w1.weight"].shape[0],
        "cap_feat_dim": cap_feat_dim,
        "in_channels": patch_features // (patch * patch),
        "patch": patch,
        "t_hidden": weights["t_embedder.mlp.0.weight"].shape[0],
        "mod_dim": weights["t_embedder.mlp.2.weight"].shape[0],
    }


DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def build(arch_name: str, weights: dict, dtype="bfloat16") -> ZImage:
    """ZImage from ComfyUI diffusion-model weights (numpy or mx, no prefix), all cast to dtype."""
    if arch_name not in ARCH_NAMES:
        raise ValueError(f"zimage.build serves {ARCH_NAMES}, got {arch_name!r}")
    mx_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    model = ZImage(**config_from_weights(weights), dtype=mx_dtype)
    # the model's own random init is lazy and never evaluated: every parameter is replaced here
    expected = dict(tree_flatten(model.parameters()))
    unexpected, missing = sorted(set(weights) - set(expected)), sorted(set(expected) - set(weights))
    if unexpected or missing:
        raise ValueError(
            f"Z-Image weights do not match the model: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]} ({len(missing)} / {len(unexpected)} in all)"
        )
    loaded = []
    for name, param in expected.items():
        value = weights[name] if isinstance(weights[name], mx.array) else mx.array(np.asarray(weights[name]))
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)}, the model expects {tuple(param.shape)}")
        loaded.append((name, value.astype(mx_dtype)))
    model.load_weights(loaded)
    mx.eval(model.parameters())
    return model
