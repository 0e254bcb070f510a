"""Presets: plain dicts of overrides, after ai-toolkit's Z-Image Turbo / Flux2 LoRA preset (shared/REFERENCE.md):
rank 32, lr 1e-4, wd 1e-4, [512, 768, 1024], caption dropout 0.05, checkpointing, bf16, "weighted" timesteps
(our bell loss weighting). Kiln uses AdamW rather than adamw8bit: on a rank-32 LoRA the 8-bit state saves little
memory, and a run's optimizer state then resumes on any machine (adamw8bit trains fp32 AdamW where bitsandbytes
cannot run)."""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS", "PRESET_LINES", "preset_table"]


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
    # The per-family ones users copy from ai-toolkit's example configs (rank 32, lr 1e-4, 3000 steps there)
    "klein_base": _full_run(steps=3000, rank=32, content_or_style="balanced"),
    "zimage_turbo": _full_run(steps=3000, rank=32, content_or_style="balanced"),
}

# Why each preset chose what it sets: ONE line each, shown in the preset widget's tooltip, `python -m trainer
# presets` and docs/command-line.md (the tests hold every preset to having one).
PRESET_LINES: dict[str, str] = {
    "quick_test": "a smoke test, not a LoRA to keep: 100 steps at rank 8 and a high lr (4e-4) on 512 px only, "
    "a checkpoint every 50, to see that the workflow runs",
    "character": "a person or character: rank 32 holds a likeness, lr 1e-4, 3000 steps, every noise level "
    "(balanced), 512-1024 px, ai-toolkit's settings",
    "style": "an art style: rank 16 (a style needs less room and overfits less), 2000 steps, low-noise "
    "timesteps (style: textures, colour, brushwork)",
    "concept": "an object or concept: rank 32, 2500 steps, high-noise timesteps (content: shape and layout "
    "are decided there)",
    "klein_base": "Flux2 Klein 4B/9B as ai-toolkit's example: load the base (undistilled) checkpoint, which "
    "ai-toolkit trains Klein on; rank 32, lr 1e-4, 3000 steps, 512-1024 px",
    "zimage_turbo": "Z-Image Turbo as ai-toolkit's example: connect the training adapter "
    "(zimage_turbo_training_adapter_v2) to training_adapter, rank 32, lr 1e-4, 3000 steps, 512-1024 px",
}
assert set(PRESET_LINES) == set(PRESETS), "every preset documents its choices in one line"


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(str(item) for item in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def preset_table() -> str:
    """`python -m trainer presets`: each preset's name, its line, then the settings it sets."""
    blocks = []
    for name, settings in PRESETS.items():
        values = "; ".join(f"{key} {_shown(value)}" for key, value in settings.items())
        blocks.append(f"{name}\n  {PRESET_LINES[name]}\n  sets: {values}")
    return "\n\n".join(blocks)
