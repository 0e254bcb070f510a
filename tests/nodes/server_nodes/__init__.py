"""Test-only ComfyUI custom nodes for tests/nodes/test_server.py: tiny text encoders, a tiny Z-Image and Qwen-Image,
a tiny Wan 2.2 VAE and a tiny CLIP vision model. Never shipped.

Why a node: ComfyUI's CLIPLoader reads a text-encoder file, recognises Qwen3-4B from its keys and then
builds the model at its real size (hidden 2560, 36 layers) from a fixed config, so a tiny Qwen3 file
cannot be loaded through it. This node returns the tiny Klein / Z-Image text encoders of
tests/helpers/tiny_comfy.py instead: ComfyUI's own Qwen3 text-encoder classes and tokenizers with a tiny
config, i.e. a real comfy.sd.CLIP; likewise Wan's umT5 and Qwen-Image's Qwen2.5-VL (tests/helpers/tiny_encoders.py).
(The tiny Flux, Flux2 and Wan 2.1 VAEs need no node: ComfyUI's VAELoader detects them from their files, which the
test writes; its Wan 2.2 VAE it builds at full size, hence KilnTestTinyWan22VAE.)

The server test links this folder into the temporary ComfyUI's custom_nodes/; scripts/make_workflows.py
reads its definition to write tests/nodes/workflows/*.json. V3 API, like the pack (DESIGN.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

from comfy_api.latest import ComfyExtension, io

_TESTS = str(Path(__file__).resolve().parents[2])  # tests/, for helpers (resolve: this folder is symlinked)


def _helper(name: str):
    """tests/helpers/<name>, imported when a node runs (the server loads this pack with tests/ off its path)."""
    import importlib

    if _TESTS not in sys.path:
        sys.path.insert(0, _TESTS)
    return importlib.import_module(f"helpers.{name}")


# family → (tests/helpers module, builder); new families go last (the combo's options)
_CLIPS = {
    "flux2_klein": ("tiny_comfy", "tiny_klein_clip"),
    "zimage": ("tiny_comfy", "tiny_zimage_clip"),
    "wan": ("tiny_encoders", "tiny_umt5_clip"),
    "qwen_image": ("tiny_encoders", "tiny_qwen25vl_clip"),
}


def _seed_input():
    return io.Int.Input(
        "seed", default=0, min=0, max=2**31 - 1, control_after_generate=False, tooltip="Seed of the random weights"
    )


class KilnTestTinyCLIP(io.ComfyNode):
    """A tiny Qwen3 text encoder (ComfyUI's Klein or Z-Image classes), seeded random weights."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnTestTinyCLIP",
            display_name="Kiln Test Tiny CLIP",
            category="Kiln/testing",
            description="Test only: ComfyUI's Flux.2 Klein, Z-Image, Wan or Qwen-Image text encoder, tiny (random weights).",
            inputs=[
                io.Combo.Input("family", options=list(_CLIPS), tooltip="Which ComfyUI text encoder to build tiny"),
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
        module, function = _CLIPS[family]
        return io.NodeOutput(getattr(_helper(module), function)(seed=seed))


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
        return io.NodeOutput(_helper("tiny_comfy").tiny_zimage(seed=seed))


class KilnTestTinyQwenImage(io.ComfyNode):
    """A tiny Qwen-Image-Edit 2511 MODEL: ComfyUI detects Qwen-Image only at 24 heads of 128 (tiny_comfy.tiny_qwen_image,
    with 2511's index_timestep_zero reference method)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnTestTinyQwenImage",
            display_name="Kiln Test Tiny Qwen-Image-Edit",
            category="Kiln/testing",
            description="Test only: ComfyUI's Qwen-Image-Edit 2511 at a tiny size (random weights).",
            inputs=[_seed_input()],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, seed: int = 0):
        return io.NodeOutput(_helper("tiny_comfy").tiny_qwen_image(seed=seed, default_ref_method="index_timestep_zero"))


class KilnTestTinyWan22VAE(io.ComfyNode):
    """ComfyUI's Wan 2.2 VAE (48 channels) at a tiny size: VAELoader builds it at dim 160 whatever the file holds."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnTestTinyWan22VAE",
            display_name="Kiln Test Tiny Wan 2.2 VAE",
            category="Kiln/testing",
            description="Test only: ComfyUI's Wan 2.2 VAE at a tiny size (random weights).",
            inputs=[_seed_input()],
            outputs=[io.Vae.Output()],
        )

    @classmethod
    def execute(cls, seed: int = 0):
        return io.NodeOutput(_helper("tiny_encoders").tiny_wan22_vae(seed=seed))


class KilnTestTinyCLIPVision(io.ComfyNode):
    """ComfyUI's CLIP vision model (clip_vision_h's width, 1280) at a tiny size: CLIP Vision Loader recognises a
    model by its layer count (23 and up) and builds it at full size, so no tiny file loads through it."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnTestTinyCLIPVision",
            display_name="Kiln Test Tiny CLIP Vision",
            category="Kiln/testing",
            description="Test only: ComfyUI's CLIP vision model, 1280 wide as clip_vision_h, tiny (random weights).",
            inputs=[_seed_input()],
            outputs=[io.ClipVision.Output()],
        )

    @classmethod
    def execute(cls, seed: int = 0):
        import tempfile

        with tempfile.TemporaryDirectory() as folder:  # its config goes through a file (0.17 reads only a path)
            return io.NodeOutput(_helper("tiny_wan").tiny_clip_vision(Path(folder), seed=seed))


NODES = [KilnTestTinyCLIP, KilnTestTinyZImage, KilnTestTinyQwenImage, KilnTestTinyWan22VAE, KilnTestTinyCLIPVision]


class _TestExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)


async def comfy_entrypoint():
    return _TestExtension()
