"""Flux2 (Klein 4B/9B, Dev) in MLX, an own port of ComfyUI's comfy/ldm/flux (model.py, layers.py, math.py).

Attribute paths equal ComfyUI's module paths (`double_blocks.0.img_attn.qkv`, `single_blocks.3.linear1`,
`img_mlp.0`, `final_layer.adaLN_modulation.1`, ...), so a ComfyUI state dict loads key for key and a
LoRA saved from here carries the same keys as one from the PyTorch backend. Flux2 has no biases.

    model(x [B,128,H,W], timestep [B] (sigma in [0,1]), context [B,T,ctx], guidance [B] | None,
          reference_latents [[B,128,h_i,w_i], ...] | None)
        -> velocity [B,128,H,W], as ComfyUI's Flux.forward returns it

One token per latent pixel (patch 1). Context arrives already padded (the arch's collate pads to 512).
Reference latents (edit training; ComfyUI's ReferenceLatent → `ref_latents`) are patchified as the image
and appended after its tokens, reference i at RoPE index 10·i (Flux2's default_ref_method "index",
ref_index_scale 10 in comfy/model_detection.py); only the target's tokens leave the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np
from mlx import nn

AXES_DIM = (32, 32, 32, 32)  # RoPE axes: (reference index, row, column, text token); sum = head dim
THETA = 2000
HEAD_DIM = sum(AXES_DIM)
TIME_DIM = 256  # sinusoidal features of timestep and guidance
TIME_FACTOR = 1000.0  # both are multiplied by 1000 before the sinusoids (BFL's timestep_embedding)
LAYER_NORM_EPS = 1e-6
# ComfyUI's QK RMSNorm is torch.nn.RMSNorm(eps=None): torch then uses float32's epsilon, also for bf16 input.
RMS_NORM_EPS = float(np.finfo(np.float32).eps)
ARCHS = ("flux2_klein", "flux2_dev")
REF_INDEX_SCALE = 10.0  # reference i (from 1) sits at RoPE index i·10 (ComfyUI's method "index")


@dataclass(frozen=True)
class Flux2Config:
    in_channels: int
    out_channels: int
    hidden: int
    context_dim: int
    mlp_hidden: int  # int(hidden * mlp_ratio); ComfyUI's detection fixes the ratio at 3.0
    depth: int  # double blocks
    depth_single: int
    guidance_embed: bool  # Dev: a guidance_in embedder

    @property
    def num_heads(self) -> int:
        return self.hidden // HEAD_DIM


def config_from_weights(weights) -> Flux2Config:
    """Sizes from the shapes, as comfy/model_detection.py reads a Flux2 file."""
    if "double_stream_modulation_img.lin.weight" not in weights or "img_in.weight" not in weights:
        raise ValueError(
            "not a Flux2 diffusion model: no double_stream_modulation_img.lin.weight/img_in.weight "
            "(expected ComfyUI key names without a 'model.diffusion_model.' prefix)"
        )
    hidden, in_channels = weights["img_in.weight"].shape
    if hidden % HEAD_DIM:
        raise ValueError(f"Flux2 hidden size {hidden} is not a multiple of the head dim {HEAD_DIM}")
    depth, depth_single = _count(weights, "double_blocks."), _count(weights, "single_blocks.")
    if depth:
        mlp_hidden = weights["double_blocks.0.img_mlp.0.weight"].shape[0] // 2
    elif depth_single:
        mlp_hidden = weights["single_blocks.0.linear2.weight"].shape[1] - hidden
    else:
        mlp_hidden = int(hidden * 3.0)
    return Flux2Config(
        in_channels=in_channels,
        out_channels=weights["final_layer.linear.weight"].shape[0],
        hidden=hidden,
        context_dim=weights["txt_in.weight"].shape[1],
        mlp_hidden=mlp_hidden,
        depth=depth,
        depth_single=depth_single,
        guidance_embed="guidance_in.in_layer.weight" in weights,
    )


def _count(weights, prefix: str) -> int:
    indices = {int(k[len(prefix) :].split(".", 1)[0]) for k in weights if k.startswith(prefix)}
    return max(indices) + 1 if indices else 0


# ---------------------------------------------------------------- positions and embeddings


@lru_cache(maxsize=64)
def rope_tables(grids: tuple[tuple[int, int, float], ...], text_tokens: int) -> tuple[mx.array, mx.array]:
    """cos, sin [1,1,T+Σh*w,64] (float32) for the text tokens followed by each grid's tokens.

    grids: (height, width, index) of the image (index 0), then of each reference latent. ComfyUI's ids:
    text token t at (0, 0, 0, t); pixel (r, c) of a grid at (index, r, c, 0). Per axis of 32 dims the 16
    frequencies are theta^-(2i/32); angles and their cos/sin are computed in float64 (torch.einsum
    promotes against the float64 omega) and rounded to float32.
    """
    ids = [np.zeros((text_tokens, len(AXES_DIM)), np.float64)]
    ids[0][:, 3] = np.arange(text_tokens)
    for height, width, index in grids:
        grid = np.zeros((height * width, len(AXES_DIM)), np.float64)
        rows, cols = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
        grid[:, 0], grid[:, 1], grid[:, 2] = index, rows.reshape(-1), cols.reshape(-1)
        ids.append(grid)
    ids = np.concatenate(ids)
    angles = []
    for axis, dim in enumerate(AXES_DIM):
        omega = 1.0 / THETA ** np.linspace(0.0, (dim - 2) / dim, dim // 2, dtype=np.float64)
        angles.append(ids[:, axis : axis + 1] * omega[None])
    angle = np.concatenate(angles, axis=-1)[None, None]  # (1, 1, L, 64)
    return mx.array(np.cos(angle).astype(np.float32)), mx.array(np.sin(angle).astype(np.float32))


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate consecutive pairs (x[2i], x[2i+1]) by the angle of frequency i, in float32. x: (B, H, L, D)."""
    pairs = x.astype(mx.float32).reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = mx.stack([cos * even - sin * odd, sin * even + cos * odd], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def timestep_embedding(t: mx.array, dim: int = TIME_DIM, max_period: float = 10000.0) -> mx.array:
    """[B] → [B,dim] float32: cos then sin of 1000·t times max_period^(-i/half)."""
    half = dim // 2
    freqs = mx.exp(-math.log(max_period) * mx.arange(half, dtype=mx.float32) / half)
    args = (TIME_FACTOR * t.astype(mx.float32))[:, None] * freqs[None]
    return mx.concatenate([mx.cos(args), mx.sin(args)], axis=-1)


def modulate(x: mx.array, shift: mx.array, scale: mx.array) -> mx.array:
    return x * (1 + scale) + shift


def attention(q: mx.array, k: mx.array, v: mx.array, rope: tuple[mx.array, mx.array]) -> mx.array:
    """(B, H, L, D) each → (B, L, H*D); RoPE on q and k first."""
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5)
    batch, heads, length, head_dim = out.shape
    return out.transpose(0, 2, 1, 3).reshape(batch, length, heads * head_dim)


def split_heads(qkv: mx.array, heads: int) -> tuple[mx.array, mx.array, mx.array]:
    """(B, L, 3*H*D) → q, k, v each (B, H, L, D)."""
    batch, length, _ = qkv.shape
    qkv = qkv.reshape(batch, length, 3, heads, -1).transpose(2, 0, 3, 1, 4)
    return qkv[0], qkv[1], qkv[2]


# ---------------------------------------------------------------- layers (ComfyUI's names)


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, hidden: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden, bias=False)
        self.out_layer = nn.Linear(hidden, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.out_layer(nn.silu(self.in_layer(x)))


class SiLUActivation(nn.Module):
    """Gated MLP activation: silu(first half) * second half."""

    def __call__(self, x: mx.array) -> mx.array:
        gate, value = mx.split(x, 2, axis=-1)
        return nn.silu(gate) * value


class QKNorm(nn.Module):
    def __init__(self, head_dim: int):
        super().__init__()
        self.query_norm = nn.RMSNorm(head_dim, eps=RMS_NORM_EPS)
        self.key_norm = nn.RMSNorm(head_dim, eps=RMS_NORM_EPS)

    def __call__(self, q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        return self.query_norm(q).astype(v.dtype), self.key_norm(k).astype(v.dtype)


class SelfAttention(nn.Module):
    """Holds the layers only; the blocks run the attention over both streams."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.norm = QKNorm(hidden // heads)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def qkv_heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = split_heads(self.qkv(x), self.heads)
        q, k = self.norm(q, k, v)
        return q, k, v


class Modulation(nn.Module):
    """vec [B,hidden] → (shift, scale, gate) [B,1,hidden] once (single) or twice (double)."""

    def __init__(self, hidden: int, double: bool):
        super().__init__()
        self.count = 6 if double else 3
        self.lin = nn.Linear(hidden, self.count * hidden, bias=False)

    def __call__(self, vec: mx.array) -> tuple[tuple[mx.array, ...], ...]:
        out = mx.split(self.lin(nn.silu(vec[:, None, :])), self.count, axis=-1)
        return tuple(tuple(out[i : i + 3]) for i in range(0, self.count, 3))


def gated_mlp(hidden: int, mlp_hidden: int) -> list[nn.Module]:
    """ComfyUI's nn.Sequential(Linear, SiLUActivation, Linear) as a list: paths `.0` and `.2`."""
    return [nn.Linear(hidden, 2 * mlp_hidden, bias=False), SiLUActivation(), nn.Linear(mlp_hidden, hidden, bias=False)]


def run_mlp(layers: list[nn.Module], x: mx.array) -> mx.array:
    for layer in layers:
        x = layer(x)
    return x


class DoubleStreamBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp_hidden: int):
        super().__init__()
        for stream in ("img", "txt"):
            setattr(self, f"{stream}_norm1", nn.LayerNorm(hidden, eps=LAYER_NORM_EPS, affine=False))
            setattr(self, f"{stream}_attn", SelfAttention(hidden, heads))
            setattr(self, f"{stream}_norm2", nn.LayerNorm(hidden, eps=LAYER_NORM_EPS, affine=False))
            setattr(self, f"{stream}_mlp", gated_mlp(hidden, mlp_hidden))

    def __call__(self, img: mx.array, txt: mx.array, img_mods, txt_mods, rope) -> tuple[mx.array, mx.array]:
        (img_shift1, img_scale1, img_gate1), (img_shift2, img_scale2, img_gate2) = img_mods
        (txt_shift1, txt_scale1, txt_gate1), (txt_shift2, txt_scale2, txt_gate2) = txt_mods
        img_q, img_k, img_v = self.img_attn.qkv_heads(modulate(self.img_norm1(img), img_shift1, img_scale1))
        txt_q, txt_k, txt_v = self.txt_attn.qkv_heads(modulate(self.txt_norm1(txt), txt_shift1, txt_scale1))
        # joint attention over text tokens first, then image tokens (the RoPE tables follow that order)
        out = attention(
            mx.concatenate([txt_q, img_q], axis=2),
            mx.concatenate([txt_k, img_k], axis=2),
            mx.concatenate([txt_v, img_v], axis=2),
            rope,
        )
        text_tokens = txt.shape[1]
        txt_out, img_out = out[:, :text_tokens], out[:, text_tokens:]

        img = img + img_gate1 * self.img_attn.proj(img_out)
        img = img + img_gate2 * run_mlp(self.img_mlp, modulate(self.img_norm2(img), img_shift2, img_scale2))
        txt = txt + txt_gate1 * self.txt_attn.proj(txt_out)
        txt = txt + txt_gate2 * run_mlp(self.txt_mlp, modulate(self.txt_norm2(txt), txt_shift2, txt_scale2))
        return img, txt


class SingleStreamBlock(nn.Module):
    """Parallel attention + gated MLP on the joined (text, image) sequence, fused in linear1/linear2."""

    def __init__(self, hidden: int, heads: int, mlp_hidden: int):
        super().__init__()
        self.hidden, self.heads = hidden, heads
        self.linear1 = nn.Linear(hidden, 3 * hidden + 2 * mlp_hidden, bias=False)
        self.linear2 = nn.Linear(hidden + mlp_hidden, hidden, bias=False)
        self.norm = QKNorm(hidden // heads)
        self.pre_norm = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS, affine=False)
        self.mlp_act = SiLUActivation()

    def __call__(self, x: mx.array, mods, rope) -> mx.array:
        ((shift, scale, gate),) = mods
        fused = self.linear1(modulate(self.pre_norm(x), shift, scale))
        qkv, mlp = fused[..., : 3 * self.hidden], fused[..., 3 * self.hidden :]
        q, k, v = split_heads(qkv, self.heads)
        q, k = self.norm(q, k, v)
        out = self.linear2(mx.concatenate([attention(q, k, v, rope), self.mlp_act(mlp)], axis=-1))
        return x + gate * out


class LastLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS, affine=False)
        self.linear = nn.Linear(hidden, out_channels, bias=False)
        self.adaLN_modulation = [nn.SiLU(), nn.Linear(hidden, 2 * hidden, bias=False)]

    def __call__(self, x: mx.array, vec: mx.array) -> mx.array:
        shift, scale = mx.split(run_mlp(self.adaLN_modulation, vec[:, None, :]), 2, axis=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


# ---------------------------------------------------------------- the model


class Flux2(nn.Module):
    def __init__(self, config: Flux2Config, dtype: mx.Dtype = mx.bfloat16):
        super().__init__()
        self.config, self.dtype = config, dtype
        hidden, heads, mlp_hidden = config.hidden, config.num_heads, config.mlp_hidden
        self.img_in = nn.Linear(config.in_channels, hidden, bias=False)
        self.time_in = MLPEmbedder(TIME_DIM, hidden)
        if config.guidance_embed:
            self.guidance_in = MLPEmbedder(TIME_DIM, hidden)
        self.txt_in = nn.Linear(config.context_dim, hidden, bias=False)
        self.double_blocks = [DoubleStreamBlock(hidden, heads, mlp_hidden) for _ in range(config.depth)]
        self.single_blocks = [SingleStreamBlock(hidden, heads, mlp_hidden) for _ in range(config.depth_single)]
        self.final_layer = LastLayer(hidden, config.out_channels)
        self.double_stream_modulation_img = Modulation(hidden, double=True)
        self.double_stream_modulation_txt = Modulation(hidden, double=True)
        self.single_stream_modulation = Modulation(hidden, double=False)

    def __call__(self, x, timestep, context, guidance=None, reference_latents=None) -> mx.array:
        dtype = self.dtype
        x, context = _as_mx(x).astype(dtype), _as_mx(context).astype(dtype)
        batch, _, height, width = x.shape
        references = [_as_mx(r).astype(dtype) for r in reference_latents or ()]
        # (B, H*W + Σ h_i*w_i, C): the target's tokens, then each reference's (ComfyUI's process_img)
        img = self.img_in(mx.concatenate([_tokens(x), *(_tokens(r, batch) for r in references)], axis=1))
        vec = self.time_in(timestep_embedding(_as_mx(timestep)).astype(dtype))
        if self.config.guidance_embed and guidance is not None:  # ComfyUI skips it when no guidance is given
            vec = vec + self.guidance_in(timestep_embedding(_as_mx(guidance)).astype(dtype))
        txt = self.txt_in(context)
        text_tokens = txt.shape[1]
        grids = ((height, width, 0.0),) + tuple(
            (r.shape[2], r.shape[3], REF_INDEX_SCALE * (i + 1)) for i, r in enumerate(references)
        )
        rope = rope_tables(grids, text_tokens)

        img_mods, txt_mods = self.double_stream_modulation_img(vec), self.double_stream_modulation_txt(vec)
        for block in self.double_blocks:
            img, txt = block(img, txt, img_mods, txt_mods, rope)
        joined = mx.concatenate([txt, img], axis=1)
        single_mods = self.single_stream_modulation(vec)
        for block in self.single_blocks:
            joined = block(joined, single_mods, rope)
        # The target's tokens only (ComfyUI's out[:, :img_tokens]; the final layer is per token, so slicing
        # first gives the same numbers without running it on the references).
        out = self.final_layer(joined[:, text_tokens : text_tokens + height * width], vec)  # (B, H*W, 128)
        return out.transpose(0, 2, 1).reshape(batch, -1, height, width)


def _tokens(latent: mx.array, batch: int | None = None) -> mx.array:
    """[B,C,H,W] → [B,H*W,C], one token per latent pixel; a reference of batch 1 serves every row
    (ComfyUI's CONDList repeats a cond to the batch)."""
    if batch is not None and latent.shape[0] != batch:
        if latent.shape[0] != 1:
            raise ValueError(
                f"Flux2: a reference latent of batch {latent.shape[0]} for a batch of {batch}; "
                "give one reference per row, or one for all"
            )
        latent = mx.broadcast_to(latent, (batch, *latent.shape[1:]))
    rows, channels, height, width = latent.shape
    return latent.reshape(rows, channels, height * width).transpose(0, 2, 1)


def build(arch_name: str, weights, dtype="bfloat16") -> Flux2:
    """A Flux2 from ComfyUI-named weights (numpy or mx arrays, no prefix), in `dtype` ("bfloat16", "float32")."""
    if arch_name not in ARCHS:
        raise ValueError(f"flux2.build: unknown arch {arch_name!r}; known: {', '.join(ARCHS)}")
    dtype = getattr(mx, dtype) if isinstance(dtype, str) else dtype
    # BFL's own files name the QK norm weights `.scale`; ComfyUI renames them to `.weight` on load
    weights = {(k[: -len(".scale")] + ".weight" if k.endswith("_norm.scale") else k): v for k, v in weights.items()}
    config = config_from_weights(weights)
    if config.guidance_embed != (arch_name == "flux2_dev"):
        has = "has" if config.guidance_embed else "has no"
        fix = "flux2_dev" if config.guidance_embed else "flux2_klein"
        raise ValueError(f"{arch_name}: these weights {has} a guidance embedding (guidance_in); use arch {fix!r}")
    model = Flux2(config, dtype)
    expected = {k for k, _ in _flat_parameters(model)}
    missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"{arch_name}: weights do not match a Flux2 of {config}: missing {missing[:5]} "
            f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})"
        )
    model.load_weights([(k, _as_mx(weights[k]).astype(dtype)) for k in sorted(expected)], strict=True)
    mx.eval(model.parameters())
    return model


def _as_mx(value) -> mx.array:
    return value if isinstance(value, mx.array) else mx.array(np.asarray(value))


def _flat_parameters(model: nn.Module):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())
