"""Qwen-Image as ComfyUI runs it: comfy/ldm/qwen_image/model.py QwenImageTransformer2DModel.

The memory-estimate layout only (trainer/archs/layout.py): the model's sizes, Linears and block model.
"""
from __future__ import annotations

from .layout import BlockGroup, HeaderSpec, Layout, ModelDims

# ---------------------------------------------------------------- memory-estimate layout

CAPTION_TOKENS = 512  # an upper bound: ComfyUI runs each caption at its own length, uncapped


def model_dims(variant: str, hidden: int, blocks: int, context_dim: int,
               context_tokens: int = CAPTION_TOKENS) -> ModelDims:
    """model_detection.py's qwen_image branch (in_channels from img_in, transformer_blocks counted) with the
    class defaults: 24 heads of 128, joint_attention_dim 3584 (Qwen2.5-VL 7B), FeedForward mult 4."""
    return ModelDims(variant, "qwen_image", hidden, hidden // 128, blocks, 0, 4 * hidden, context_dim,
                     context_tokens)


def linear_layers(dims: ModelDims, io: int) -> dict[str, tuple[int, int]]:
    D, M = dims.hidden, dims.mlp_hidden
    layers = {"time_text_embed.timestep_embedder.linear_1": (256, D),
              "time_text_embed.timestep_embedder.linear_2": (D, D),
              "img_in": (io, D), "txt_in": (dims.context_dim, D)}
    for i in range(dims.double_blocks):
        p = f"transformer_blocks.{i}"
        for stream in ("img", "txt"):  # modulation: Linear(dim, 6 dim) after a SiLU, from the timestep vector
            layers.update({f"{p}.{stream}_mod.1": (D, 6 * D), f"{p}.{stream}_mlp.net.0.proj": (D, M),
                           f"{p}.{stream}_mlp.net.2": (M, D)})
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
            layers[f"{p}.attn.{name}"] = (D, D)
    layers.update({"norm_out.linear": (D, 2 * D), "proj_out": (D, io)})
    return layers


def extra_params(dims: ModelDims, layers: dict[str, tuple[int, int]]) -> int:
    """Biases on every Linear, the txt_norm RMSNorm, the 4 q/k RMSNorms of each block's attention; its
    LayerNorms have no affine."""
    biases = sum(o for i, o in layers.values())
    return biases + dims.context_dim + dims.double_blocks * 4 * (dims.hidden // dims.heads)


def blocks(dims: ModelDims, image_tokens: int, text_tokens: int) -> list[BlockGroup]:
    """Derived by trainer/estimate.py's rules from ComfyUI's QwenImageTransformerBlock, not yet measured on a
    GPU. A two-stream block with joint attention like Flux2's double block; per token of either stream:
      bf16  to_q/k/v in D (one input), q and k norm inputs 2D (contiguous copies: unlike Flux2's fused
            qkv, v's output is not kept), SDPA q/k/v/out 4D, to_out in D, mlp.net.0 in D, GELU in M,
            mlp.net.2 in M (no gate)                        =  9D + 2M
      fp32  norm1 and norm2 inputs                          =  2D
    img_mod/txt_mod act on the one timestep vector of a sample: nothing per token. Targeted by a LoRA,
    their shift/scale/gate take gradients, and each stream keeps ~2D fp32 + 2D bf16 more (not counted).
    """
    D, M = dims.hidden, dims.mlp_hidden
    return [BlockGroup(9 * D + 2 * M, 2 * D, dims.double_blocks, image_tokens + text_tokens)]


LAYOUT = Layout(
    name="Qwen-Image",
    variants=(model_dims("qwen-image", 3072, 60, 3584),),
    linear_layers=linear_layers, extra_params=extra_params, blocks=blocks,
    widest_output=lambda dims: dims.mlp_hidden,  # img_mlp.net.0.proj
    # model_detection.py keys on txt_norm, which Mage-Flow shares (told apart by its 2560-wide text): here
    # Linears only, and the text width from txt_in
    header=HeaderSpec(markers=("transformer_blocks.0.img_mod.1.weight", "txt_in.weight"),
                      sizes={"hidden": ("img_in.weight", 0), "context_dim": ("txt_in.weight", 1)},
                      counts={"double_blocks": "transformer_blocks."}),
    text_note=" (512 caption tokens is an upper bound; ComfyUI does not cap them)",
    measured=False,
)

# (arch registration added by the other engineer)
