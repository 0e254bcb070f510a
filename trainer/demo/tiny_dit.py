"""A tiny Flux2-shaped DiT in PyTorch for the demo and the tests.

Module names and call convention follow ComfyUI's Flux (comfy/ldm/flux):
double_blocks.N.{img,txt}_attn.{qkv,proj}, {img,txt}_mlp.{0,2}, {img,txt}_mod.lin,
single_blocks.N.{linear1,linear2,modulation.lin}, img_in, txt_in,
time_in.{in,out}_layer, final_layer.{linear,adaLN_modulation.1};
model(x [B,C,H,W], timestep [B], context [B,T,D]) -> velocity [B,C,H,W].
It is our own small model (sin-cos positions instead of RoPE), not ComfyUI's.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


def timestep_embedding(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """[B] in [0,1] → [B,dim] sinusoidal features of 1000·t (Flux's time_factor)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = 1000.0 * t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def positions_2d(height: int, width: int, dim: int, device) -> torch.Tensor:
    """[H·W, dim] fixed sin-cos positions, half the features for rows, half for columns."""
    quarter = dim // 4
    freqs = torch.exp(-math.log(100.0) * torch.arange(quarter, device=device, dtype=torch.float32) / quarter)
    rows = torch.arange(height, device=device, dtype=torch.float32)[:, None] * freqs[None]
    cols = torch.arange(width, device=device, dtype=torch.float32)[:, None] * freqs[None]
    row_feat = torch.cat([rows.sin(), rows.cos()], -1)[:, None, :].expand(height, width, 2 * quarter)
    col_feat = torch.cat([cols.sin(), cols.cos()], -1)[None, :, :].expand(height, width, 2 * quarter)
    return torch.cat([row_feat, col_feat], -1).reshape(height * width, 4 * quarter)


class Modulation(nn.Module):
    def __init__(self, hidden: int, chunks: int):
        super().__init__()
        self.chunks = chunks
        self.lin = nn.Linear(hidden, chunks * hidden)

    def forward(self, vec: torch.Tensor) -> list[torch.Tensor]:
        return self.lin(F.silu(vec))[:, None, :].chunk(self.chunks, dim=-1)  # each [B,1,h]


class Attention(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)


def attention(q, k, v, heads: int) -> torch.Tensor:
    """[B,T,h] each → [B,T,h] multi-head SDPA."""
    batch, tokens, hidden = q.shape
    split = lambda t: t.view(batch, tokens, heads, hidden // heads).transpose(1, 2)  # noqa: E731
    out = F.scaled_dot_product_attention(split(q), split(k), split(v))
    return out.transpose(1, 2).reshape(batch, tokens, hidden)


def mlp(hidden: int, inner: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(hidden, inner), nn.GELU(approximate="tanh"), nn.Linear(inner, hidden))


class DoubleBlock(nn.Module):
    """Separate weights for image and text streams, joint attention over both."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.heads = heads
        inner = int(hidden * mlp_ratio)
        self.img_mod, self.txt_mod = Modulation(hidden, 6), Modulation(hidden, 6)
        self.img_attn, self.txt_attn = Attention(hidden), Attention(hidden)
        self.img_mlp, self.txt_mlp = mlp(hidden, inner), mlp(hidden, inner)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor):
        img_mod, txt_mod = self.img_mod(vec), self.txt_mod(vec)
        img_qkv = self.img_attn.qkv(F.layer_norm(img, img.shape[-1:]) * (1 + img_mod[1]) + img_mod[0])
        txt_qkv = self.txt_attn.qkv(F.layer_norm(txt, txt.shape[-1:]) * (1 + txt_mod[1]) + txt_mod[0])
        q, k, v = torch.cat([txt_qkv, img_qkv], dim=1).chunk(3, dim=-1)
        joint = attention(q, k, v, self.heads)
        txt_out, img_out = joint[:, : txt.shape[1]], joint[:, txt.shape[1] :]
        img = img + img_mod[2] * self.img_attn.proj(img_out)
        img = img + img_mod[5] * self.img_mlp(F.layer_norm(img, img.shape[-1:]) * (1 + img_mod[4]) + img_mod[3])
        txt = txt + txt_mod[2] * self.txt_attn.proj(txt_out)
        txt = txt + txt_mod[5] * self.txt_mlp(F.layer_norm(txt, txt.shape[-1:]) * (1 + txt_mod[4]) + txt_mod[3])
        return img, txt


class SingleBlock(nn.Module):
    """One stream; qkv and the MLP input fused in linear1, attention and MLP outputs fused in linear2."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.heads, self.hidden, self.inner = heads, hidden, int(hidden * mlp_ratio)
        self.modulation = Modulation(hidden, 3)
        self.linear1 = nn.Linear(hidden, 3 * hidden + self.inner)
        self.linear2 = nn.Linear(hidden + self.inner, hidden)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.modulation(vec)
        qkv, hidden = self.linear1(F.layer_norm(x, x.shape[-1:]) * (1 + scale) + shift).split(
            [3 * self.hidden, self.inner], dim=-1
        )
        attn = attention(*qkv.chunk(3, dim=-1), self.heads)
        return x + gate * self.linear2(torch.cat([attn, F.gelu(hidden, approximate="tanh")], dim=-1))


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, hidden: int):
        super().__init__()
        self.in_layer, self.out_layer = nn.Linear(in_dim, hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.out_layer(F.silu(self.in_layer(x)))


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int):
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.linear = nn.Linear(hidden, out_channels)

    def forward(self, x, vec):
        shift, scale = self.adaLN_modulation(vec)[:, None, :].chunk(2, dim=-1)
        return self.linear(F.layer_norm(x, x.shape[-1:]) * (1 + scale) + shift)


class TinyFlux(nn.Module):
    def __init__(
        self,
        in_channels: int = 16,
        context_dim: int = 32,
        hidden: int = 96,
        heads: int = 4,
        double_blocks: int = 2,
        single_blocks: int = 2,
        mlp_ratio: float = 2.0,
    ):
        super().__init__()
        self.in_channels = in_channels
        self.img_in = nn.Linear(in_channels, hidden)
        self.txt_in = nn.Linear(context_dim, hidden)
        self.time_in = MLPEmbedder(256, hidden)
        self.double_blocks = nn.ModuleList(DoubleBlock(hidden, heads, mlp_ratio) for _ in range(double_blocks))
        self.single_blocks = nn.ModuleList(SingleBlock(hidden, heads, mlp_ratio) for _ in range(single_blocks))
        self.final_layer = FinalLayer(hidden, in_channels)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, **unused) -> torch.Tensor:
        batch, channels, height, width = x.shape
        img = self.img_in(x.flatten(2).transpose(1, 2))  # [B,H·W,h]
        img = img + positions_2d(height, width, img.shape[-1], x.device).to(img.dtype)
        txt = self.txt_in(context)  # [B,T,h]
        vec = self.time_in(timestep_embedding(timestep).to(img.dtype))  # [B,h]
        for block in self.double_blocks:
            img, txt = block(img, txt, vec)
        joint = torch.cat([txt, img], dim=1)
        for block in self.single_blocks:
            joint = block(joint, vec)
        out = self.final_layer(joint[:, txt.shape[1] :], vec)  # [B,H·W,C]
        return out.transpose(1, 2).reshape(batch, channels, height, width)


def build_tiny_flux(seed: int = 0, **sizes) -> TinyFlux:
    """The same weights for the same seed, without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyFlux(**sizes)
