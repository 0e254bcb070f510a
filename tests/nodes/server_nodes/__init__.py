"""Test-only ComfyUI custom nodes for tests/nodes/test_server.py: a tiny text encoder and a tiny Z-Image.
Never shipped.

Why a node: ComfyUI's CLIPLoader reads a text-encoder file, recognises Qwen3-4B from its keys and then
builds the model at its real size (hidden 2560, 36 layers) from a fixed config, so a tiny Qwen3 file
cannot be loaded through it. This node returns the tiny Klein / Z-Image text encoders of
tests/helpers/tiny_comfy.py instead: ComfyUI's own Qwen3 text-encoder classes and tokenizers with a tiny
config, i.e. a real comfy.sd.CLIP. (The tiny VAE needs no node: ComfyUI's VAELoader detects it from
its file, which the test writes.)

The server test links this folder into the temporary ComfyUI's custom_nodes/; scripts/make_workflows.py
reads its definition to write tests/nodes/workflows/*.json. V3 API, like the pack (DESIGN.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

from comfy_api.latest import ComfyExtension, io

_TESTS = str(Path(__file__).resolve().parents[2])  # tests/, for helpers (resolve: this folder is symlinked)


class KilnTestTinyCLIP(io.ComfyNode):
    """A tiny Qwen3 text encoder (ComfyUI's Klein or Z-Image classes), seeded random weights."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnTestTinyCLIP",
            display_name="Kiln Test Tiny CLIP",
            category="Kiln/testing",
            description="Test only: ComfyUI's Flux.2 Klein or Z-Image text encoder at a tiny size (random weights).",
            inputs=[
                io.Combo.Input(
                    "family", options=["flux2_klein", "zimage"], tooltip="Which ComfyUI text encoder to build tiny"
                ),
                io.Int.Input(
                    "seed",
                    default=0,
                    min=0,
                    max=2**31 - 1,
                    control_after_generate=False,
                    tooltip="Seed of the random weights",
                ),
            ],
            outputs=[io.Clip.Output()],
        )

    @classmethod
    def execute(cls, family: str, seed: int = 0):
        if _TESTS not in sys.path:
            sys.path.insert(0, _TESTS)
        from helpers import tiny_comfy

        clip = (
            tiny_comfy.tiny_klein_clip(seed=seed) if family == "flux2_klein" else tiny_comfy.tiny_zimage_clip(seed=seed)
        )
        return io.NodeOutput(clip)


class KilnTestTinyZImage(io.ComfyNode):
    """A tiny Z-Image MODEL: ComfyUI detects Z-Image only at dim 3840, so no tiny file loads through
    UNETLoader; this node builds ComfyUI's own NextDiT at dim 256 (tiny_comfy.tiny_zimage)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnTestTinyZImage",
            display_name="Kiln Test Tiny Z-Image",
            category="Kiln/testing",
            description="Test only: ComfyUI's Z-Image (NextDiT) at a tiny size (random weights).",
            inputs=[
                io.Int.Input(
                    "seed",
                    default=0,
                    min=0,
                    max=2**31 - 1,
                    control_after_generate=False,
                    tooltip="Seed of the random weights",
                )
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, seed: int = 0):
        if _TESTS not in sys.path:
            sys.path.insert(0, _TESTS)
        from helpers import tiny_comfy

        return io.NodeOutput(tiny_comfy.tiny_zimage(seed=seed))


NODES = [KilnTestTinyCLIP, KilnTestTinyZImage]


class _TestExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)


async def comfy_entrypoint():
    return _TestExtension()
