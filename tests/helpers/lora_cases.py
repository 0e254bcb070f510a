"""Small LoRAs at realistic module paths of Flux2 and Z-Image (a toy hidden size): the library's file tests and
ComfyUI's LoRA loader test read the same cases."""

from __future__ import annotations

import numpy as np

from trainer.lora import files as lf
from trainer.lora.files import LoraWeights

HIDDEN, RANK = 64, 4

# Realistic module paths and (out, in) shapes, at a toy hidden size.
FLUX2_MODULES = {
    "double_blocks.0.img_attn.qkv": (3 * HIDDEN, HIDDEN),
    "double_blocks.0.txt_attn.qkv": (3 * HIDDEN, HIDDEN),
    "double_blocks.0.img_attn.proj": (HIDDEN, HIDDEN),
    "double_blocks.1.txt_mlp.2": (HIDDEN, 3 * HIDDEN),
    "single_blocks.1.linear1": (9 * HIDDEN, HIDDEN),
    "single_blocks.1.linear2": (HIDDEN, 4 * HIDDEN),
}
ZIMAGE_MODULES = {
    "layers.3.attention.qkv": (3 * HIDDEN, HIDDEN),
    "layers.3.attention.out": (HIDDEN, HIDDEN),
    "layers.3.feed_forward.w2": (HIDDEN, 2 * HIDDEN),
    "noise_refiner.0.feed_forward.w1": (2 * HIDDEN, HIDDEN),
}
CASES = [("flux2_klein", FLUX2_MODULES), ("zimage", ZIMAGE_MODULES)]


def make_lora(modules, seed=0, alpha=8.0) -> dict[str, LoraWeights]:
    rng = np.random.default_rng(seed)
    return {
        path: LoraWeights(
            rng.standard_normal((RANK, fan_in), dtype=np.float32),
            rng.standard_normal((out, RANK), dtype=np.float32),
            alpha + i,
        )
        for i, (path, (out, fan_in)) in enumerate(modules.items())
    }


def delta(w: LoraWeights) -> np.ndarray:
    return (w.B.astype(np.float64) @ w.A.astype(np.float64)) * w.scale


def lora_metadata():
    return lf.build_metadata(
        arch_name="flux2_klein",
        config={"rank": RANK, "lr": 1e-4},
        steps=500,
        trigger_words=["ohwx person", "kiln"],
        title="My LoRA",
        notes="test run",
    )
