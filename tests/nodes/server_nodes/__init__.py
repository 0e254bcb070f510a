"""Test-only ComfyUI custom node for tests/nodes/test_server.py: a tiny text encoder. Never shipped.

Why a node: ComfyUI's CLIPLoader reads a text-encoder file, recognises Qwen3-4B from its keys and then
builds the model at its real size (hidden 2560, 36 layers) from a fixed config, so a tiny Qwen3 file
cannot be loaded through it. This node returns the tiny Klein / Z-Image text encoders of
tests/nodes/tiny_comfy.py instead: ComfyUI's own Qwen3 text-encoder classes and tokenizers with a tiny
config, i.e. a real comfy.sd.CLIP. (The tiny VAE needs no node: ComfyUI's VAELoader detects it from
its file, which the test writes.)

The server test links this folder into the temporary ComfyUI's custom_nodes/; scripts/make_workflows.py
reads its definition to write tests/nodes/workflows/*.json. V1 API, to keep it small.
"""
from __future__ import annotations

import sys
from pathlib import Path

_TESTS_NODES = str(Path(__file__).resolve().parents[1])   # tests/nodes (resolve: this folder is symlinked)


class KilnTestTinyCLIP:
    """A tiny Qwen3 text encoder (ComfyUI's Klein or Z-Image classes), seeded random weights."""

    CATEGORY = "Kiln/testing"
    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"
    DESCRIPTION = "Test only: ComfyUI's Flux.2 Klein or Z-Image text encoder at a tiny size (random weights)."

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "family": (["flux2_klein", "zimage"], {"tooltip": "Which ComfyUI text encoder to build tiny"}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1, "control_after_generate": False,
                             "tooltip": "Seed of the random weights"}),
        }}

    def load(self, family: str, seed: int = 0):
        if _TESTS_NODES not in sys.path:
            sys.path.insert(0, _TESTS_NODES)
        import tiny_comfy

        clip = tiny_comfy.tiny_klein_clip(seed=seed) if family == "flux2_klein" else tiny_comfy.tiny_zimage_clip(seed=seed)
        return (clip,)


NODE_CLASS_MAPPINGS = {"KilnTestTinyCLIP": KilnTestTinyCLIP}
NODE_DISPLAY_NAME_MAPPINGS = {"KilnTestTinyCLIP": "Kiln Test Tiny CLIP"}
