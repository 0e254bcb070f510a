"""What a full fine-tune (adapter full, trainer/backends/torch_backend/full.py) holds beside a LoRA step's
activations, per GPU, and what a base sharded over the ranks (sharding shard, `shards` ranks) leaves on each.

    weights      every weight of the model, trained, in the base dtype (bf16 2 B), 1/N of it under shard
    EMA          the fp32 shadow of every weight (4 B) where ema is on, 1/N under shard
    gradients    one per weight in the weights' dtype (bf16 2 B), 1/N under shard (FSDP2 reduce-scatters them)
    optimizer    per weight (common.STATE_BYTES: adamw 8 B, adamw8bit 2 B, lion 4 B ...), 1/N under shard
    step         at the optimizer step the activations are gone, and two things are held instead: bf16 weights are
                 updated on fp32 copies of them and of their gradients, stochastically rounded back (full.py:
                 4 + 4 − 2 = 6 B a weight), and a foreach optimizer's step makes one fp32 temporary per weight
                 (AdamW's sqrt of exp_avg_sq: 4 B); an optimizer that steps each weight alone steps them a chunk
                 (STEP_CHUNK_WEIGHTS) at a time, so that much is held for one chunk only (prodigy and schedulefree
                 read every weight in one step: for all of them); the larger of that and the forward's workspace
                 counts
    gathered     under shard, one block's weights whole while it computes (FSDP2's all-gather), in the workspace

A sharded LoRA run (the frozen base split, the LoRA whole on every rank) counts 1/N of the base and the gathered
block the same way.
"""

from __future__ import annotations

from ..archs.layout import ModelDims
from .common import BASE_DTYPE_BYTES, GIB, STATE_BYTES, Estimate, state_bytes
from .variants import linear_layers, param_count

ROUNDING_BYTES = 6  # bf16 weights: the fp32 copies of a weight and its gradient during the step, less the bf16 grad
STEP_TEMPORARY_BYTES = 4  # a foreach optimizer's fp32 temporary per weight during its step
# Weights stepped together on fp32 copies (full.round_bf16_updates): ~2.5 GiB of copies and temporaries at a time,
# a few dozen optimizer calls a step for a 6 B-weight model (each a multi-tensor kernel or two: no slower).
STEP_CHUNK_WEIGHTS = 1 << 28
# Optimizers whose step reads every weight at once (Prodigy's step size from sums over all of them, schedule-free's
# averaging weights per step): stepped whole, never a chunk at a time.
WHOLE_STEP = ("prodigy", "schedulefree")


def step_chunk(optimizer: str) -> int | None:
    """How many weights the optimizer steps at once on fp32 copies (None: all of them)."""
    return None if optimizer in WHOLE_STEP else STEP_CHUNK_WEIGHTS


def full_state(dims: ModelDims, optimizer: str, base_dtype: str, ema: bool, shards: int) -> dict[str, int]:
    """A full run's resident bytes per GPU by part (weights, ema, gradients, optimizer) and the optimizer step's
    transient (step); `shards`: the ranks they are split over (1: one GPU, or sharding replicate)."""
    weights, per = param_count(dims), BASE_DTYPE_BYTES[base_dtype]
    shapes = list(linear_layers(dims).values())
    matrices = sum(i * o for i, o in shapes)
    # the Linears' weights as 2-D tensors (adafactor and came factor them), the rest at the per-entry rate
    optimizer_bytes = state_bytes(optimizer, [(o, i) for i, o in shapes]) + STATE_BYTES[optimizer] * (
        weights - matrices
    )
    step = (ROUNDING_BYTES if base_dtype == "bf16" else 0) + STEP_TEMPORARY_BYTES
    # bf16 weights step a chunk at a time (fp32 ones all at once); a chunk ends at the weight that reaches it
    chunk = step_chunk(optimizer) if base_dtype == "bf16" else None
    stepped = weights // shards if chunk is None else min(weights // shards, chunk + max(i * o for i, o in shapes))
    return {
        "weights": weights * per // shards,
        "ema": 4 * weights // shards if ema else 0,
        "gradients": weights * per // shards,
        "optimizer": optimizer_bytes // shards,
        "step": step * stepped,
    }


# A sharded block's transient on a GPU while it computes: the block FSDP2 gathered whole, and the flat all-gather
# buffer it copies the block out of (freed after the copy). The estimate and the trainer's memory plan both count it.
GATHERED = 2


def on_each_rank(weights: int, block_bytes: list[int], shards: int) -> int:
    """A base's bytes on one GPU: all of it, or under shard its 1/N and the block gathered whole while it computes
    with its all-gather buffer (GATHERED)."""
    return weights if shards <= 1 else weights // shards + GATHERED * max(block_bytes, default=0)


def full_estimate(s: dict, dims, activations: int, workspace: int, tokens: int, notes: list, blocks) -> Estimate:
    """A full fine-tune's step from the estimate's settings `s`: the trained weights, the EMA shadow (the 'LoRA'
    row holds it), the gradients, the optimizer's state, 1/N each under shard; the optimizer step's transient
    where it is larger than the forward's workspace (the activations are freed before it)."""
    if s["fp8_compute"] or s["base_dtype"] in ("fp8", "int8") or s["stream_blocks"]:
        raise ValueError("adapter full trains the base weights: base_dtype bf16 or fp32, no fp8_compute, no streaming")
    shards = s["shards"]
    state = full_state(dims, s["optimizer"], s["base_dtype"], s["ema"], shards)
    weights = on_each_rank(state["weights"] * shards, blocks, shards) if shards > 1 else state["weights"]
    parts = (weights, state["ema"], state["gradients"], state["optimizer"], activations)
    parts += (max(workspace, state["step"] - activations),)
    notes = [n for n in notes if not n.startswith("an estimate:")]  # the LoRA block model's measured range
    return Estimate(
        *parts,
        total=sum(parts),
        lora_params=param_count(dims),
        tokens=tokens,
        notes=notes + full_notes(state, s["optimizer"], shards),
        settings=s,
    )


def full_notes(state: dict[str, int], optimizer: str, shards: int) -> list[str]:
    split = f", each part 1/{shards} per GPU (sharding shard over {shards} ranks)" if shards > 1 else ""
    return [
        f"full fine-tune: every weight trained (weights, their gradients, {optimizer}'s state"
        + (", the EMA shadow in the 'EMA (fp32)' row" if state["ema"] else "")
        + f"){split}",
        f"the optimizer step holds {state['step'] / GIB:.2f} GiB of fp32 copies and temporaries while the "
        "activations are gone: the workspace row is the larger of that and the forward's",
        # bench/RESULTS.md, session 33: fullz2 peaked at 63.4 GiB per GPU against 64.8 estimated at its budget
        (
            "an estimate: checked once against a GPU's peak (Z-Image, AdamW and EMA, sharded over 2 H200s, "
            "checkpoint_budget 1: 63.4 GiB measured, 64.8 estimated)"
        ),
    ]
