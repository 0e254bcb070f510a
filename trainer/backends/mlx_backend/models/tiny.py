"""The demo's tiny Flux2-shaped DiT (trainer/demo/tiny_dit.py) in MLX: same module paths, same math.

Weights load from the torch model's state dict (as numpy), or come from `demo_weights(seed)`,
which reproduces `build_tiny_flux(seed)`'s initialisation bit for bit without torch: torch's CPU
generator is MT19937 seeded like std::mt19937, and nn.Linear draws its weight, then its bias,
from U(−1/√in, 1/√in) in construction order (tests/trainer/backends/mlx_backend/test_backend.py checks it).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

LAYER_NORM_EPS = 1e-5  # torch F.layer_norm's default


def timestep_embedding(t: mx.array, dim: int = 256) -> mx.array:
    """[B] in [0,1] → [B,dim] sinusoidal features of 1000·t."""
    half = dim // 2
    freqs = mx.exp(-math.log(10000.0) * mx.arange(half, dtype=mx.float32) / half)
    args = 1000.0 * t.astype(mx.float32)[:, None] * freqs[None]
    return mx.concatenate([mx.cos(args), mx.sin(args)], axis=-1)


def positions_2d(height: int, width: int, dim: int) -> mx.array:
    """[H·W, dim] fixed sin-cos positions, half the features for rows, half for columns."""
    quarter = dim // 4
    freqs = mx.exp(-math.log(100.0) * mx.arange(quarter, dtype=mx.float32) / quarter)
    rows = mx.arange(height, dtype=mx.float32)[:, None] * freqs[None]
    cols = mx.arange(width, dtype=mx.float32)[:, None] * freqs[None]
    shape = (height, width, 2 * quarter)
    row_feat = mx.broadcast_to(mx.concatenate([mx.sin(rows), mx.cos(rows)], -1)[:, None, :], shape)
    col_feat = mx.broadcast_to(mx.concatenate([mx.sin(cols), mx.cos(cols)], -1)[None, :, :], shape)
    return mx.concatenate([row_feat, col_feat], -1).reshape(height * width, 4 * quarter)


def layer_norm(x: mx.array) -> mx.array:
    return mx.fast.layer_norm(x, None, None, LAYER_NORM_EPS)


def attention(q: mx.array, k: mx.array, v: mx.array, heads: int) -> mx.array:
    """[B,T,h] each → [B,T,h] multi-head SDPA."""
    batch, tokens, hidden = q.shape

    def split(t):
        return t.reshape(batch, tokens, heads, hidden // heads).transpose(0, 2, 1, 3)  # [B,heads,T,d]

    out = mx.fast.scaled_dot_product_attention(split(q), split(k), split(v), scale=(hidden // heads) ** -0.5)
    return out.transpose(0, 2, 1, 3).reshape(batch, tokens, hidden)


class Modulation(nn.Module):
    def __init__(self, hidden: int, chunks: int):
        super().__init__()
        self.chunks = chunks
        self.lin = nn.Linear(hidden, chunks * hidden)

    def __call__(self, vec: mx.array) -> list[mx.array]:
        return mx.split(self.lin(nn.silu(vec))[:, None, :], self.chunks, axis=-1)  # each [B,1,h]


class Attention(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)


def mlp(hidden: int, inner: int) -> list[nn.Module]:
    """A list, not nn.Sequential, so the paths are torch's `img_mlp.0` / `img_mlp.2`."""
    return [nn.Linear(hidden, inner), nn.GELU(approx="tanh"), nn.Linear(inner, hidden)]


def run(layers: list[nn.Module], x: mx.array) -> mx.array:
    for layer in layers:
        x = layer(x)
    return x


class DoubleBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.heads = heads
        inner = int(hidden * mlp_ratio)
        self.img_mod, self.txt_mod = Modulation(hidden, 6), Modulation(hidden, 6)
        self.img_attn, self.txt_attn = Attention(hidden), Attention(hidden)
        self.img_mlp, self.txt_mlp = mlp(hidden, inner), mlp(hidden, inner)

    def __call__(self, img: mx.array, txt: mx.array, vec: mx.array):
        img_mod, txt_mod = self.img_mod(vec), self.txt_mod(vec)
        img_qkv = self.img_attn.qkv(layer_norm(img) * (1 + img_mod[1]) + img_mod[0])
        txt_qkv = self.txt_attn.qkv(layer_norm(txt) * (1 + txt_mod[1]) + txt_mod[0])
        q, k, v = mx.split(mx.concatenate([txt_qkv, img_qkv], axis=1), 3, axis=-1)
        joint = attention(q, k, v, self.heads)
        txt_out, img_out = joint[:, : txt.shape[1]], joint[:, txt.shape[1] :]
        img = img + img_mod[2] * self.img_attn.proj(img_out)
        img = img + img_mod[5] * run(self.img_mlp, layer_norm(img) * (1 + img_mod[4]) + img_mod[3])
        txt = txt + txt_mod[2] * self.txt_attn.proj(txt_out)
        txt = txt + txt_mod[5] * run(self.txt_mlp, layer_norm(txt) * (1 + txt_mod[4]) + txt_mod[3])
        return img, txt


class SingleBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.heads, self.hidden, self.inner = heads, hidden, int(hidden * mlp_ratio)
        self.modulation = Modulation(hidden, 3)
        self.linear1 = nn.Linear(hidden, 3 * hidden + self.inner)
        self.linear2 = nn.Linear(hidden + self.inner, hidden)

    def __call__(self, x: mx.array, vec: mx.array) -> mx.array:
        shift, scale, gate = self.modulation(vec)
        qkv, hidden = mx.split(self.linear1(layer_norm(x) * (1 + scale) + shift), [3 * self.hidden], axis=-1)
        attn = attention(*mx.split(qkv, 3, axis=-1), self.heads)
        return x + gate * self.linear2(mx.concatenate([attn, nn.gelu_approx(hidden)], axis=-1))


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, hidden: int):
        super().__init__()
        self.in_layer, self.out_layer = nn.Linear(in_dim, hidden), nn.Linear(hidden, hidden)

    def __call__(self, x):
        return self.out_layer(nn.silu(self.in_layer(x)))


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int):
        super().__init__()
        self.adaLN_modulation = [nn.SiLU(), nn.Linear(hidden, 2 * hidden)]
        self.linear = nn.Linear(hidden, out_channels)

    def __call__(self, x, vec):
        shift, scale = mx.split(run(self.adaLN_modulation, vec)[:, None, :], 2, axis=-1)
        return self.linear(layer_norm(x) * (1 + scale) + shift)


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
        self.double_blocks = [DoubleBlock(hidden, heads, mlp_ratio) for _ in range(double_blocks)]
        self.single_blocks = [SingleBlock(hidden, heads, mlp_ratio) for _ in range(single_blocks)]
        self.final_layer = FinalLayer(hidden, in_channels)

    def __call__(self, x: mx.array, timestep: mx.array, context: mx.array, **unused) -> mx.array:
        batch, channels, height, width = x.shape
        img = self.img_in(x.reshape(batch, channels, height * width).transpose(0, 2, 1))  # [B,H·W,h]
        img = img + positions_2d(height, width, img.shape[-1]).astype(img.dtype)
        txt = self.txt_in(context)  # [B,T,h]
        vec = self.time_in(timestep_embedding(timestep).astype(img.dtype))  # [B,h]
        for block in self.double_blocks:
            img, txt = block(img, txt, vec)
        joint = mx.concatenate([txt, img], axis=1)
        for block in self.single_blocks:
            joint = block(joint, vec)
        out = self.final_layer(joint[:, txt.shape[1] :], vec)  # [B,H·W,C]
        return out.transpose(0, 2, 1).reshape(batch, channels, height, width)


def _dtype(dtype) -> mx.Dtype:
    aliases = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    return getattr(mx, aliases.get(dtype, dtype)) if isinstance(dtype, str) else dtype


def _count(weights, prefix: str) -> int:
    return len({key.split(".")[1] for key in weights if key.startswith(prefix + ".")})


def build(arch_name: str, weights, dtype="float32", heads: int = 4) -> TinyFlux:
    """The tiny DiT from torch-named weights (numpy or mx); sizes read from the weights, `heads` given."""
    if arch_name != "demo":
        raise ValueError(f"tiny.build: only arch 'demo' is the tiny DiT, got {arch_name!r}")
    dtype = _dtype(dtype)
    hidden, in_channels = weights["img_in.weight"].shape
    model = TinyFlux(
        in_channels=in_channels,
        context_dim=weights["txt_in.weight"].shape[1],
        hidden=hidden,
        heads=heads,
        double_blocks=_count(weights, "double_blocks"),
        single_blocks=_count(weights, "single_blocks"),
        mlp_ratio=weights["double_blocks.0.img_mlp.0.weight"].shape[0] / hidden,
    )
    model.load_weights([(k, mx.array(np.asarray(v)).astype(dtype)) for k, v in weights.items()], strict=True)
    mx.eval(model.parameters())
    return model


# --- torch's initialisation of build_tiny_flux(seed), in numpy --------------------------------


def _torch_generator(seed: int) -> np.random.MT19937:
    """numpy's MT19937 in the state torch.manual_seed(seed) puts torch's CPU generator in."""
    key = np.empty(624, dtype=np.uint32)
    value = seed & 0xFFFFFFFF
    key[0] = value
    for index in range(1, 624):
        value = (1812433253 * (value ^ (value >> 30)) + index) & 0xFFFFFFFF
        key[index] = value
    generator = np.random.MT19937()
    generator.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": 624}}
    return generator


def _uniform(generator: np.random.MT19937, shape: tuple[int, ...], bound: float) -> np.ndarray:
    """tensor.uniform_(-bound, bound) on CPU float32: 24 random bits per value, affine map in double."""
    low, high = np.float32(-bound), np.float32(bound)
    bits = generator.random_raw(int(np.prod(shape))) & 0xFFFFFF
    unit = bits.astype(np.float64) * 2.0**-24
    return (unit * np.float64(high - low) + np.float64(low)).astype(np.float32).reshape(shape)


def _linear_shapes(model: TinyFlux) -> list[tuple[str, tuple[int, int]]]:
    """(path, [out,in]) of every Linear in torch's construction order (= the port's attribute order)."""
    from mlx.utils import tree_flatten

    return [
        (name[: -len(".weight")], value.shape)
        for name, value in tree_flatten(model.parameters())
        if name.endswith(".weight")
    ]


def demo_weights(seed: int = 0, **sizes) -> dict[str, np.ndarray]:
    """Exactly `build_tiny_flux(seed, **sizes).state_dict()` as float32 numpy, without torch."""
    generator = _torch_generator(seed)
    weights = {}
    for path, (out_features, in_features) in _linear_shapes(TinyFlux(**sizes)):
        # nn.Linear.reset_parameters: kaiming_uniform_(a=√5), then the bias, both bound 1/√in.
        gain = math.sqrt(2.0 / (1 + math.sqrt(5) ** 2))
        weights[f"{path}.weight"] = _uniform(
            generator, (out_features, in_features), math.sqrt(3.0) * (gain / math.sqrt(in_features))
        )
        weights[f"{path}.bias"] = _uniform(generator, (out_features,), 1 / math.sqrt(in_features))
    return weights


def demo_model(seed: int = 0, dtype="float32", **sizes) -> TinyFlux:
    """The MLX twin of trainer.demo.tiny_dit.build_tiny_flux(seed, **sizes): same weights, no torch needed."""
    return build("demo", demo_weights(seed, **sizes), dtype, heads=sizes.get("heads", 4))
