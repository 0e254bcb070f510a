"""A sample prompt's own settings: the keys of a prompt table and ai-toolkit's flags in a prompt string."""

from __future__ import annotations

__all__ = ["PROMPT_FLAGS", "PROMPT_KEYS"]

# A sample prompt's own settings (a table's keys) → the setting each overrides (its type and bounds).
PROMPT_KEYS = {
    "prompt": "",
    "negative": "sample_negative",
    "seed": "sample_seed",
    "steps": "sample_steps",
    "cfg": "sample_cfg",
    "width": "sample_width",
    "height": "sample_height",
}
# ai-toolkit's (and sd-scripts') flags in a prompt string → the key each sets.
PROMPT_FLAGS = {
    "n": "negative",
    "w": "width",
    "h": "height",
    "d": "seed",
    "seed": "seed",
    "l": "cfg",
    "cfg": "cfg",
    "s": "steps",
    "steps": "steps",
}
