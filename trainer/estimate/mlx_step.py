"""Memory estimate for one MLX LoRA training step on Apple Silicon (backend "mlx").

The same parts as trainer/estimate/torch_step.py (weights, LoRA, gradients, optimizer state, activations,
workspace), with what differs on MLX:

    weights      bf16 2 B/param (fp8 files are decoded to the compute dtype: MLX has no fp8 matmul);
                 base_quantize int8/int4 stores the block Linears at bits/8 B plus one bf16 scale
                 and one bf16 bias per group of 64 inputs (0.0625 B/param); embedders, modulation
                 and the final layer stay bf16 (models.quantize_blocks)
    activations  the per-token block model of estimate.py (MLX's autodiff keeps the same tensors:
                 the measured double-block term matched torch's to 0.2 %), plus ATTENTION: on Metal
                 (MLX 0.32) a step under a gradient uses the unfused SDPA for forward and backward
                 (mlx/backend/metal/scaled_dot_product_attention.cpp: `if (is_training) return true`),
                 so each block keeps its softmax probabilities, B x heads x L^2 values, and the
                 backward of one block needs a few more such matrices at once
    workspace    MLX_OVERHEAD (Metal command buffers, allocator slack; no CUDA context) + 2x the
                 widest Linear output, as on CUDA

ATTENTION_KEPT (bytes per B x heads x L^2 value) was measured on chained SDPA calls under a gradient,
and BACKWARD_FACTOR fitted to peak memory (mx.get_peak_memory) of compiled bf16 steps of the MLX Flux2
and Z-Image ports at hidden 256 and two sequence lengths, both on mlx[cpu], whose SDPA takes the same
unfused path (bench/mlx_memory.py reruns both and prints the estimate's error for every case).

A Mac's GPU may use its recommended working set (Metal's recommendedMaxWorkingSetSize), not all of
its RAM; the backend caps MLX at 95 % of it. Reported values: 16 GB 10.7 GiB, 32 GB 21.3 GiB,
48 GB 37.4 GiB, 64 GB 48 GiB, 128 GB 96-107.5 GiB (macOS 26); `sudo sysctl iogpu.wired_limit_mb=N`
raises it. working_set_gib() takes the conservative value.
"""

from __future__ import annotations

from ..archs import get_arch
from .common import (
    ACTIVATION_BYTES,
    GIB,
    PRESERVATION_NOTE,
    Estimate,
    EstimatorRules,
    arch_of,
    block_bytes,
    check_settings,
    get_dims,
    image_token_count,
    kept_by_last_blocks,
    linear_layers,
    lora_shapes,
    ordered_advice,
    param_count,
    preservation_rows,
    trainable_costs,
    widest_output,
)

QUANT_GROUP = 64  # mlx_backend.models.GROUP_SIZE (not imported: estimates need no MLX)
QUANT_BYTES = {"int8": 1.0 + 4 / QUANT_GROUP, "int4": 0.5 + 4 / QUANT_GROUP}  # + bf16 scale and bias per group
MLX_BASE_BYTES = {"bf16": 2, "fp32": 4, **QUANT_BYTES}
MLX_OVERHEAD = GIB // 2
ATTENTION_KEPT = 6.6  # per block: bf16 and fp32 softmax probabilities, kept for backward (measured)
BACKWARD_FACTOR = 1.0  # the block in backward: its internals' gradients, as large as they are (fitted)
MLX_OPTIMIZERS = ("adamw", "adamw8bit", "adafactor")  # config.MLX_OPTIMIZER_NAMES
MLX_RUNS = {"adamw8bit": "adamw"}  # what the MLX backend trains instead (bitsandbytes is CUDA-only)


def working_set_gib(ram_gb: float) -> float:
    """Metal's recommended working set of a Mac with `ram_gb` of RAM (conservative: 2/3 below 48 GB,
    3/4 from 48 GB), in GiB, as macOS reports it."""
    return ram_gb * (2 / 3 if ram_gb < 48 else 3 / 4)


def mlx_budget_gib(ram_gb: float) -> float:
    """What a run may allocate: the backend's memory limit, 95 % of the working set."""
    return 0.95 * working_set_gib(ram_gb)


def _weight_bytes(dims, base_dtype: str) -> int:
    if base_dtype not in QUANT_BYTES:
        return param_count(dims) * MLX_BASE_BYTES[base_dtype]
    prefixes = tuple(f"{name}." for name in get_arch(dims.arch).block_lists)  # as models.quantize_blocks
    blocks = sum(
        i * o for name, (i, o) in linear_layers(dims).items() if name.startswith(prefixes) and i % QUANT_GROUP == 0
    )
    return int(blocks * QUANT_BYTES[base_dtype] + (param_count(dims) - blocks) * 2)


def estimate_mlx(
    variant,
    *,
    resolution: int,
    batch_size: int = 1,
    rank: int = 32,
    targets=None,
    optimizer: str = "adamw",
    gradient_checkpointing: bool = True,
    base_dtype: str = "bf16",
    mixed_precision: str = "bf16",
    skip_checkpoint_blocks: int = 0,
    preservation: bool = False,
    adapter: str = "lora",
    lokr_factor: int = -1,
    lokr_full_w2: bool = False,
    reference_images: int = 0,
) -> Estimate:
    """Bytes one MLX training step needs at square `resolution` (the largest bucket); `preservation`: DOP on;
    adapter: the kind (trainer/lora/adapters.py) with its LoKr settings; reference_images: edit training's
    control images per sample, each the target's tokens again in the joint sequence (as estimate.py)."""
    settings = {**locals(), "backend": "mlx"}  # every argument by name, first thing: advice re-estimates with them
    dims = _mlx_dims(variant, base_dtype, optimizer)
    side = check_settings(dims, resolution, batch_size, rank, optimizer, "bf16", mixed_precision)
    rows = preservation_rows(batch_size, preservation)
    act = ACTIVATION_BYTES[mixed_precision]
    target_tokens = image_token_count(dims, resolution, side)
    image_tokens = target_tokens * (1 + reference_images)  # target + references: the blocks see them all
    text_tokens = dims.context_tokens
    tokens = rows * (image_tokens + text_tokens)
    shapes = lora_shapes(dims, targets)
    runs = {**settings, "optimizer": MLX_RUNS.get(optimizer, optimizer)}  # the state of the optimizer that runs
    lora_params, optimizer_bytes, adapter_workspace, adapter_note = trainable_costs(runs, dims, shapes, tokens, act)
    activations = _activations(
        dims, image_tokens, target_tokens, text_tokens, act, gradient_checkpointing, skip_checkpoint_blocks
    )
    notes = _notes(image_tokens, text_tokens, reference_images, preservation) + ([adapter_note] if adapter_note else [])
    if optimizer in MLX_RUNS:
        notes.append(f"optimizer {optimizer} trains as fp32 {MLX_RUNS[optimizer]} on MLX (bitsandbytes is CUDA-only)")
    return Estimate.summed(
        weights=_weight_bytes(dims, base_dtype),
        lora_params=lora_params,
        optimizer=optimizer_bytes,
        activations=int(rows * activations),
        workspace=MLX_OVERHEAD + 2 * widest_output(dims) * tokens * act + adapter_workspace,
        tokens=tokens,
        notes=notes,
        settings=settings,
    )


def _notes(image_tokens: int, text_tokens: int, reference_images: int, preservation: bool) -> list[str]:
    return [
        f"{image_tokens} image + {text_tokens} text tokens per sample"
        + (f" ({reference_images} reference image{'s' * (reference_images > 1)} included)" if reference_images else ""),
        "diffusion model only: text encoder and VAE cached or offloaded",
        "MLX: unfused attention keeps heads x L^2 probabilities per block (checkpointing keeps one block's)",
        "an estimate fitted on mlx[cpu] at small sizes; not yet checked on a Mac",
    ] + ([PRESERVATION_NOTE] if preservation else [])


def _mlx_dims(variant, base_dtype: str, optimizer: str):
    """The variant's dims, once the base dtype, the optimizer and the model are known to train on MLX."""
    if base_dtype not in MLX_BASE_BYTES:
        raise ValueError(
            f"base_dtype for MLX must be one of {list(MLX_BASE_BYTES)} (fp8 files are decoded to "
            f"bf16; base_quantize int8/int4 is MLX's smaller base), got {base_dtype!r}"
        )
    if optimizer not in MLX_OPTIMIZERS:
        raise ValueError(f"optimizer for MLX must be one of {list(MLX_OPTIMIZERS)}, got {optimizer!r}")
    dims = get_dims(variant)
    if not arch_of(dims).mlx_model:
        raise ValueError(
            f"{dims.variant} has no MLX port (arch {dims.arch!r} trains on the PyTorch backend); "
            "estimate it with backend torch"
        )
    return dims


def _activations(
    dims, image_tokens: int, target_tokens: int, text_tokens: int, act: int, checkpointing: bool, skip: int
) -> float:
    """What one row keeps for backward: the block model, each block's attention matrices, the final layer,
    and the gradients of the block being differentiated."""
    groups = block_bytes(dims, image_tokens, text_tokens, act)
    heads = dims.heads
    # (per-token bytes, blocks, tokens) + the attention matrices each such block keeps
    per_block = [
        (per_token * tokens + ATTENTION_KEPT * heads * tokens**2, count, tokens) for per_token, count, tokens in groups
    ]
    head = 2 * dims.hidden * act * target_tokens  # the final layer runs on the target's tokens only
    largest = max(b for b, _, _ in per_block)
    if checkpointing:  # block inputs, and one block rebuilt in backward
        kept = sum(count * tokens * dims.hidden * act for _, count, tokens in per_block) + largest
        kept += kept_by_last_blocks([(b, count) for b, count, _ in per_block], skip)
    else:
        kept = sum(b * count for b, count, _ in per_block)
    # The block being differentiated holds its internals' gradients beside them
    return kept + head + BACKWARD_FACTOR * largest


def advice(settings: dict) -> list[tuple[str, dict]]:
    """Changes that lower MLX memory, cheapest in quality first."""
    return ordered_advice(
        settings,
        [
            ("base_quantize int8", {"base_dtype": "int8"}, settings["base_dtype"] in ("bf16", "fp32")),
            ("batch size 1 (raise grad_accum instead)", {"batch_size": 1}, settings["batch_size"] > 1),
            ("base_quantize int4", {"base_dtype": "int4"}, settings["base_dtype"] != "int4"),
        ],
    )


# estimate_common.backend_rules("mlx"): the Mac's RAM in GB, of which MLX may use mlx_budget_gib.
RULES = EstimatorRules(
    estimate_mlx,
    advice,
    mlx_budget_gib,
    lambda gb, usable: f"a {gb:g} GB Mac (MLX may use 95 % of its GPU working set: {usable:.1f} GiB)",
)
