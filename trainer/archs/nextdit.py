"""The memory-estimate layout pieces of ComfyUI's NextDiT (comfy/ldm/lumina/model.py), which Z-Image and Lumina 2
share: the block Linears of the noise refiner, the context refiner and the main layers, in ComfyUI's module order,
and the three block groups the tokens go through. Each family gives what differs (zimage.py, lumina2.py)."""

from __future__ import annotations

from dataclasses import dataclass

from .layout import BlockGroup, ModelDims


@dataclass(frozen=True)
class NextDiTShape:
    """What a NextDiT family's Linears differ in, for hidden D."""

    modulation: str  # the blocks' adaLN Linear (adaLN_modulation.0 without a SiLU before it, .1 after one)
    t_width: int  # the t embedding's width, which every adaLN Linear reads
    t_hidden: int  # the t embedder's hidden width (t_embedder.mlp.0's output)
    kv_width: int = 0  # k and v rows each in attention.qkv; 0: D (as many heads as q, no grouped k/v heads)


def linear_layers(dims: ModelDims, io: int, shape: NextDiTShape) -> dict[str, tuple[int, int]]:
    D, F, T = dims.hidden, dims.mlp_hidden, shape.t_width
    kv = shape.kv_width or D

    def blocks(group, count, modulated):
        for i in range(count):
            p = f"{group}.{i}"
            yield from {
                f"{p}.attention.qkv": (D, D + 2 * kv),
                f"{p}.attention.out": (D, D),
                f"{p}.feed_forward.w1": (D, F),
                f"{p}.feed_forward.w2": (F, D),
                f"{p}.feed_forward.w3": (D, F),
            }.items()
            if modulated:
                yield f"{p}.{shape.modulation}", (T, 4 * D)

    # In ComfyUI's module order: the embedders sit between the refiners and the main layers.
    return {
        "x_embedder": (io, D),
        **dict(blocks("noise_refiner", dims.refiner_blocks, True)),
        **dict(blocks("context_refiner", dims.refiner_blocks, False)),
        "t_embedder.mlp.0": (256, shape.t_hidden),
        "t_embedder.mlp.2": (shape.t_hidden, T),
        "cap_embedder.1": (dims.context_dim, D),
        **dict(blocks("layers", dims.single_blocks, True)),
        "final_layer.linear": (D, io),
        "final_layer.adaLN_modulation.1": (T, D),
    }


def block_groups(dims: ModelDims, per_token: int, image_tokens: int, text_tokens: int) -> list[BlockGroup]:
    """noise_refiner (image tokens), context_refiner (text tokens), then the layers over both, `per_token` each."""
    return [
        BlockGroup(per_token, 0, dims.refiner_blocks, image_tokens),
        BlockGroup(per_token, 0, dims.refiner_blocks, text_tokens),
        BlockGroup(per_token, 0, dims.single_blocks, image_tokens + text_tokens),
    ]
