"""What to change where a torch step does not fit (`python -m trainer estimate`): the advice, cheapest in quality
first, and the fewest blocks kept in host memory (streamed through a ring on one GPU; under sharding shard, their
shards offloaded), on top of torch_step's estimate."""

from __future__ import annotations

from .common import GIB, Estimate, EstimatorRules, get_dims, ordered_advice
from .torch_step import block_weight_bytes, estimate, streamed_bytes


def advice(settings: dict) -> list[tuple[str, dict]]:
    """Changes that lower GPU memory, cheapest in quality first."""
    return ordered_advice(
        settings,
        [
            (
                "optimizer adamw8bit (bitsandbytes)",
                {"optimizer": "adamw8bit"},
                settings["optimizer"] in ("adamw", "prodigy"),
            ),
            (
                "base weights fp8",
                {"base_dtype": "fp8"},
                # a full run trains them; sharding shard splits a bf16/fp32 base only
                settings["base_dtype"] not in ("fp8", "int8")
                and settings.get("adapter") != "full"
                and settings.get("shards", 1) == 1,
            ),
            ("batch size 1 (raise grad_accum instead)", {"batch_size": 1}, settings["batch_size"] > 1),
            ("fp8_compute off (its fp8 weight copies)", {"fp8_compute": False}, settings.get("fp8_compute", False)),
        ],
    )


def fewest_streamed(settings: dict, budget: float, fits=None) -> tuple[int, Estimate] | None:
    """(the fewest blocks streamed from host memory beyond the settings' own for the step to fit `budget` bytes,
    its estimate), every other setting kept; None where even every block streamed does not fit. `fits(estimate,
    budget)`: the rule (default: its total within the budget; a run's auto: runs_in)."""
    fits = fits or (lambda step, memory: step.total <= memory)
    arguments = {k: v for k, v in settings.items() if k != "backend"}
    dims = get_dims(arguments["variant"])
    blocks = len(block_weight_bytes(dims, arguments["base_dtype"]))
    for count in range(arguments.get("stream_blocks", 0) + 1, blocks + 1):
        step = estimate(**{**arguments, "stream_blocks": count})
        if fits(step, budget):
            return count, step
    return None


def stream_advice(settings: dict, budget: float) -> str | None:
    """The fewest blocks streamed from host memory (stream_blocks) for the step to fit, every other setting kept.
    None for a full fine-tune: its trained blocks stay on the GPU."""
    found = None if settings.get("adapter") == "full" else fewest_streamed(settings, budget)
    if found is None:
        return None
    (count, step), dims = found, get_dims(settings["variant"])
    blocks = len(block_weight_bytes(dims, settings["base_dtype"]))
    streamed, _ = streamed_bytes(dims, settings["base_dtype"], count)
    if settings.get("shards", 1) > 1:  # a stream_blocks number is refused beside sharding shard; auto does this
        return (
            f"  or, every other setting kept: {count} of {blocks} blocks' shards in pinned host memory (what "
            f"stream_blocks auto does beside sharding shard; {streamed / GIB:.1f} GiB of RAM over the ranks): "
            f"{step.total / GIB:.1f} GiB (fits)"
        )
    return (
        f"  or, every other setting kept: stream_blocks {count} ({count} of {blocks} blocks from pinned host "
        f"memory, {streamed / GIB:.1f} GiB of RAM; slower only where the copies outrun the compute): "
        f"{step.total / GIB:.1f} GiB (fits)"
    )


# estimate_common.backend_rules("torch"): a GPU's memory is all usable, in GiB as nvidia-smi shows it.
RULES = EstimatorRules(estimate, advice, lambda gb: gb, lambda gb, usable: f"{gb:g} GiB", stream_advice)
