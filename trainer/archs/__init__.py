"""Architecture facts: one file per model family, one dict registry.

An `Arch` says what the rest of Kiln needs to know about a model family and
nothing else: default LoRA targets, how a batch becomes model inputs (context
padding, per-row extras, which rows may share a call), latent layout, bucket
divisor, timestep-shift default, the training-adapter rule, which ComfyUI
model and text encoder it is, its modelspec name, its MLX port and how
ComfyUI module paths map onto diffusers LoRA names. No `is_flux` flags live
anywhere outside these files: adding a family is adding a file here (and one
entry in FAMILIES below).
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

from . import chroma, demo, flux2, generic, lumina2, qwen_image, wan, zimage
from .base import Arch, ComfyModel, DiffusersRule, Sampling, caption_lengths, no_extras  # noqa: F401  (the API)

# Registry order: detection and the node's combo follow it. Each family file lists its archs in ARCHS.
FAMILIES = (flux2, zimage, qwen_image, wan, chroma, lumina2, generic, demo)


def _registry(families) -> dict[str, Arch]:
    found: dict[str, Arch] = {}
    for family in families:
        for arch in family.ARCHS:
            if arch.name in found:
                raise ValueError(f"architecture {arch.name!r} is declared twice")
            if arch.context_side not in ("left", "right"):
                raise ValueError(f"{arch.name}: context_side must be 'left' or 'right', got {arch.context_side!r}")
            found[arch.name] = arch
    return found


ARCHS: dict[str, Arch] = _registry(FAMILIES)


def get_arch(name: str) -> Arch:
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(
            f"unknown arch {name!r}; known: {', '.join(ARCHS)} (`python -m trainer train --help` says what each is)"
        ) from None


def matching(classes: set[str], config_class: str, read: Callable[[str], Any]) -> list[str]:
    """Every arch whose ComfyUI model facts match (Z-Image Turbo and base match the same model)."""
    return [a.name for a in ARCHS.values() if a.comfy is not None and a.comfy.matches(classes, config_class, read)]


def detect(classes: set[str], config_class: str, read: Callable[[str], Any], *, adapter: bool = False) -> str:
    """The arch to train a ComfyUI model as: among the matching ones, the one that merges a training
    adapter when one is given (Z-Image Turbo), else one that does not; 'generic' when none matches."""
    names = matching(classes, config_class, read)
    wanted = [n for n in names if (ARCHS[n].training_adapter == "merge") == adapter]
    return (wanted or names or ["generic"])[0]


def dataset_divisor() -> int:
    """The bucket divisor of a dataset prepared before its model is known (Kiln Load Dataset): a multiple
    of every arch's, so the buckets suit whichever model trains on it."""
    return math.lcm(*(a.bucket_divisor for a in ARCHS.values()))


def guess_arch(paths) -> str | None:
    """The arch whose module layout these ComfyUI module paths follow (Flux2 Klein and Dev share one), or None."""
    for arch in ARCHS.values():
        if arch.module_marker and any(re.match(arch.module_marker, p) for p in paths):
            return arch.name
    return None
