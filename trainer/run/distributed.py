"""Several GPUs (or CPU processes) under torchrun: PyTorch's own engine, every distributed fact in one place.

`torchrun --nproc_per_node N -m trainer train CONFIG` starts N processes (ranks). Each holds the frozen
base and the same LoRA; every global batch is drawn from the one seeded sampler (batch_size·N items) and
each rank trains on its share of the rows, so N ranks see what one process with N times the batch sees.
LoRA gradients are averaged by DistributedDataParallel (bucketed all-reduce overlapped with backward),
the loss figure is the global mean, rank 0 writes checkpoints and the LoRA, and weights, optimizer and
EMA stay identical on every rank. One process (no torchrun, or --nproc_per_node 1) touches none of this:
every helper here is then a no-op and the run is the plain one, bit for bit.

Host-side agreement (stop and pause votes, RNG states for a checkpoint, barriers) goes through a gloo group, so it
never waits for the GPU; gradients go through the default group (NCCL on CUDA, gloo on the CPU).
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

# A rank waits this long at a host barrier (rank 0 encoding the dataset, writing a checkpoint, sampling).
HOST_TIMEOUT = timedelta(hours=2)
_host_group = None


@dataclass(frozen=True)
class Group:
    """This process's place in the run: rank `rank` of `world` processes."""

    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def rows(self, count: int) -> tuple[list[int], float]:
        """(this rank's rows of a global batch of `count`, the loss scale of its rows).

        Contiguous shares, as even as the count allows. Each rank's loss is a mean over its rows and DDP
        averages the ranks, so rows are scaled by len(share)·world/count (1 for an even split) to make that
        the mean over the global batch. A rank with no row (a short last batch of a bucket, fewer items
        than ranks) trains on row 0 at scale 0: it still runs forward and backward (DDP needs every rank
        in every all-reduce) and adds nothing."""
        start, stop = self.rank * count // self.world, (self.rank + 1) * count // self.world
        if start == stop:
            return [0], 0.0
        return list(range(start, stop)), (stop - start) * self.world / count


SINGLE = Group()


def _torchrun_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _initialized():
    """torch.distributed once a process group runs; None otherwise (and without importing torch)."""
    if _torchrun_world() <= 1 and "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def current() -> Group:
    """The group of this process: from torch.distributed once started, else one process."""
    dist = _initialized()
    if dist is None or dist.get_world_size() == 1:
        return SINGLE
    return Group(rank=dist.get_rank(), world=dist.get_world_size())


def start(device: str = "auto", backend: str = "torch") -> Group:
    """Join the torchrun job this process is part of (RANK, WORLD_SIZE, LOCAL_RANK set by torchrun): NCCL
    on CUDA GPUs, one per rank (LOCAL_RANK), gloo on the CPU. Without torchrun (or with one process) nothing
    starts. Idempotent; the group is ended at exit."""
    global _host_group
    world = max(_torchrun_world(), current().world)  # torchrun's, or a group started by the caller (tests)
    if world <= 1:
        return SINGLE
    if backend != "torch":
        raise ValueError(
            f"backend {backend!r} trains in one process: torchrun's {world} processes need the torch "
            "backend (CUDA GPUs, or the CPU). Run `python -m trainer train CONFIG` without torchrun, "
            'or set backend = "torch"'
        )
    import torch
    import torch.distributed as dist

    if device == "mps":
        raise ValueError(
            f"device 'mps' runs one process; torchrun's {world} processes need device 'cuda' (one GPU each) or 'cpu'"
        )
    on_gpu = device in ("auto", "cuda") and torch.cuda.is_available()
    if device == "cuda" and not on_gpu:
        raise ValueError("device is 'cuda' but this machine has no CUDA GPU; set device to 'cpu' for CPU ranks")
    if not dist.is_initialized():
        if on_gpu:
            # Each rank its own GPU, before anything (ComfyUI's model management included) picks one.
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if on_gpu else "gloo")
        atexit.register(stop)
    if _host_group is None:
        _host_group = dist.new_group(backend="gloo", timeout=HOST_TIMEOUT)
    return current()


def stop() -> None:
    """End the process group (at exit; torch warns about a group left running)."""
    global _host_group
    dist = _initialized()
    if dist is not None:
        dist.destroy_process_group()
    _host_group = None


def _host():
    import torch.distributed as dist

    return _host_group if _host_group is not None else dist.group.WORLD


def barrier() -> None:
    if current().world > 1:
        import torch.distributed as dist

        dist.barrier(group=_host())


class StopVote:
    """The ranks' agreement on stopping and pausing, one step late and without a rendezvous per step.

    Each call posts this rank's flags (stop, pause) in an asynchronous all-reduce (MAX, on the host gloo
    group) and returns the agreed stop of the previous call's, which has long completed by then (its agreed
    pause is left in `paused`): every rank gets the same sequence of answers and so stops, or pauses, after
    the same step, and no rank waits for the others (nor the GPU) at a step boundary. A stop asked for at
    step k is honoured after step k + 1. One process: the flags themselves, at once. While the ranks are
    paused, `agree` takes short synchronous votes (trainer/run/pause.py polls with it). `close()` waits for the
    last posted vote (before the group ends).

    `memory` (this rank's peak accelerator bytes) rides the same all-reduce, each rank in its own slot (the
    others post 0, MAX keeps it): `peaks` is every rank's peak, in rank order, as of the previous answer, for
    the several-GPU dashboard; no extra collective. One process: empty."""

    def __init__(self, memory: Callable[[], int] | None = None):
        self.pending = None
        self.paused = False  # the agreed pause of the last answer
        self.memory = memory
        self.peaks: list[int] = []

    def _posted(self, flag: bool, pause: bool):
        import torch

        group = current()
        value = torch.zeros(2 + group.world, dtype=torch.int64)
        value[0], value[1] = int(bool(flag)), int(bool(pause))
        value[2 + group.rank] = int(self.memory()) if self.memory is not None else 0
        return value

    def __call__(self, flag: bool, pause: bool = False) -> bool:
        if current().world == 1:
            self.paused = bool(pause)
            return bool(flag)
        import torch.distributed as dist

        value = self._posted(flag, pause)
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=_host(), async_op=True)
        previous, self.pending = self.pending, (work, value)
        stop, self.paused = self._answer(previous)
        return stop

    def _answer(self, posted) -> tuple[bool, bool]:
        if posted is None:
            return False, False
        posted[0].wait()
        stop, pause, *peaks = posted[1].tolist()
        self.peaks = peaks if self.memory is not None else []
        return bool(stop), bool(pause)

    def agree(self, flag: bool, pause: bool) -> tuple[bool, bool]:
        """(stop, pause) agreed now: a synchronous vote that every rank takes in the same round of a pause
        (each round completes within a poll, so no wait nears the host group's timeout however long the
        pause). A stop still in flight from the last step counts."""
        if current().world == 1:
            return bool(flag), bool(pause)
        import torch.distributed as dist

        stopped, _ = self._answer(self.pending)
        self.pending = None
        value = self._posted(flag, pause)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=_host())
        stop, pause = self._answer((_Done(), value))
        return stopped or stop, pause

    def close(self) -> None:
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None


class _Done:
    """A completed collective's handle (a synchronous all-reduce's answer read as a posted one's)."""

    def wait(self) -> None:
        pass


def gather_arrays(arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Every rank's `arrays` (same keys, shapes and dtypes on each: RNG states), in rank order."""
    group = current()
    if group.world == 1:
        return [arrays]
    import torch
    import torch.distributed as dist

    out: list[dict[str, np.ndarray]] = [{} for _ in range(group.world)]
    for key in sorted(arrays):
        local = torch.from_numpy(np.ascontiguousarray(arrays[key]))
        parts = [torch.empty_like(local) for _ in range(group.world)]
        dist.all_gather(parts, local, group=_host())
        for rank, part in enumerate(parts):
            out[rank][key] = part.numpy()
    return out


def main_texts(texts: list[str]) -> list[str]:
    """Rank 0's `texts` on every rank (the other ranks' are ignored): UTF-8 JSON bytes broadcast over the
    host group, no pickle. One process: `texts`."""
    if current().world == 1:
        return list(texts)
    import json

    import torch
    import torch.distributed as dist

    blob = json.dumps(list(texts)).encode() if current().is_main else b""
    size = torch.tensor([len(blob)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=_host())
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=_host())
    return json.loads(bytes(data.numpy()).decode())


def main_time():
    """Rank 0's clock (time.localtime), on every rank: a run folder named by the time is one folder."""
    import time

    now = np.array([int(time.time())], dtype=np.int64)
    return time.localtime(int(gather_arrays({"now": now})[0]["now"][0]))


@contextmanager
def main_first():
    """Rank 0 runs the block first (encoding a dataset into its cache, say), then the others (cache hits)."""
    group = current()
    if not group.is_main:
        barrier()
    try:
        yield group
    finally:
        if group.is_main:
            barrier()


def rank_seed(seed: int) -> int:
    """The torch seed of this rank: the run's seed on rank 0, another stream on each other rank (LoRA dropout
    masks differ between the ranks' rows, as they differ between the rows of one process's batch)."""
    return seed + current().rank


# --- gradients ------------------------------------------------------------------------------------


def _lora_forward_module():
    from torch import nn

    class LoraForward(nn.Module):
        """What DDP wraps: the LoRA branches as its only parameters, the model call as its forward. The base
        model is reached through `call`, not registered: DDP would broadcast all of it at the start."""

        def __init__(self, call: Callable, branches: list):
            super().__init__()
            self.branches = nn.ModuleList(branches)
            self.call = call

        def forward(self, *args):
            return self.call(*args)

    return LoraForward


# DDP's bucket size: the LoRA's gradient cut into about this many buckets, each at most DDP's default 25 MB and
# at least 1 MB. A LoRA's gradient is small (a few MB to a few hundred): in DDP's default 25 MB buckets a small
# one is one bucket, whose all-reduce can start only when the whole backward is done; several buckets start
# while backward still runs (PyTorch's DDP notes: smaller buckets, more overlap, more calls).
BUCKETS = 8
BUCKET_MB = (1.0, 25.0)


def bucket_mb(gradient_bytes: int) -> float:
    """The bucket size (MB) for a gradient of `gradient_bytes`: about BUCKETS buckets, within BUCKET_MB."""
    low, high = BUCKET_MB
    return min(high, max(low, gradient_bytes / BUCKETS / 2**20))


def ddp_options(branches: list) -> dict:
    """What DDP is given (besides the module): the bucket size from the LoRA's gradient bytes, and
    gradient_as_bucket_view (each .grad a view into its bucket: no copy in or out of the bucket, and one
    gradient's memory less). find_unused_parameters stays off (every targeted Linear runs each step; no graph
    walk per step); static_graph stays off (with no_sync it skips all-reduces in torch 2.x, pytorch#187732).
    device_ids None: inputs are already on the rank's device and integer extras must stay on the host."""
    size = sum(p.numel() * p.element_size() for branch in branches for p in branch.parameters() if p.requires_grad)
    return dict(
        device_ids=None, find_unused_parameters=False, bucket_cap_mb=bucket_mb(size), gradient_as_bucket_view=True
    )


# dynamo's DDPOptimizer cuts a compiled region at DDP's bucket boundaries so a bucket's all-reduce can start inside
# it. Kiln compiles one block a region, whose backward already ends where its buckets' gradients are ready, so the
# cut buys little; and a cut through a block that writes into its inputs (Flux2's `img += ...`, compiled on copies)
# hands a tensor one piece saved for backward to the next piece's in-place write. Klein 4B on two H200s failed so
# at step 1 ("modified by an inplace operation ... output 2 of CompiledFunctionBackward"); Z-Image's blocks are
# pure and trained. Off: each block one compiled graph under DDP as on one GPU (a lever for bench/gpu_train.py).
OPTIMIZE_DDP = False


def data_parallel(call: Callable, branches: list) -> Callable:
    """`call(*inputs)` (the model's forward) with the LoRA gradients averaged over the ranks.

    One process: `call` itself. Several: a DistributedDataParallel module over the LoRA branches, whose
    forward is `call`: DDP's hooks on the LoRA parameters start a bucket's all-reduce as soon as backward
    has its gradients (overlapped with the rest of backward; torch.compile'd blocks, non-reentrant
    checkpointing and FSDP2-sharded blocks (trainer/backends/torch_backend/sharding.py) produce ordinary leaf
    gradients on the branches, so the hooks fire the same). The options: ddp_options."""
    branches = list(branches)
    if current().world == 1 or not branches:  # none: FSDP2 averages a sharded full fine-tune's gradients itself
        return call
    import torch
    from torch.nn.parallel import DistributedDataParallel

    torch._dynamo.config.optimize_ddp = OPTIMIZE_DDP

    return DistributedDataParallel(_lora_forward_module()(call, branches), **ddp_options(branches))


def accumulating(call: Callable, final: bool):
    """Around one micro-batch's forward and backward: gradients stay local (no_sync) on all but the final
    micro-batch of a step, whose backward all-reduces the accumulated sum once."""
    no_sync = getattr(call, "no_sync", None)
    return no_sync() if no_sync is not None and not final else nullcontext()


def mean(value: Any) -> Any:
    """A device scalar averaged over the ranks (the loss figure: each rank's is its share's, DDP-scaled)."""
    if current().world == 1:
        return value
    import torch.distributed as dist

    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.AVG if dist.get_backend() == "nccl" else dist.ReduceOp.SUM)
    return value if dist.get_backend() == "nccl" else value / current().world
