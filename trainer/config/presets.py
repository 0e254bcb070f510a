"""Presets: plain dicts of overrides, after ai-toolkit's Z-Image Turbo / Flux2 LoRA preset (shared/REFERENCE.md):
rank 32, lr 1e-4, wd 1e-4, [512, 768, 1024], caption dropout 0.05, checkpointing, bf16, "weighted" timesteps
(our bell loss weighting). Kiln uses AdamW rather than adamw8bit: on a rank-32 LoRA the 8-bit state saves little
memory and bitsandbytes is missing on Macs, so the presets run everywhere."""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

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
    "character": dict(
        steps=3000,
        rank=32,
        alpha=32.0,
        learning_rate=1e-4,
        weight_decay=1e-4,
        resolutions=[512, 768, 1024],
        caption_dropout=0.05,
        loss_weighting="bell",
        content_or_style="balanced",
        gradient_checkpointing=True,
        mixed_precision="bf16",
        checkpoint_every=250,
    ),
    "style": dict(
        steps=2000,
        rank=16,
        alpha=16.0,
        learning_rate=1e-4,
        weight_decay=1e-4,
        resolutions=[512, 768, 1024],
        caption_dropout=0.05,
        loss_weighting="bell",
        content_or_style="style",
        gradient_checkpointing=True,
        mixed_precision="bf16",
        checkpoint_every=250,
    ),
    "concept": dict(
        steps=2500,
        rank=32,
        alpha=32.0,
        learning_rate=1e-4,
        weight_decay=1e-4,
        resolutions=[512, 768, 1024],
        caption_dropout=0.05,
        loss_weighting="bell",
        content_or_style="content",
        gradient_checkpointing=True,
        mixed_precision="bf16",
        checkpoint_every=250,
    ),
}
