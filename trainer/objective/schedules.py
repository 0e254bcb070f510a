"""Learning-rate schedules: lr_at(step) for the optimizer step about to be taken.

A schedule maps progress p ∈ [0,1] through the post-warmup steps (p = 1 on the final
step) to a factor between min_lr_ratio and 1. Linear warmup, when asked for, comes
first and ends at base_lr; it is shared by every schedule except plain "cosine".
"""

from __future__ import annotations

import math
from typing import Callable


def _constant(progress: float, min_ratio: float) -> float:
    """Always the base rate."""
    return 1.0


def _linear(progress: float, min_ratio: float) -> float:
    """Straight line from 1 down to min_ratio, reached exactly at progress 1."""
    return min_ratio + (1.0 - min_ratio) * (1.0 - progress)


def _cosine(progress: float, min_ratio: float) -> float:
    """Half cosine from 1 down to min_ratio (cos π = -1 exactly, so the end is exact)."""
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


SCHEDULES: dict[str, Callable[[float, float], float]] = {
    "constant": _constant,
    "linear": _linear,
    "cosine": _cosine,
    "cosine_with_warmup": _cosine,
}


def _check(step: int, base_lr: float, schedule: str, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> None:
    """Raise a ValueError that names the bad argument and the fix."""
    if schedule not in SCHEDULES:
        raise ValueError(f"lr schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    if not (math.isfinite(base_lr) and base_lr > 0):
        raise ValueError(f"base_lr must be > 0, got {base_lr}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= step < total_steps:
        raise ValueError(f"step must be 0..{total_steps - 1} (total_steps={total_steps}), got {step}")
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(
            f"warmup_steps must be 0..{total_steps - 1} (fewer than total_steps={total_steps}), got {warmup_steps}"
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in 0..1, got {min_lr_ratio}")
    if schedule == "cosine" and warmup_steps > 0:
        raise ValueError(
            f"lr schedule 'cosine' has no warmup, but warmup_steps={warmup_steps}; "
            "pick 'cosine_with_warmup' or set warmup_steps to 0"
        )
    if schedule == "cosine_with_warmup" and warmup_steps == 0:
        raise ValueError("lr schedule 'cosine_with_warmup' needs warmup_steps > 0; set warmup_steps or pick 'cosine'")


def lr_at(
    step: int, *, base_lr: float, schedule: str, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0
) -> float:
    """Learning rate for 0-based optimizer step `step` of `total_steps`."""
    _check(step, base_lr, schedule, total_steps, warmup_steps, min_lr_ratio)
    if step < warmup_steps:
        # (step+1)/warmup so the first step is not wasted at lr 0 and the last warmup
        # step reaches base_lr.
        return base_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps)
    return base_lr * SCHEDULES[schedule](progress, min_lr_ratio)
