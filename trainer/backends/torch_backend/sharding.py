"""Several ranks: the frozen base whole on every rank (replicate), or its blocks split over the ranks (shard).

shard puts each block of the base under FSDP2 (`torch.distributed.fsdp.fully_shard`, one unit per block, no
flattening: a block's parameters stay its own, which a full fine-tune can shard the same way): a rank keeps
1/N of each block's weights and all-gathers a block just before its forward (and again before its backward,
resharding after each), so a base larger than one card trains across several. Nothing may keep a block's original
Parameters: FSDP2 moves a host block's weights to the GPU before it cuts them, and a kept original keeps that whole
weight there (the backend records requires_grad by name). The LoRA branches are not
submodules of the model (lora.py hooks a Linear's forward), so FSDP never sees them: they stay whole on every
rank under DDP (trainer/run/distributed.data_parallel), and optimizer, EMA, checkpoints and resume are the
replicated run's, unchanged. The base is frozen, so FSDP reduces no gradient: its traffic is all-gathers only.

auto shards where the memory plan found the base does not fit one card beside the step (it would stream
blocks from the host), else replicates; one process never shards. Validation samples keep the base whole:
rank 0 samples alone while the others wait, and a sharded block's forward needs every rank's all-gather. Sharding and
streaming are two answers to the same shortage, and they compose: where a rank's 1/N of the base still leaves the
step no room, the fewest blocks keep their shards in pinned host memory (FSDP2's CPU offload) instead of streaming
through Kiln's ring (memory_plan.split).

A full fine-tune (adapter full) trains the blocks' own weights: shard puts each block AND the root (the embedders,
the final layer) under FSDP2, so each rank keeps 1/N of every weight, its gradient (reduce-scattered, averaged
over the ranks as DDP would) and its optimizer state (the optimizer is built over the sharded DTensor
parameters); EMA shadows the shards. A checkpoint gathers them whole on every rank (`gathered`) and rank 0 writes
one process's layout, so a resume cuts its shards again. auto shards a full run where one card cannot hold the
weights, their gradients, the optimizer state and EMA (`full_bytes`); replicate keeps the whole model on each rank
under DDP.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import nn

from ...config import AUTO, ConfigError, TrainConfig
from ...run import distributed
from . import full, memory_plan
from .memory_plan import GIB, MemoryPlan

log = logging.getLogger("kiln")


def decide(cfg: TrainConfig, plan: MemoryPlan, quantized: bool, need: int = 0) -> tuple[bool, str]:
    """(shard the base?, the log line saying what sharding chose and why; "" on one process)."""
    world = distributed.current().world
    if world == 1:
        return False, ""
    if cfg.adapter == full.FULL:
        return _decide_full(cfg, plan, world, need)
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
    if quantized and cfg.sharding == AUTO:  # FSDP2 cuts bf16/fp32 weights; a quantized base streams instead
        return False, (
            "sharding auto → replicate, the base streaming instead: it is quantized (base_quantize int8 or "
            "fp8_compute), and shard splits a bf16/fp32 base"
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
            "set stream_blocks auto (a sharded run keeps the fewest blocks' shards on the host where the step needs "
            "it) or sharding replicate"
        )
    why = "the base does not fit one card beside the step" if cfg.sharding == AUTO else "as set"
    return True, (
        f"sharding {cfg.sharding}{' → shard' if cfg.sharding == AUTO else ''} ({why}): the {plan.blocks} blocks "
        f"({base:.1f} GiB) split over {world} ranks, ~{base / world:.1f} GiB each, gathered one block at a time"
    )


def full_bytes(params: list[nn.Parameter], cfg: TrainConfig) -> int:
    """A full run's resident training state: the weights, their gradients (the weights' dtype), the optimizer's
    state (the estimate's own count: 2-D weights factored where adafactor and came factor them) and the fp32 EMA
    shadow where EMA is on."""
    from ...estimate.common import state_bytes

    weights = sum(p.numel() * p.element_size() for p in params)
    count = sum(p.numel() for p in params)
    shapes = [(p.shape[0], p.numel() // p.shape[0]) if p.dim() >= 2 else (1, p.numel()) for p in params]
    return 2 * weights + state_bytes(cfg.optimizer, shapes) + count * (4 if cfg.ema else 0)


def _decide_full(cfg: TrainConfig, plan: MemoryPlan, world: int, need: int) -> tuple[bool, str]:
    """A full fine-tune: shard as set, or (auto) where the training state does not fit the card's free memory."""
    state, free = need / GIB, (plan.free_and_total or (None, None))[0]
    if cfg.sharding == "replicate" or (cfg.sharding == AUTO and (free is None or need <= free)):
        why = "as set" if cfg.sharding == "replicate" else "it fits one card"
        return False, (
            f"sharding {cfg.sharding} (full fine-tune, {why}): the whole model, {state:.1f} GiB of weights, "
            f"gradients and optimizer state, on each of {world} ranks"
        )
    if cfg.sample_prompts:
        raise ConfigError(
            "a full fine-tune sharded over the ranks cannot sample sample_prompts on rank 0 alone: leave "
            "sample_prompts empty (sample the saved model), or set sharding replicate"
        )
    why = "it does not fit one card" if cfg.sharding == AUTO else "as set"
    return True, (
        f"sharding {cfg.sharding}{' → shard' if cfg.sharding == AUTO else ''} (full fine-tune, {why}): weights, "
        f"gradients and optimizer state ({state:.1f} GiB) split over {world} ranks, ~{state / world:.1f} GiB each"
    )


def shard_blocks(
    blocks: list[nn.Module],
    device: torch.device,
    root: nn.Module | None = None,
    on_host: tuple[int, ...] = (),
    loaded: tuple[int, ...] = (),
) -> None:
    """Each block an FSDP2 unit over all ranks; its shard on `device`, or (the blocks numbered in `on_host`) in
    pinned host memory, copied to the GPU for each all-gather (FSDP2's CPUOffloadPolicy). `loaded`: each block's
    bytes a loader already put on the GPU (the memory plan's on_device). Each block is a root of
    its own (the model's forward is ComfyUI's, not ours to wrap), so every block reshards after its forward
    explicitly (a root would keep its gathered weights otherwise). No explicit prefetch: across roots it fails
    (each root has its own communication context, torch 2.13), so a block's all-gather runs when its forward
    starts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (distributed.current().world,))
    # blocks already on the GPU first (ComfyUI's partial load left them whole: cutting them frees (N-1)/N), then
    # those on the host (FSDP2 moves each whole to the GPU before it cuts it): the GPU never holds more than the
    # plan's end state and one whole block
    for i in sorted(range(len(blocks)), key=lambda i: not (loaded and loaded[i])):
        block = blocks[i]
        # pinned where a GPU copies from it (a CPU-only build cannot pin; the CPU tests offload unpinned)
        policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if i in on_host else OffloadPolicy()
        fully_shard(block, mesh=mesh, reshard_after_forward=True, offload_policy=policy)
    if root is not None:  # a full fine-tune: the root's own weights (embedders, final layer) sharded too
        fully_shard(root, mesh=mesh, reshard_after_forward=True)


def local_bytes(blocks: list[nn.Module]) -> tuple[int, int]:
    """(this rank's bytes of the blocks' weights, the whole weights' bytes): a sharded weight counts its shard."""
    held = whole = 0
    for block in blocks:
        for param in block.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            held += local.numel() * local.element_size()
            whole += param.numel() * param.element_size()
    return held, whole


def place(
    cfg: TrainConfig,
    plan: MemoryPlan,
    blocks: list[nn.Module],
    device: torch.device,
    quantized: bool,
    trained,
    model: nn.Module,
):
    """The memory plan after the sharding decision: a sharded base's (memory_plan.split: 1/N of each block on
    each rank, the fewest blocks' shards on the host where even that leaves the step no room), or `plan` itself.
    `trained`: a full fine-tune's FullSet (its model's root is sharded with the blocks; nothing on the host: its
    weights train on the GPU)."""
    full_run = isinstance(trained, full.FullSet)
    need = full_bytes([p for _, p in trained.named], cfg) if full_run else 0
    shard, note = decide(cfg, plan, quantized, need)
    if not shard:
        if note:
            log.info("[Kiln] %s", note)
        return plan
    world = distributed.current().world
    if full_run:
        split = replace(plan.with_stream(0, note), shards=world)  # `after` counts 1/N of the base
    else:
        split = memory_plan.split(model, cfg, plan, world, note)
    on_host = tuple(split.chosen) if split.stream else ()
    shard_blocks(blocks, device, trained.model if full_run else None, on_host, split.on_device)
    return split


def is_sharded(params) -> bool:
    return any(hasattr(p, "device_mesh") for p in params)


def clip_global_norm(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """optim.clip_global_norm for sharded gradients: the squares of each rank's shards summed over the ranks."""
    import torch.distributed as dist

    shards = [full.local(g) for g in grads]
    squares = torch.stack(torch._foreach_norm(shards)).square().sum() if shards else torch.zeros(())
    dist.all_reduce(squares)
    total = squares.sqrt()
    if max_norm > 0:
        torch._foreach_mul_(shards, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


class Gathered:
    """What a checkpoint reads of a backend whose full fine-tune is sharded, gathered whole on every rank
    (all-gathers: every rank builds it; rank 0 alone writes it): one process's layout, resumable on N ranks."""

    def __init__(self, backend):
        self.name = backend.name
        self.lora_state, self.rng_state = backend.lora_state, backend.rng_state
        held = backend.full_state(), backend.ema_state(), backend.optimizer_state()
        self.full_state, self.ema_state, self.optimizer_state = (lambda value=v: value for v in held)


def gathered(backend):
    """`backend` itself, or (a sharded full fine-tune) its state gathered whole: see Gathered."""
    return Gathered(backend) if backend.sharded else backend


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After a resume loaded whole tensors: each state tensor shaped as its DTensor parameter cut to its shard."""
    for param, entries in optimizer.state.items():
        for key, value in entries.items():
            whole = torch.is_tensor(value) and not hasattr(value, "device_mesh") and value.shape == param.shape
            if hasattr(param, "device_mesh") and whole:
                entries[key] = full.shard_like(param, value, value.dtype)
