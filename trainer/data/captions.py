"""Captions as the text encoder sees them: trigger word, prefix and suffix, seeded tag shuffling.

Order of assembly: the caption (or, when an image has none, the default
caption, else the trigger word alone) → `{trigger}` replaced → tags shuffled
(comma-separated, the first `keep_tags` stay put) → the trigger word put in
front when the caption has neither the placeholder nor the word itself →
prefix and suffix added. Shuffling never moves the trigger word, prefix or
suffix.

Text embeddings are cached, so shuffling makes `variants` fixed shuffles per
caption (variant 0 is the unshuffled caption), each encoded once; the loop
picks one per draw from its seeded generator.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

PLACEHOLDER = "{trigger}"


@dataclass(frozen=True)
class CaptionSettings:
    trigger_word: str = ""
    prefix: str = ""
    suffix: str = ""
    default_caption: str = ""
    shuffle_tags: bool = False
    keep_tags: int = 0  # leading tags that shuffling leaves in place
    variants: int = 4  # shuffled variants per caption when shuffle_tags is on


def source_text(raw: str | None, settings: CaptionSettings) -> str:
    """The file's caption, else default_caption, else "" (then the trigger word alone is used)."""
    return (raw or "").strip() or settings.default_caption.strip()


def base_caption(raw: str | None, settings: CaptionSettings) -> str:
    """The caption before shuffling, with `{trigger}` replaced."""
    text = source_text(raw, settings).replace(PLACEHOLDER, settings.trigger_word.strip())
    return re.sub(r"\s+", " ", text).strip(" ,")


def shuffle_tags(caption: str, keep: int, rng: np.random.Generator) -> str:
    tags = [t.strip() for t in caption.split(",") if t.strip()]
    head, tail = tags[:keep], tags[keep:]
    return ", ".join(head + [tail[i] for i in rng.permutation(len(tail))])


def _has_word(text: str, word: str) -> bool:
    return re.search(r"(?<!\w)" + re.escape(word) + r"(?!\w)", text) is not None


def finish(caption: str, raw: str | None, settings: CaptionSettings) -> str:
    """Trigger word in front (unless placed or already present), then prefix and suffix."""
    trigger = settings.trigger_word.strip()
    placed = PLACEHOLDER in source_text(raw, settings)
    if trigger and not placed and not _has_word(caption, trigger):
        caption = f"{trigger}, {caption}" if caption else trigger
    out = ""
    for part in (settings.prefix.strip(), caption, settings.suffix.strip()):
        if part:
            out = part if not out else out + ("" if part[0] in ",.;:" else " ") + part
    return out


def caption_variants(raw: str | None, settings: CaptionSettings, *, seed: int, key: str) -> list[str]:
    """Distinct captions to encode for one image; `key` (the image's content hash) seeds its shuffles."""
    base = base_caption(raw, settings)
    out = [finish(base, raw, settings)]
    if settings.shuffle_tags and settings.variants > 1 and base.count(",") >= 1:
        rng = np.random.default_rng([seed, int(key[:15], 16) if key else 0])
        for _ in range(8 * settings.variants):  # a few tags have few orders: stop trying after a while
            variant = finish(shuffle_tags(base, settings.keep_tags, rng), raw, settings)
            if variant not in out:
                out.append(variant)
            if len(out) == settings.variants:
                break
    return out


def class_caption(caption: str, trigger_word: str, class_word: str) -> str:
    """The caption with every whole-word trigger word replaced by the class word (differential output
    preservation's prompt, as ai-toolkit builds it: "ohwx, a man" → "person, a man")."""
    trigger = trigger_word.strip()
    if not trigger:
        return caption
    return re.sub(r"(?<!\w)" + re.escape(trigger) + r"(?!\w)", lambda _: class_word.strip(), caption)
