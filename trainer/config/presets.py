"""Presets: plain dicts of overrides, after ai-toolkit's Z-Image Turbo / Flux2 LoRA preset (shared/REFERENCE.md):
rank 32, lr 1e-4, wd 1e-4, [512, 768, 1024], caption dropout 0.05, checkpointing, bf16, "weighted" timesteps
(our bell loss weighting). Kiln uses AdamW rather than adamw8bit: on a rank-32 LoRA the 8-bit state saves little
memory and bitsandbytes is missing on Macs, so the presets run everywhere."""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]


def _full_run(steps: int, rank: int, content_or_style: str) -> dict[str, Any]:
    """The ai-toolkit-like preset the full runs share (a fresh resolutions list each), alpha = rank."""
    return dict(
        steps=steps,
        rank=rank,
        alpha=float(rank),
        learning_rate=1e-4,
        weight_decay=1e-4,
        resolutions=[512, 768, 1024],
        caption_dropout=0.05,
        loss_weighting="bell",
        content_or_style=content_or_style,
        gradient_checkpointing=True,
        mixed_precision="bf16",
        checkpoint_every=250,
    )


PRESETS: dict[str, dict[str, Any]] = {
    "quick_test": dict(
        steps=100,
        rank=8,
        alpha=8.0,
        learning_rate=4e-4,
        resolutions=[512],
        checkpoint_every=50,
        keep_checkpoints=2,
        log_every=5,
        caption_dropout=0.0,
    ),
    "character": _full_run(steps=3000, rank=32, content_or_style="balanced"),
    "style": _full_run(steps=2000, rank=16, content_or_style="style"),
    "concept": _full_run(steps=2500, rank=32, content_or_style="content"),
}
