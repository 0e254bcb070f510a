"""What Kiln Validation Settings hands Train LoRA: the images to sample, one per Validation Settings of a chain
(each node's optional `validation` input takes the one before it), in chain order, each with the prompt text
that heads its column of the sample grid.

The text is not in the CONDITIONING itself, so it is read from the queued prompt (ComfyUI's hidden PROMPT and
UNIQUE_ID): the `positive` input's link is followed to the node that encoded it (CLIP Text Encode's `text`,
or another encoder's prompt), through conditioning nodes in between (Flux Guidance, Reference Latent, ...)
and text primitives. Without one (a node run outside a prompt, an encoder fed by a node that computes the
text), the column is headed by the Validation Settings node's title.
"""

from __future__ import annotations

from dataclasses import dataclass

from .comfy import bridge

FALLBACK_HEADER = "Validation Settings"
# Inputs that hold a prompt's text, by the node kinds that have them: CLIPTextEncode (text), the edit
# encoders (prompt), CLIPTextEncodeFlux / SDXL (t5xxl, text_g, clip_l), text primitives (value, string).
TEXT_INPUTS = ("text", "prompt", "t5xxl", "text_g", "clip_l", "value", "string")
# Inputs that carry a CONDITIONING through a node (FluxGuidance, ReferenceLatent, ConditioningCombine, ...).
CONDITIONING_INPUTS = ("conditioning", "conditioning_to", "conditioning_1", "positive")
MAX_HOPS = 8  # links followed at most (a malformed prompt could hold a cycle)


@dataclass(frozen=True, kw_only=True)  # keyword-only: `every` follows Sample's defaulted `frames`
class Validation(bridge.Sample):
    """One Validation Settings: the image (a video model's clip) to sample, how often, and the text heading its
    grid column."""

    every: int
    prompt: str = FALLBACK_HEADER


@dataclass(frozen=True)
class ValidationChain:
    """KILN_VALIDATION: every Validation Settings of a chain, in order; Train LoRA samples each."""

    samples: tuple[Validation, ...]

    @property
    def every(self) -> int:
        """The chain samples together, as often as its most frequent node asks (no prompt less often)."""
        return min(sample.every for sample in self.samples)

    @property
    def prompts(self) -> list[str]:
        return [sample.prompt for sample in self.samples]


def chain(before: ValidationChain | None, sample: Validation) -> ValidationChain:
    return ValidationChain((*(before.samples if before is not None else ()), sample))


def _link(value) -> str | None:
    """The source node id of a link in an API-format prompt ([node id, output index]), else None."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[1], int):
        return str(value[0])
    return None


def _text_of(prompt: dict, node_id: str | None, hops: int) -> str | None:
    """The prompt text of the node `node_id`, following text and conditioning links."""
    node = prompt.get(node_id) if node_id is not None and hops > 0 else None
    inputs = node.get("inputs") if isinstance(node, dict) else None
    if not isinstance(inputs, dict):
        return None
    for name in TEXT_INPUTS:
        value = inputs.get(name)
        text = value.strip() if isinstance(value, str) else _text_of(prompt, _link(value), hops - 1)
        if text:
            return text
    for name in CONDITIONING_INPUTS:
        text = _text_of(prompt, _link(inputs.get(name)), hops - 1)
        if text:
            return text
    return None


def header(prompt: dict | None, node_id: str | None, input_name: str = "positive") -> str:
    """The text that heads a Validation Settings' grid column: its positive prompt's text, else its title."""
    node = prompt.get(str(node_id)) if isinstance(prompt, dict) and node_id is not None else None
    if not isinstance(node, dict):
        return FALLBACK_HEADER
    text = _text_of(prompt, _link((node.get("inputs") or {}).get(input_name)), MAX_HOPS)
    title = (node.get("_meta") or {}).get("title")
    return text or (title.strip() if isinstance(title, str) and title.strip() else FALLBACK_HEADER)
