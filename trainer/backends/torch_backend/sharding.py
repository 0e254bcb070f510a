"""Several ranks: the frozen base whole on every rank (replicate), or its blocks split over the ranks (shard).

shard puts each block of the base under FSDP2 (`torch.distributed.fsdp.fully_shard`, one unit per block, no
flattening: a block's parameters stay its own, which a full fine-tune can shard the same way): a rank keeps
1/N of each block's weights and all-gathers a block just before its forward (and again before its backward,
resharding after each), so a base larger than one card trains across several. The LoRA branches are not
submodules of the model (lora.py hooks a Linear's forward), so FSDP never sees them: they stay whole on every
rank under DDP (trainer/run/distributed.data_parallel), and optimizer, EMA, checkpoints and resume are the
replicated run's, unchanged. The base is frozen, so FSDP reduces no gradient: its traffic is all-gathers only.

auto shards where the memory plan found the base does not fit one card beside the step (it would stream
blocks from the host), else replicates; one process never shards. Validation samples keep the base whole:
rank 0 samples alone while the others wait, and a sharded block's forward needs every rank's all-gather. Sharding and streaming are two answers to
the same shortage: a sharded run streams nothing.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ...config import AUTO, ConfigError, TrainConfig
from ...run import distributed
from .memory_plan import GIB, MemoryPlan

log = logging.getLogger("kiln")


def decide(cfg: TrainConfig, plan: MemoryPlan, quantized: bool) -> tuple[bool, str]:
    """(shard the base?, the log line saying what sharding chose and why; "" on one process)."""
    world = distributed.current().world
    if world == 1:
        return False, ""
    base = sum(plan.sizes) / GIB
    if cfg.sharding == "replicate":
        return False, f"sharding replicate: the whole base ({base:.1f} GiB of blocks) on each of {world} ranks"
    if cfg.sharding == AUTO and not plan.stream:
        return False, f"sharding auto → replicate (the base, {base:.1f} GiB of blocks, fits one card beside the step)"
    if cfg.sharding == AUTO and cfg.sample_prompts:  # shard itself refuses them (trainer/config/checks.py)
        return False, (
            "sharding auto → replicate, the base streaming instead: rank 0 samples sample_prompts alone, which a "
            "sharded base cannot (leave sample_prompts empty to shard it)"
        )
    if quantized:
        raise ConfigError(
            "sharding shard splits a bf16/fp32 base over the GPUs; the quantized base (base_quantize int8, or "
            "fp8_compute) is not sharded: set base_quantize none and fp8_compute off, or sharding replicate"
        )
    if cfg.cuda_graphs:
        raise ConfigError(
            "cuda_graphs replays each compiled block with its weights where they lay when recorded, and a sharded "
            "block gathers its weights anew each step: turn cuda_graphs off, or set sharding replicate"
        )
    if cfg.stream_blocks not in (AUTO, 0):
        raise ConfigError(
            f"stream_blocks {cfg.stream_blocks} and sharding shard both answer a base too large for one card: "
            "set stream_blocks auto (a sharded run streams nothing) or sharding replicate"
        )
    why = "the base does not fit one card beside the step" if cfg.sharding == AUTO else "as set"
    return True, (
        f"sharding {cfg.sharding}{' → shard' if cfg.sharding == AUTO else ''} ({why}): the {plan.blocks} blocks "
        f"({base:.1f} GiB) split over {world} ranks, ~{base / world:.1f} GiB each, gathered one block at a time"
    )


def shard_blocks(blocks: list[nn.Module], device: torch.device) -> None:
    """Each block an FSDP2 unit over all ranks; its shard on `device`. Each block is a root of its own (the
    model's forward is ComfyUI's, not ours to wrap), so every block reshards after its forward explicitly
    (a root would keep its gathered weights otherwise). No explicit prefetch: across roots it fails (each root
    has its own communication context, torch 2.13), so a block's all-gather runs when its forward starts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (distributed.current().world,))
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)


def local_bytes(blocks: list[nn.Module]) -> tuple[int, int]:
    """(this rank's bytes of the blocks' weights, the whole weights' bytes): a sharded weight counts its shard."""
    held = whole = 0
    for block in blocks:
        for param in block.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            held += local.numel() * local.element_size()
            whole += param.numel() * param.element_size()
    return held, whole


def place(cfg: TrainConfig, plan: MemoryPlan, blocks: list[nn.Module], device: torch.device, quantized: bool):
    """The memory plan after the sharding decision: a sharded base's (nothing streams), or `plan` itself."""
    shard, note = decide(cfg, plan, quantized)
    if not shard:
        if note:
            log.info("[Kiln] %s", note)
        return plan
    shard_blocks(blocks, device)
    return plan.with_stream(0, note)
