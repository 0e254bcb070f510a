"""Where the frozen base lives during a run: which blocks stay on the GPU and which stream from pinned host
memory (streaming.py), decided once at the start, before the first step, and said in one line.

stream_blocks auto, on a CUDA GPU: the fewest blocks (spread over the model) whose streaming leaves the
estimated step (trainer/estimate/torch_step.py at checkpoint budget 0, times AUTO_SAFETY) room beside the
resident weights, less a margin; 0 where the model fits, which costs a resident run nothing. Streaming
never changes what trains (the same products, bitwise on CPU; tests/trainer/backends/torch_backend), only
how fast: so stream_blocks auto streams, and base_quantize auto (`storage`) stores the base in int8 only where
streaming cannot make the run fit (every block streamed and the step still too large, or the host short of RAM
for the pinned copy): rounding the base beats a run that cannot start. A ComfyUI fp8 checkpoint is already small.
checkpoint_budget auto is then decided in the memory the plan leaves (levers.decide gets `after`); a step that
runs out of memory anyway streams more (fallbacks.py).

A weight that streams is kept in pinned host memory: one copy where it was on the GPU (pinned memory cannot
be swapped out, so it must fit the host's free RAM), none where it already lies on the host (ComfyUI's
loaders, its partial loading): it is pinned where it lies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ...config import AUTO, ConfigError, TrainConfig
from ...estimate.full_step import GATHERED
from .streaming import SLOTS, frozen_bytes, frozen_weights, spread

GIB = 2**30
HOST_RESERVE_BYTES = 4 * GIB  # host RAM the plan leaves to the OS, ComfyUI and the data loader
# Device types whose memory is the GPU's own: a Mac's unified memory has nothing to gain from streaming.
STREAMS_ON = ("cuda",)


@dataclass(frozen=True)
class MemoryPlan:
    """What streams (`stream` of the blocks, as streaming.spread picks them) and the bytes it moves."""

    stream: int
    sizes: tuple[int, ...] = ()  # each block's frozen weights in bytes
    on_device: tuple[int, ...] = ()  # of which on the GPU when the plan was made
    slot_sizes: tuple[int, ...] = ()  # each block's in a ring slot (every weight aligned as the allocator would)
    free_and_total: tuple[int, int] | None = None  # the GPU's then (CUDA only)
    note: str = ""  # what auto chose and why ("" when nothing was auto)
    fits: bool = True  # False: auto streamed every block and the estimated step still does not fit
    offload: bool = False  # the blocks' kept inputs wait in pinned host memory (offload_activations)
    shards: int = 1  # sharding shard: the ranks each block is split over (sharding.py); a rank holds 1/shards

    @property
    def blocks(self) -> int:
        return len(self.sizes)

    @property
    def on_host(self) -> list[int]:
        """Blocks whose weights lie mostly on the host (ComfyUI's partial load left them there; CUDA only), most
        first. A block with only a few small Linears there (ComfyUI offloads the smallest modules last) is
        cheaper to bring to the GPU than to stream whole."""
        if self.free_and_total is None:
            return []
        host = [(size - on, i) for i, (size, on) in enumerate(zip(self.sizes, self.on_device)) if 2 * on < size]
        return [i for _, i in sorted(host, key=lambda item: (-item[0], item[1]))]

    @property
    def chosen(self) -> list[int]:
        """The streamed blocks: those on the host first (they stream from where they lie), then the others evenly
        spread (streaming.spread: resident blocks between two streamed ones compute while the next copy runs)."""
        off = self.on_host
        if self.stream <= len(off):
            return sorted(off[: self.stream])
        rest = [i for i in range(self.blocks) if i not in off]
        return sorted(off + [rest[j] for j in spread(self.stream - len(off), len(rest))])

    @property
    def streamed_bytes(self) -> int:
        """The streamed blocks' frozen weights, in pinned host memory."""
        return sum(self.sizes[i] for i in self.chosen)

    @property
    def ring_bytes(self) -> int:
        """The GPU slots they stream through; on a sharded base (shards > 1), whatever streams, the block FSDP2
        gathers whole and its all-gather buffer."""
        if self.shards > 1:
            return GATHERED * max(self.slot_sizes, default=0)
        return min(SLOTS, self.stream) * max((self.slot_sizes[i] for i in self.chosen), default=0)

    @property
    def host_new_bytes(self) -> int:
        """Pinned host memory newly taken: the streamed weights that were on the GPU; on a sharded base, every
        rank's shards of the streamed blocks (the ranks of one host together hold each block once)."""
        if self.shards > 1:
            return sum(self.sizes[i] for i in self.chosen)
        return sum(self.on_device[i] for i in self.chosen)

    @property
    def after(self) -> tuple[int, int] | None:
        """(free, total) GPU bytes once the plan is in place: the streamed weights gone, the others arrived."""
        if self.free_and_total is None:
            return None
        free, total = self.free_and_total
        # a sharded block leaves only its share on this rank's GPU (what lay there whole is freed)
        arriving = sum(
            size // self.shards - on
            for i, (size, on) in enumerate(zip(self.sizes, self.on_device))
            if i not in self.chosen
        )
        freed = sum(self.on_device[i] for i in self.chosen)  # a streamed block's weights leave the GPU
        return free + freed - arriving - self.ring_bytes, total

    def with_stream(self, count: int, note: str = "", fits: bool = True, offload: bool | None = None) -> MemoryPlan:
        offload = self.offload if offload is None else offload
        return replace(self, stream=min(count, self.blocks), note=note, fits=fits, offload=offload)

    def summary(self) -> str:
        """The plan in one line: what sits on the GPU, what streams, the host RAM it takes."""
        resident = sum(self.sizes) - self.streamed_bytes
        kept = "; the blocks' kept inputs in pinned host memory" if self.offload else ""
        if not self.stream:
            where = "on the GPU" if self.free_and_total is not None else "in memory"
            split = f", 1/{self.shards} on each of {self.shards} ranks" if self.shards > 1 else ""
            if not any(self.sizes):  # a full fine-tune: its weights are the trained set's, on the GPU
                return f"no frozen block weights (every weight trains{split}); nothing streams{kept}"
            return f"frozen base {where} ({resident / GIB:.1f} GiB of block weights{split}); nothing streams{kept}"
        if self.shards > 1:
            return (
                f"{self.blocks - self.stream} of {self.blocks} blocks' shards on the GPU ({resident / GIB:.1f} GiB of "
                f"block weights, 1/{self.shards} on each of {self.shards} ranks), {self.stream} blocks' shards in "
                f"pinned host memory ({self.host_new_bytes / GIB:.1f} GiB of RAM over the ranks; FSDP2 copies a "
                "shard to the GPU for each all-gather)" + kept
            )
        return (
            f"{self.blocks - self.stream} of {self.blocks} blocks on the GPU ({resident / GIB:.1f} GiB), "
            f"{self.stream} streamed from pinned host memory ({self.streamed_bytes / GIB:.1f} GiB of RAM, "
            f"{self.host_new_bytes / GIB:.1f} GiB of it new) through a {self.ring_bytes / GIB:.2f} GiB GPU ring" + kept
        )


def arrive(modules: list[nn.Module], device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every parameter and buffer of `modules` (the model, its adapters) still off `device` once the stream holds
    its blocks (a weight ComfyUI's partial load, or a loader, left on the host) moved to it; returns (tensor,
    the host tensor it was) for `leave`: the very tensor goes back (ComfyUI may have pinned it, and tracks it)."""
    if device.type not in STREAMS_ON:
        return []
    moved = []
    for tensor in [t for module in modules for t in (*module.parameters(), *module.buffers())]:
        if tensor.device.type != device.type and not hasattr(tensor, "device_mesh"):  # FSDP2 places its own shards
            moved.append((tensor, tensor.data))
            tensor.data = tensor.data.to(device)
    return moved


def leave(moved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """arrive undone: each tensor its host data again (unchanged: what arrives is frozen, or an adapter removed)."""
    for tensor, host in moved:
        tensor.data = host


def host_available_bytes() -> int | None:
    """RAM the host can still give (Linux's MemAvailable; psutil elsewhere), or None where unknown."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return None


def _bytes_on(tensors, device: torch.device) -> int:
    """The bytes of `tensors` on `device` ("cuda" is every CUDA device's index; "cuda:1" only its own)."""
    return sum(
        t.numel() * t.element_size()
        for t in tensors
        if t.device.type == device.type and device.index in (None, t.device.index)
    )


def decide(
    model: nn.Module,
    cfg: TrainConfig,
    device: torch.device,
    blocks: list[nn.Module],
    free_and_total: tuple[int, int] | None = None,
    host_free: int | None = None,
) -> MemoryPlan:
    """The plan for this run: stream_blocks as set, or auto's choice (above). Raises ConfigError where the
    host lacks the RAM for the pinned copies of what must stream."""
    from . import levers

    cuda = device.type in STREAMS_ON
    weights = [[p for _, p in frozen_weights(block)] for block in blocks]
    plan = MemoryPlan(
        0,
        sizes=tuple(sum(p.numel() * p.element_size() for p in block) for block in weights),
        on_device=tuple(_bytes_on(block, device) if cuda else 0 for block in weights),
        slot_sizes=tuple(frozen_bytes(block) for block in blocks),
        free_and_total=(free_and_total or levers.free_bytes(device)) if cuda else None,
    )
    host = host_available_bytes() if host_free is None else host_free
    if cfg.stream_blocks != AUTO:
        plan = plan.with_stream(int(cfg.stream_blocks))
    elif cuda and blocks:
        plan = _auto(model, cfg, plan)
    if cfg.offload_activations is True:
        plan = replace(plan, offload=True)
    _check_host(plan, host, cfg)
    return plan


def storage(model: nn.Module, cfg: TrainConfig, device: torch.device, blocks: list[nn.Module]):
    """base_quantize auto decided: (cfg with none or int8, the log note). none wherever the run fits as the base is
    stored (resident, or streamed by `decide`), off CUDA, and where int8 cannot serve (adapter dora reads the base
    weight, full trains it; fp8_compute on; a base already stored in 8 bits; sharding shard splits the bf16 base
    over the GPUs instead); int8 where it does not fit."""
    if cfg.base_quantize != AUTO:
        return cfg, ""
    plain = replace(cfg, base_quantize="none")
    stored_small = any(p.element_size() == 1 for block in blocks for _, p in frozen_weights(block))
    cannot = cfg.adapter in ("dora", "full") or cfg.fp8_compute is True or cfg.sharding == "shard" or stored_small
    if device.type not in STREAMS_ON or not blocks or cannot:
        return plain, ""
    try:
        if decide(model, plain, device, blocks).fits:
            return plain, ""
        why = "streaming every block, the step still does not fit the GPU"
    except ConfigError:
        why = "the host lacks the RAM to stream it from pinned memory"
    return replace(cfg, base_quantize="int8"), f"base_quantize auto → int8 (in bf16 {why}; int8 halves its bytes)"


def _auto(model, cfg, plan: MemoryPlan) -> MemoryPlan:
    """stream_blocks auto: the fewest blocks that make the step fit (with offload_activations auto, the kept block
    inputs moved to the host where no count does)."""
    from . import levers

    need = levers.estimated_step_bytes(model, cfg, 0.0)
    if need is None:
        return plan.with_stream(0, "stream_blocks auto → 0 (no memory estimate for this model)")
    count = _fewest(plan, need)
    offload, kept = False, ""  # offload_activations true: decide() sets it whatever streams
    if count is None and _may_offload(cfg):  # offload_activations auto: the kept inputs to the host, then stream
        smaller = levers.estimated_step_bytes(model, cfg, 0.0, offload=True)
        count = _fewest(plan, smaller)
        if count is not None:
            offload, need = True, smaller
            kept = (
                "; offload_activations auto → on (the blocks' kept inputs in host memory: the step fits no other way)"
            )
    if count is None:
        return plan.with_stream(
            plan.blocks,
            f"stream_blocks auto → all {plan.blocks} blocks, and the step (~{need / GIB:.1f} GiB estimated) may "
            "still not fit: lower the resolution, the frames or the batch, or store the base smaller (base_quantize "
            "int8)",
            fits=False,
            offload=offload,
        )
    if not count:
        note = f"stream_blocks auto → 0 (the step, ~{need / GIB:.1f} GiB, fits beside the base)"
        return plan.with_stream(0, note + kept, offload=offload)
    return plan.with_stream(
        count,
        f"stream_blocks auto → {count} of {plan.blocks} (so the step, ~{need / GIB:.1f} GiB, fits beside "
        f"{plan.blocks - count} resident blocks)" + kept,
        offload=offload,
    )


def split(model: nn.Module, cfg: TrainConfig, plan: MemoryPlan, ranks: int, note: str) -> MemoryPlan:
    """The plan of a base sharded over `ranks` (sharding.py): each rank holds 1/ranks of every block. Where even
    that share leaves the step no room (stream_blocks auto, on CUDA), the fewest blocks, spread as _auto spreads
    them, keep their shards in pinned host memory instead: FSDP2's CPU offload copies a shard to the GPU for each
    all-gather, so two 24 GB cards hold a base twice one card's size (bench/RESULTS.md)."""
    from . import levers

    plan = replace(plan, shards=ranks).with_stream(0, note)
    if plan.free_and_total is None or cfg.stream_blocks != AUTO:
        return plan
    need = levers.estimated_step_bytes(model, cfg, 0.0)
    count = _fewest(plan, need)
    if need is None or count == 0:
        return plan
    if count is None:
        plan = plan.with_stream(
            plan.blocks,
            f"{note}; every block's shards in pinned host memory, and the step (~{need / GIB:.1f} GiB estimated) may "
            "still not fit: lower the resolution, the frames or the batch, or add GPUs",
            fits=False,
        )
    else:
        plan = plan.with_stream(
            count,
            f"{note}; {count} of {plan.blocks} blocks' shards in pinned host memory (so the step, "
            f"~{need / GIB:.1f} GiB, fits beside the rest)",
        )
    _check_host(plan, host_available_bytes(), cfg)
    return plan


def _fewest(plan: MemoryPlan, need: int | None) -> int | None:
    """The fewest streamed blocks that leave `need` bytes room; None where even all do not."""
    from ...estimate.torch_step import step_fits

    if need is None:
        return None
    return next((n for n in range(plan.blocks + 1) if step_fits(need, *plan.with_stream(n).after)), None)


def _may_offload(cfg: TrainConfig) -> bool:
    """offload_activations auto may turn on: checkpointing on, no checkpoint_budget or CUDA graphs asked for, one
    process (under DDP the reentrant checkpoint it needs is untested)."""
    from ...config.checks import offload_possible
    from ...run import distributed

    return cfg.offload_activations == AUTO and offload_possible(cfg) and distributed.current().world == 1


def step_room(model: nn.Module, cfg: TrainConfig, total: int) -> int | None:
    """The GPU bytes a step needs beside the resident weights, as stream_blocks auto reckons it (the estimate at
    checkpoint budget 0, times AUTO_SAFETY, and the margin), for a loader that places the weights first (ComfyUI's
    partial load); None where stream_blocks is 0 or the model has no estimate."""
    from ...estimate import torch_step
    from . import levers

    if cfg.backend != "torch" or cfg.stream_blocks == 0:
        return None
    need = levers.estimated_step_bytes(model, cfg, 0.0)
    return None if need is None else torch_step.step_room(need, total)


def _check_host(plan: MemoryPlan, host: int | None, cfg: TrainConfig) -> None:
    """Refuse, before the first step, a plan whose pinned copies the host cannot hold."""
    if host is None or not plan.host_new_bytes or plan.host_new_bytes <= host - HOST_RESERVE_BYTES:
        return
    raise ConfigError(
        f"stream_blocks {cfg.stream_blocks}: streaming {plan.stream} of {plan.blocks} blocks needs "
        f"{plan.host_new_bytes / GIB:.1f} GiB of pinned host memory for their weights, and this machine has "
        f"{host / GIB:.1f} GiB available ({HOST_RESERVE_BYTES / GIB:.0f} GiB kept for the system). Free host "
        "memory, or make the base smaller so less must stream: base_quantize int8 (half the bytes), a ComfyUI "
        "fp8 checkpoint of the model, or a lower resolution (`python -m trainer estimate CONFIG --memory-gb N` "
        "shows what fits)"
    )
