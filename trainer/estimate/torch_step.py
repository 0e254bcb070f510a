"""Memory estimate for one LoRA training step on a full-size model (Flux2, Z-Image, ...; VARIANTS).

An estimate, not a measurement: it counts the big tensors and adds a margin.
Per GPU, diffusion model only; the text encoder and VAE are assumed run
beforehand (cached latents and embeddings) or offloaded.

    weights      params x bytes(base_dtype): bf16 2, fp8 1, fp32 4 (frozen, no grads); int8 (base_quantize
                 int8): the block Linears 1 B a weight + 4 B per output channel, the rest bf16
    lora         rank*(in+out) per targeted Linear, fp32; gradients the same
    optimizer    per LoRA param: adamw 8 B (exp_avg, exp_avg_sq), adamw8bit 2 B
                 (bitsandbytes; block scales ignored), prodigy 16 B (exp_avg,
                 exp_avg_sq, s, p0; p0 of a zero lora_B is a scalar, so ~14 B real);
                 adafactor 4 B x (rows + cols) per LoRA matrix (torch.optim.Adafactor:
                 factored second moment, no momentum); lion 4 B (one moment); came 4 B +
                 8 B x (rows + cols) per matrix; schedulefree 8 B (z, exp_avg_sq);
                 adamw8bit_torchao 2 B (common.STATE_BYTES)
    activations  what autograd keeps: the block model below
    workspace    1 GiB (CUDA context, cuBLAS workspace, allocator slack) + 2x the
                 widest Linear output (it and its gradient in backward) + for fp8
                 bases the largest weight upcast to bf16 on use; for int8 bases the widest
                 Linear's int32 product and its fp32 rescale

Tokens: one per (latent_downscale x patch)^2 pixels of the (square, worst-case) bucket, read from
the arch (16x16 px in every family so far: Flux2 latent /16, patch 1; Z-Image latent /8, patch 2),
padded as the model pads them (Layout.token_multiple: Z-Image 32), plus the variant's text tokens
(512: Flux2 pads context to 512; for Z-Image 512 caption tokens is an upper bound).

Block model: bytes autograd keeps per token, read with saved_tensors_hooks from
ComfyUI 0.17's own full-size blocks on CUDA with Kiln's LoRA on every block
Linear under bf16 autocast. D = hidden, M = MLP hidden. What the readings showed,
and the rules a family's tally follows: a frozen base Linear keeps only its
weight; each LoRA branch keeps its bf16 input (measured when every branch kept
its own copy; since the branch uses the input as it comes, Linears sharing one
input share it, so Z-Image's w1/w3 term counts D per token more than autograd
now keeps: a conservative ~4 % of a Z-Image block); a LayerNorm under autocast
keeps an fp32 copy of its input; a q/k RMSNorm keeps its input (in Flux2 and
Z-Image a view that keeps the whole fused qkv output alive); SDPA keeps q, k, v
and its output; a GLU keeps both halves, the activation's output and the
product. Each family's tally is the docstring of `blocks` in its arch file
(trainer/archs/<family>.py): Flux2 double 10D + 4M (+ 2D fp32) and single
8D + 4M (+ 1D fp32), Z-Image 15D + 4M, measured; newer families derived by
these rules until measured (their docstrings say so).
Without checkpointing every block keeps all of this; with per-block
checkpointing each block keeps only its input (D per token) and one block's
internals are rebuilt at a time in backward. The final layer adds 2D per image
token. Not counted: the RoPE table (shared), the rank-r LoRA hiddens, EMA (one
more LoRA copy). Fewer targets save up to ~1D per token per untargeted Linear;
mixed_precision "no" keeps the same tensors in fp32.

Checked on an H200 (torch 2.11, ComfyUI 0.17 models with random weights, Kiln's LoRA, AdamW, one
step): totals within -7%..+9% of peak reserved memory plus context for Klein 4B/9B and Z-Image at
512 and 1024 px, checkpointing on and off (low end: Z-Image without checkpointing, allocator slack).
"""

from __future__ import annotations

from ..archs.layout import ModelDims
from . import full_step
from .common import (
    ACTIVATION_BYTES,
    BASE_DTYPE_BYTES,
    GIB,
    INT8_SCALE_BYTES,
    PRESERVATION_NOTE,
    Estimate,
    block_bytes,
    check_settings,
    get_dims,
    image_token_count,
    kept_by_last_blocks,
    latent_frames,
    layout_of,
    linear_layers,
    lora_shapes,
    param_count,
    preservation_rows,
    trainable_costs,
    widest_output,
)

CUDA_CONTEXT_BYTES = GIB  # context (~0.25 GiB on an H200, more beside a desktop) + slack
PRODIGY_NOTE = "prodigy counted at 16 B/param; its p0 of the zero-initialised lora_B is a scalar (~14 B real)"
BUDGET_KEPT = 0.6  # share of checkpointing's savings a compiled block keeps per unit of checkpoint_budget


def _activations(
    dims: ModelDims,
    image_tokens: int,
    text_tokens: int,
    act: int,
    checkpointing: bool,
    skip: int = 0,
    offload: bool = False,
) -> int:
    D = dims.hidden
    groups = block_bytes(dims, image_tokens, text_tokens, act)
    head = 2 * D * act * image_tokens  # final layer: norm input and modulated output
    if not checkpointing:
        return sum(per_token * n * t for per_token, n, t in groups) + head
    inputs = [t * D * act for _, n, t in groups for _ in range(n)]  # each block's input
    # offload_activations: the inputs wait on the host; two on the GPU (the one coming back, the one going out)
    boundaries = sum(sorted(inputs)[-2:]) if offload else sum(inputs)
    kept = kept_by_last_blocks([(per_token * t, n) for per_token, n, t in groups], skip)
    return boundaries + kept + max(per_token * t for per_token, _, t in groups) + head


def estimate(
    variant: str | ModelDims,
    *,
    resolution: int,
    batch_size: int = 1,
    rank: int = 32,
    targets: tuple[str, ...] | None = None,
    optimizer: str = "adamw",
    gradient_checkpointing: bool = True,
    base_dtype: str = "bf16",
    mixed_precision: str = "bf16",
    skip_checkpoint_blocks: int = 0,
    checkpoint_budget: float = 0.0,
    preservation: bool = False,
    fp8_compute: bool = False,
    reference_images: int = 0,
    adapter: str = "lora",
    lokr_factor: int = -1,
    lokr_full_w2: bool = False,
    stream_blocks: int = 0,
    frames: int = 1,
    offload_activations: bool = False,
    ema: bool = False,
    shards: int = 1,
) -> Estimate:
    """Bytes one training step needs at square `resolution` (the largest bucket) and `frames` video frames
    (an image: 1). `preservation`: DOP on.
    reference_images: edit training's control images per sample, each cropped to the target's bucket, so
    each adds the target's image tokens to the joint sequence (their loss is not computed, their
    activations are kept). adapter: the kind (trainer/lora/adapters.py) with its LoKr settings, or full (every weight
    trained: full_step.py; `ema` counts its fp32 shadow). shards: the ranks a base under sharding shard is split
    over (a full run's gradients, optimizer state and EMA too)."""
    settings = dict(locals())  # every argument by name, first thing: advice re-estimates with a few changed
    dims = get_dims(variant)
    side = check_settings(dims, resolution, batch_size, rank, optimizer, base_dtype, mixed_precision)
    rows = preservation_rows(batch_size, preservation)
    image_tokens = image_token_count(dims, resolution, side) * (1 + reference_images)  # target + references
    image_tokens *= latent_frames(dims, frames)  # a clip's tokens: (h/2)(w/2) per latent frame
    text_tokens, act = dims.context_tokens, ACTIVATION_BYTES[mixed_precision]
    tokens = rows * (image_tokens + text_tokens)
    shapes = lora_shapes(dims, targets)
    lora_params, optimizer_bytes, adapter_workspace, adapter_note = trainable_costs(settings, dims, shapes, tokens, act)
    activations = _kept(settings, dims, rows, image_tokens, text_tokens, act)
    notes = _notes(dims, image_tokens, text_tokens, reference_images, preservation)
    notes += [adapter_note] if adapter_note else []
    notes += [PRODIGY_NOTE] if optimizer == "prodigy" else []
    weights, stream_note = _on_the_gpu(dims, base_dtype, stream_blocks, shards)
    blocks, workspace = block_weight_bytes(dims, base_dtype), _workspace(dims, tokens, act, base_dtype)
    if adapter == "full":  # every weight trained (full_step.py)
        return full_step.full_estimate(settings, dims, activations, workspace, tokens, notes, blocks)
    return Estimate.summed(
        weights=full_step.on_each_rank(_weights(dims, base_dtype, fp8_compute) - weights, blocks, shards),
        lora_params=lora_params,
        optimizer=optimizer_bytes,
        activations=activations,
        workspace=workspace + adapter_workspace,
        tokens=tokens,
        notes=notes + stream_note,
        settings=settings,
    )


def _kept(s: dict, dims: ModelDims, rows: int, image_tokens: int, text_tokens: int, act: int) -> int:
    """What autograd keeps over the step's rows (the block model), with checkpoint_budget's share kept on top."""
    kept = rows * _activations(
        dims,
        image_tokens,
        text_tokens,
        act,
        s["gradient_checkpointing"],
        s["skip_checkpoint_blocks"],
        s["offload_activations"],
    )
    if s["gradient_checkpointing"] and s["checkpoint_budget"] > 0:
        kept += _budget_kept(
            rows * _activations(dims, image_tokens, text_tokens, act, False), kept, s["checkpoint_budget"]
        )
    return kept


def _on_the_gpu(dims: ModelDims, base_dtype: str, stream_blocks: int, shards: int = 1) -> tuple[int, list[str]]:
    """(bytes the stream takes off the GPU: the streamed blocks less the ring, its note). A sharded base (shards
    > 1): those blocks' shards wait on the host, and FSDP2 gathers them into the block on_each_rank counts."""
    if not stream_blocks:
        return 0, []
    streamed, ring = streamed_bytes(dims, base_dtype, stream_blocks)
    if shards > 1:
        return streamed, [
            f"{stream_blocks} blocks' shards in pinned host memory (FSDP2's CPU offload: {streamed / GIB:.2f} GiB "
            f"over the {shards} ranks), {2 * streamed / shards / 1e9:.1f} GB copied host→GPU a step on each GPU"
        ]
    return streamed - ring, [
        f"{stream_blocks} blocks streamed: {streamed / GIB:.2f} GiB of the base in pinned host memory, a ring of "
        f"{ring / GIB:.2f} GiB on the GPU, {2 * streamed / 1e9:.1f} GB copied host→GPU a step"
    ]


def _weights(dims: ModelDims, base_dtype: str, fp8_compute: bool) -> int:
    """The frozen base in its dtype, and with fp8_compute an fp8 copy per product (none for an fp8-stored base)."""
    if base_dtype == "int8":  # only the blocks' Linears are quantized (int8.py); the rest stays bf16
        block = [(i, o) for name, (i, o) in linear_layers(dims).items() if _in_block(name)]
        return param_count(dims) * 2 - sum(i * o for i, o in block) + sum(o for _, o in block) * INT8_SCALE_BYTES
    weights = param_count(dims) * BASE_DTYPE_BYTES[base_dtype]
    if fp8_compute and base_dtype != "fp8":
        from ..backends.torch_backend.fp8 import fp8_products

        weights += sum(i * o * sum(fp8_products(i, o)) for i, o in linear_layers(dims).values())
    return weights


def block_weight_bytes(dims: ModelDims, base_dtype: str) -> list[int]:
    """Each block's frozen Linear weights in bytes, blocks in the order the model lists them (<list>.<i>)."""
    blocks: dict[str, int] = {}
    for name, (i, o) in linear_layers(dims).items():
        if _in_block(name):
            key = ".".join(name.split(".")[:2])
            blocks[key] = blocks.get(key, 0) + i * o * BASE_DTYPE_BYTES[base_dtype]  # int8's scales stay resident
    return list(blocks.values())


def _in_block(name: str) -> bool:
    """A Linear of a block list (<list>.<i>.<...>)."""
    parts = name.split(".")
    return len(parts) > 2 and parts[1].isdigit()


def streamed_bytes(dims: ModelDims, base_dtype: str, count: int) -> tuple[int, int]:
    """(bytes that stream, the GPU ring's bytes) with `count` blocks streamed as the backend picks them."""
    from ..backends.torch_backend.streaming import SLOTS, spread

    sizes = block_weight_bytes(dims, base_dtype)
    chosen = [sizes[i] for i in spread(count, len(sizes))]
    return sum(chosen), min(SLOTS, len(chosen)) * max(chosen, default=0)


def _budget_kept(kept_all: int, checkpointed: int, budget: float) -> int:
    """What compiled blocks under checkpoint_budget keep beyond plain checkpointing's activations."""
    # 0.6 x the budget's share of what checkpointing saves (eager): measured on an H100 (Z-Image
    # 1024 px, bench/RESULTS.md) compiled blocks kept 0.02-0.44 of it at budgets 0.1-0.8, under
    # 0.6 x budget each time (this estimate 3-14 % above those peaks).
    return int(BUDGET_KEPT * budget * max(0, kept_all - checkpointed))


def _workspace(dims: ModelDims, tokens: int, act: int, base_dtype: str) -> int:
    """CUDA context and slack, the widest Linear output and its gradient, and an fp8 base's bf16 upcast."""
    workspace = CUDA_CONTEXT_BYTES + 2 * widest_output(dims) * tokens * act
    if base_dtype == "fp8":
        workspace += 2 * max(i * o for i, o in linear_layers(dims).values())
    if base_dtype == "int8":
        workspace += 2 * widest_output(dims) * tokens * 4
    return workspace


def _notes(
    dims: ModelDims, image_tokens: int, text_tokens: int, reference_images: int, preservation: bool
) -> list[str]:
    layout = layout_of(dims)
    notes = [
        f"{image_tokens} image + {text_tokens} text tokens per sample"
        + layout.text_note
        + (f" ({reference_images} reference image{'s' * (reference_images > 1)} included)" if reference_images else ""),
        "diffusion model only: text encoder and VAE cached or offloaded",
        "an estimate: measured peaks on an H200 fell within -7%..+9% of it"
        if layout.measured
        else f"an estimate: the {layout.name} block model is derived, not yet checked against a GPU's peak",
    ]
    return notes + [PRESERVATION_NOTE] if preservation else notes


# checkpoint_budget "auto" (trainer/backends/torch_backend/levers.py, and `estimate --memory-gb`): the
# largest of these whose step fits the free memory less the margin; the margin covers a validation
# sample's VAE decode and the allocator, and at least this estimate's own error (−7…+9 %).
AUTO_BUDGETS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
AUTO_MARGIN_BYTES, AUTO_MARGIN_SHARE = 4 * 2**30, 0.10
# What a budgeted step is taken to need: the estimate beside the weights times this. On an H100 the
# measured need at budget 1 was 10-18 % above the estimate (Z-Image, Klein 4B, Klein 9B), and Flux2 Dev
# on an fp8 base ran out of memory at 0.7 where the estimate left 11 GiB (bench/RESULTS.md).
AUTO_SAFETY = 1.25


def auto_margin(total_bytes: int) -> int:
    return max(AUTO_MARGIN_BYTES, int(AUTO_MARGIN_SHARE * total_bytes))


def largest_budget(step_bytes, available: int) -> float:
    """The largest AUTO_BUDGETS entry b with AUTO_SAFETY x step_bytes(b) <= available (bytes beyond the
    resident weights), else 0 (plain checkpointing)."""
    return next((b for b in AUTO_BUDGETS if AUTO_SAFETY * step_bytes(b) <= available), 0.0)


def budget_on(step_at, memory: int) -> float:
    """checkpoint_budget auto on a GPU of `memory` bytes, as a run picks it: `step_at(budget)` is the step's
    Estimate at a budget; the largest whose step beside the weights leaves auto_margin free."""
    beside = lambda budget: (lambda step: step.total - step.weights)(step_at(budget))  # noqa: E731
    return largest_budget(beside, memory - step_at(0.0).weights - auto_margin(memory))


# step_graphs "auto" (torch_backend/step_graphs.py, levers.py): steps of at most this many image pixels (a
# 768 px image; batch rows count) are recorded as CUDA graphs. From 768 px up the GPU's work already hides the
# host's (H200, Klein 4B 768 px: 0.091 s/step with and without), so recording larger steps would only grow the pool.
GRAPH_MAX_PIXELS = 800 * 800
# The graphs' shared memory pool, as a multiple of the largest recorded step's estimate: one shape's pool
# was its estimate (Klein 4B 768 px: +8.0 GiB reserved for 7.8 estimated), but the 14 shapes of a mixed
# 512/768 px run fragment it (+14.0 GiB reserved, H200, bench/RESULTS.md).
GRAPH_POOL_FACTOR = 2.0


# stream_blocks "auto" (torch_backend/memory_plan.py, and `estimate --memory-gb`'s card plan): the step beside
# the resident weights, times AUTO_SAFETY, must leave this margin of the card (allocator slack, a sample's decode).
STREAM_MARGIN_BYTES, STREAM_MARGIN_SHARE = GIB, 0.05


def stream_margin(total_bytes: int) -> int:
    return max(STREAM_MARGIN_BYTES, int(STREAM_MARGIN_SHARE * total_bytes))


def step_room(need: int, total: int) -> int:
    """The GPU bytes stream_blocks auto keeps for a step needing `need` beside the weights on a GPU of `total`."""
    return int(AUTO_SAFETY * need) + stream_margin(total)


def step_fits(need: int, available: int, total: int) -> bool:
    """Whether stream_blocks auto takes a step needing `need` bytes beside the weights as fitting in `available`
    bytes of a GPU of `total`."""
    return step_room(need, total) <= available


def runs_in(step: Estimate, memory: int) -> bool:
    """step_fits for an estimate on a GPU of `memory` bytes, every weight it counts resident."""
    return step_fits(step.total - step.weights, memory - step.weights, memory)


def graph_resolution(resolutions, batch_size: int) -> int | None:
    """The square resolution whose step stands for the largest recorded one (the pool's size), or None where
    every bucket's step is larger than GRAPH_MAX_PIXELS (then no step is recorded)."""
    if min(resolutions) ** 2 * batch_size > GRAPH_MAX_PIXELS:
        return None
    return min(max(resolutions), int((GRAPH_MAX_PIXELS / max(1, batch_size)) ** 0.5))
