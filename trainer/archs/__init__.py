"""Architecture facts: one file per model family, one dict registry.

An `Arch` says what the loop needs to know about a model family and nothing
else: default LoRA targets, how a batch becomes model inputs, latent layout,
bucket divisor, timestep-shift default, the training-adapter rule and how
ComfyUI module paths map onto diffusers LoRA names. No `is_flux` flags live
anywhere outside these files.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .layout import Layout


@dataclass(frozen=True)
class DiffusersRule:
    """Maps a ComfyUI module path (regex with groups) onto diffusers names.

    `targets` lists the diffusers module templates (formatted with the regex
    groups); with more than one target the fused layer's output rows are split
    into `len(targets)` equal parts, or by `split_sizes` when given.
    """

    comfy: str                      # e.g. r"double_blocks\.(\d+)\.img_attn\.qkv"
    targets: tuple[str, ...]        # e.g. ("transformer_blocks.{0}.attn.to_q", ...)
    split_sizes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Arch:
    name: str                       # registry key, e.g. "flux2_klein"
    family: str                     # "flux2", "zimage", "generic": shares key maps
    latent_channels: int            # channels of x handed to the model
    latent_downscale: int           # image pixels per latent cell (Flux2 16, Z-Image 8)
    patch: int                      # latent cells per token side inside the model (Flux2 1, Z-Image 2)
    bucket_divisor: int             # image sides are multiples of this (pixels)
    default_targets: tuple[str, ...]  # LoRA target patterns (see backends: exact, suffix, re:)
    block_lists: tuple[str, ...]    # attribute names of the model's block ModuleLists
    shift_mode: str                 # "none" | "static" | "resolution": timestep shift default
    shift: float                    # static shift value (ignored unless shift_mode == "static")
    # Batch → model inputs: `model(x_t, sigma, context, **extras)` where
    # context = collate_context([T_i,D] per row) and extras = model_extras(batch_size, [T_i]).
    collate_context: Callable[[list[np.ndarray]], np.ndarray]
    model_extras: Callable[[int, list[int]], dict]
    training_adapter: str = "none"  # "none" | "merge": merged at +1 for training, removed for samples
    # Blocks never write into their own inputs, so compile_blocks also compiles the blocks that keep
    # their activations (checkpointing off, skip_checkpoint_blocks). Flux2's `img += ...` blocks do.
    pure_blocks: bool = False
    diffusers_prefix: str = "transformer."
    diffusers_rules: tuple[DiffusersRule, ...] = field(default_factory=tuple)
    description: str = ""
    layout: Layout | None = None    # sizes, Linears and block model for the memory estimate (layout.py)


def right_pad(contexts: list[np.ndarray]) -> np.ndarray:
    """Rows [T_i,D] → [B,max T,D], zeros after each caption's tokens."""
    tokens = max(c.shape[0] for c in contexts)
    out = np.zeros((len(contexts), tokens, contexts[0].shape[1]), dtype=np.float32)
    for row, c in enumerate(contexts):
        out[row, : c.shape[0]] = c
    return out


def no_extras(batch_size: int, lengths: list[int]) -> dict:
    return {}


ARCHS: dict[str, Arch] = {}


def register(arch: Arch) -> Arch:
    if arch.name in ARCHS:
        raise ValueError(f"architecture {arch.name!r} registered twice")
    ARCHS[arch.name] = arch
    return arch


def get_arch(name: str) -> Arch:
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(f"unknown arch {name!r}; choose one of {sorted(ARCHS)}") from None


# Import order fixes the registry order (the node's combo follows it).
from . import flux2, zimage, generic, demo  # noqa: E402,F401


_FAMILY_MARKERS = (("flux2_klein", re.compile(r"^(double_blocks|single_blocks)\.\d+\.")),
                   ("zimage", re.compile(r"^(layers|noise_refiner|context_refiner)\.\d+\.(attention|feed_forward)")))


def guess_arch(paths) -> str | None:
    """The arch whose key layout these module paths follow (Flux2 Klein and Dev share one), or None."""
    for name, marker in _FAMILY_MARKERS:
        if any(marker.match(p) for p in paths):
            return name
    return None
