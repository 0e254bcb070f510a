"""LoRA target selection by module-name pattern, and the seeded LoRA init, shared by both backends.

Pattern kinds: exact ("double_blocks.0.img_attn.qkv"), suffix on a dotted
boundary ("img_attn.qkv" matches every block's), regex ("re:layers\\.[0-9]+\\.attention\\.qkv",
full match). A pattern that matches nothing is an error: a typo must never
silently train less.
"""

from __future__ import annotations

import re
import zlib

import numpy as np

from ..errors import KilnError


class TargetError(KilnError):
    """No layer (or not every pattern) matched: names the patterns and sample module names."""


def matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def select_targets(candidates: list[str], patterns: list[str] | tuple[str, ...]) -> list[str]:
    """The candidate names (Linear layers, in model order) that match any pattern."""
    if not patterns:
        raise TargetError("no LoRA target patterns given; set `targets` (e.g. ['attn.qkv', 'attn.proj'])")
    selected = [name for name in candidates if any(matches(name, p) for p in patterns)]
    unmatched = [p for p in patterns if not any(matches(name, p) for name in candidates)]
    if unmatched or not selected:
        raise TargetError(
            f"target pattern(s) {unmatched or list(patterns)} match no Linear layer; "
            f"the model has {len(candidates)} Linear layers, e.g. {_sample(candidates)}. "
            "Use an exact name, a dotted suffix such as 'attn.qkv', or 're:<regex>'"
        )
    return selected


def _sample(names: list[str], count: int = 8) -> list[str]:
    if len(names) <= count:
        return names
    stride = len(names) / count
    return [names[int(i * stride)] for i in range(count)]


def init_lora_A(seed: int, module_path: str, rank: int, in_features: int) -> np.ndarray:
    """Kaiming-uniform(a=√5) as PEFT does: U(−1/√in, 1/√in), float32 [rank, in].

    Seeded per module path (not by order), so both backends and any target
    order give the same matrices.
    """
    rng = np.random.default_rng([seed, zlib.crc32(module_path.encode())])
    bound = 1.0 / np.sqrt(in_features)
    return rng.uniform(-bound, bound, size=(rank, in_features)).astype(np.float32)
