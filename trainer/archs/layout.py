"""The shape of a model family, as the memory estimate needs it (trainer/estimate/common.py).

Each family file (flux2.py, zimage.py, ...) builds one `Layout` from its own functions and hangs it
on its `Arch` (`layout=`); the estimate asks the arch for it and never tests a family name. The
latent layout (channels, downscale, patch) is not here: it is the arch's own `latent_channels`,
`latent_downscale` and `patch`, which the estimate reads from the arch.

This module defines types only and imports nothing from Kiln, so the family files, the arch
registry and the estimators can all import it without a circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

Shapes = dict[str, tuple[int, int]]  # ComfyUI module path -> (in, out) features of a Linear


@dataclass(frozen=True)
class ModelDims:
    """The numbers of one model size, as ComfyUI builds it (comfy/model_detection.py). The block
    fields mean what the arch's Layout says; a family without such blocks leaves them 0."""

    variant: str  # e.g. "flux2-klein-4b"
    arch: str  # trainer.archs key: its default_targets, latent layout and Layout apply
    hidden: int  # D
    heads: int  # head dim 128 in every variant
    double_blocks: int  # two-stream blocks (Flux2 double_blocks, Qwen-Image transformer_blocks)
    single_blocks: int  # one-stream blocks (Flux2 single_blocks, Z-Image layers)
    mlp_hidden: int  # M: MLP hidden features (the width of one of a gated MLP's two halves)
    context_dim: int  # text feature width into the text embedder
    context_tokens: int  # text tokens per sample
    refiner_blocks: int = 0  # Z-Image noise_refiner and context_refiner, each
    guidance_embed: bool = False  # Flux2 Dev's guidance_in


class BlockGroup(NamedTuple):
    """Blocks of one kind: what autograd keeps per token inside one of them, and how many see how many
    tokens. Activation-dtype values cost 2 B under bf16 autocast (4 B without); fp32 ones always 4 B."""

    kept: int  # activation-dtype values kept per token
    kept_fp32: int  # fp32 values kept per token (LayerNorm inputs under autocast)
    count: int  # blocks of this kind
    tokens: int  # tokens each one sees


@dataclass(frozen=True)
class HeaderSpec:
    """How a ComfyUI diffusion-model file (safetensors header, model prefix stripped) shows its family
    and size: every marker key present, then ModelDims fields read from shapes and block counts."""

    markers: tuple[str, ...]  # keys only this family's files hold
    sizes: dict[str, tuple[str, int]] = field(default_factory=dict)  # field -> (key, axis of its shape)
    counts: dict[str, str] = field(default_factory=dict)  # field -> block-list prefix, counted


@dataclass(frozen=True)
class Layout:
    """One model family's facts for the memory estimate: its sizes, its Linears, its block model."""

    name: str  # in messages: "Flux2"
    variants: tuple[ModelDims, ...]  # the full-size models (the estimate's VARIANTS)
    # (dims, patch features = latent_channels x patch^2) -> every Linear, in ComfyUI's module order
    linear_layers: Callable[[ModelDims, int], Shapes]
    # (dims, linear_layers) -> parameters beyond Linear weights: biases, norm scales, pad tokens
    extra_params: Callable[[ModelDims, Shapes], int]
    # (dims, image tokens, text tokens) -> the block groups in block order (trainer/estimate/torch_step.py docstring)
    blocks: Callable[[ModelDims, int, int], list[BlockGroup]]
    widest_output: Callable[[ModelDims], int]  # features of the widest per-token block Linear output
    header: HeaderSpec
    token_multiple: int = 1  # image tokens padded to a multiple of this (Z-Image 32)
    text_note: str = ""  # what the text token count is, for the estimate's notes
    measured: bool = True  # block model read on a GPU; False: derived by the rules, not yet checked


def ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
