"""Full fine-tune (adapter "full"): every weight of the diffusion model trained in place, no adapter.

The trainable set is the model's own nn.Parameters by name (no copies, no flattening), so FSDP2's fully_shard over
the blocks and the root (sharding.py, sharding shard under torchrun) shards weights, gradients and optimizer state
as they are: the set looks its parameters up by name, since fully_shard puts DTensor parameters in their place.
Weights keep the model's dtype; a bf16 weight takes each optimizer update with stochastic rounding (round_bf16_updates), as
OneTrainer and ai-toolkit do for bf16 full fine-tunes: half the memory of fp32 masters, and updates far below
bf16's resolution still move the weight on average instead of rounding away."""

from __future__ import annotations

import dataclasses
import functools
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from ...estimate.full_step import step_chunk

FULL = "full"


def settings(cfg):
    """The config a full fine-tune runs with: the levers that stream, quantize or record a frozen base are off
    (every block weight trains, on the device). The same config for any other adapter."""
    if cfg.adapter != FULL:
        return cfg
    off = {"stream_blocks": 0, "fp8_compute": False, "base_quantize": "none", "cuda_graphs": False}
    return dataclasses.replace(cfg, **off, step_graphs=False)


class FullSet:
    """Every weight of the diffusion model made trainable: the blocks' and the embedders' and final layer's, as
    musubi-tuner's and ai-toolkit's full fine-tunes of Klein and Z-Image train the whole transformer. Keyed by
    their names in the model's state dict (what ComfyUI's Load Diffusion Model reads back); the base weights kept
    on the host to give the model back. The blocks' weights come first (FSDP2 shards block by block)."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module]):
        in_blocks = {id(p) for block in blocks for p in block.parameters()}
        named = list(model.named_parameters())
        self.model = model
        self.names = [n for n, p in named if id(p) in in_blocks] + [n for n, p in named if id(p) not in in_blocks]
        self.base = [p.detach().to("cpu", copy=True) for _, p in self.named]
        for _, param in self.named:
            param.requires_grad_(True)

    @property
    def named(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) now: after fully_shard a name holds a DTensor parameter, not the one first seen."""
        return [(name, self.model.get_parameter(name)) for name in self.names]

    def branches(self) -> dict[str, nn.Module]:
        return {}  # no adapter: nothing hooked, nothing for DDP or a LoRA file

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.named)

    def parameter_count(self) -> int:
        return sum(p.numel() for _, p in self.named)

    @contextmanager
    def step_weights(self, dtype: torch.dtype):
        yield  # autocast casts the block weights itself

    @contextmanager
    def disabled(self):
        raise ValueError("a full fine-tune has no base model beside it to compare with (set preservation_weight 0)")
        yield  # pragma: no cover

    def state(self) -> dict[str, np.ndarray]:
        """The trained weights, exact, by state-dict name: a bf16 weight as its own bits (uint16: the checkpoint
        stores it as BF16, half the bytes of fp32 on disk and on the host while saving), others in fp32. Sharded:
        every rank calls it (each weight all-gathered whole)."""
        return {name: exact(whole(p.detach())) for name, p in self.named}

    @torch.no_grad()
    def load(self, tensors: dict[str, np.ndarray]) -> None:
        missing = [name for name, _ in self.named if name not in tensors]
        if missing:
            raise ValueError(f"full fine-tune state lacks {len(missing)} weight(s), e.g. {missing[:3]}")
        for name, param in self.named:
            param.copy_(shard_like(param, torch.from_numpy(tensors[name])))

    @torch.no_grad()
    def remove(self) -> None:
        """The base weights back: a ComfyUI MODEL is used again after the run."""
        for (_, param), base in zip(self.named, self.base):
            param.copy_(shard_like(param, base))
        self.names, self.base = [], []


def exact(tensor: torch.Tensor) -> np.ndarray:
    """A weight on the host, exact and not a view: bf16 as its bits (uint16), anything else as fp32."""
    if tensor.dtype == torch.bfloat16:
        return tensor.cpu().view(torch.int16).numpy().view(np.uint16).copy()
    return tensor.float().cpu().numpy().copy()


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (an all-gather: every rank calls it), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def shard_like(ref: torch.Tensor, value: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`value` (whole, the same on every rank) laid out as `ref`: this rank's shard cut locally, no
    communication (src_data_rank None), where `ref` is a DTensor; else `value`. In `dtype`, else ref's."""
    if not hasattr(ref, "device_mesh"):
        return value
    from torch.distributed.tensor import distribute_tensor

    value = value.to(device=local(ref).device, dtype=dtype or ref.dtype)
    return distribute_tensor(value, ref.device_mesh, ref.placements, src_data_rank=None)


def replicated(trainable, sharded: bool) -> list[nn.Module]:
    """What DDP averages the gradients of under torchrun: an adapter's branches; a full fine-tune's whole model
    (replicated); nothing where FSDP2 shards it (its reduce-scatter averages the gradients)."""
    if not isinstance(trainable, FullSet):
        return list(trainable.branches().values())
    return [] if sharded else [trainable.model]


def state(trainable) -> dict[str, np.ndarray]:
    """A full fine-tune's trained weights; {} for an adapter's set (its weights go through lora_state)."""
    return trainable.state() if isinstance(trainable, FullSet) else {}


def load_state(trainable, tensors: dict[str, np.ndarray]) -> None:
    if isinstance(trainable, FullSet):
        trainable.load(tensors)


def model_tensors(model: nn.Module, sharded: bool = False) -> dict[str, np.ndarray]:
    """The whole diffusion model's state dict in fp32 numpy, keys as ComfyUI's Load Diffusion Model reads them.
    Sharded (every rank calls it): torch.distributed.checkpoint's full state dict, gathered onto rank 0's host
    (the other ranks get {}: only rank 0 writes the file), keys as one process's."""
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {name: t.float().numpy().copy() for name, t in get_model_state_dict(model, options=options).items()}
    return {name: t.detach().float().cpu().numpy().copy() for name, t in model.state_dict().items()}


FUSED_ROUNDING = True  # an A/B lever for bench/gpu_train.py --set (RESULTS.md: the eager kernels' time)
ROUND_SLICE = 1 << 24  # the eager in-place rounding's slice: its int32 temporaries stay at 128 MiB
# Optimizers whose step is a few multi-tensor kernels (torch's fused AdamW), paced by the GPU: a chunk's fp32 copies
# are views of one flat buffer, rounded by one kernel compiled on CUDA (Klein 4B full on an H200: 0.284 → 0.261
# s/step). The others step each weight with calls of its own (bitsandbytes, torchao, Adafactor, Prodigy...), paced by
# the host, where the flat views and the compiled kernel measured slower (Z-Image with torchao's 8-bit AdamW: 0.67
# → 0.76 and 0.88 s/step): a copy per weight, rounded by the eager kernels.
FLAT_STEP = frozenset({"adamw"})


def stochastic_round_(target: torch.Tensor, value: torch.Tensor) -> None:
    """target (bf16, or value itself) ← value (fp32) rounded up or down at random, in proportion to the distance, to
    a bf16 value: a random 16-bit integer added below bf16's mantissa, then the low half cut (torch's global RNG:
    resume restores it)."""
    bits = value.contiguous().view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16)
    target.copy_(((bits + noise) & -65536).view(torch.float32))


def _round_in_place(value: torch.Tensor) -> None:
    stochastic_round_(value, value)


def round_flat_(flat: torch.Tensor) -> None:
    """A flat fp32 buffer rounded in place: on CUDA by one compiled kernel (FUSED_ROUNDING), elsewhere in slices."""
    if FUSED_ROUNDING and flat.is_cuda:
        _round_fused()(flat)
        return
    for part in flat.split(ROUND_SLICE):  # in order: the draws are those of one call over the whole
        _round_in_place(part)


@functools.cache
def _round_fused():
    """_round_in_place compiled (one graph: the buffer is always 1-D): one pass reads and writes 4 B a weight, where
    the eager kernels move 20 B (2^28 weights on an H200: 0.80 ms against 2.91). Inductor draws its own Philox
    numbers, seeded from torch's CUDA generator, which a checkpoint holds: a resume stays exact; the draws differ
    from the eager ones."""
    return torch.compile(_round_in_place, dynamic=True, fullgraph=True)


def fp32_copies(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fp32 copies of `tensors` as views of one flat buffer per device, each buffer filled by one multi-tensor copy:
    a few kernel launches for a chunk of weights, not one a weight (a host-paced step pays for every launch)."""
    views: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    on: dict[torch.device, list[int]] = {}
    for i, tensor in enumerate(tensors):
        on.setdefault(tensor.device, []).append(i)
    flats = []
    for device, members in on.items():
        flat = torch.empty(sum(tensors[i].numel() for i in members), dtype=torch.float32, device=device)
        for i, part in zip(members, flat.split([tensors[i].numel() for i in members])):
            views[i] = part.view(tensors[i].shape)
        torch._foreach_copy_([views[i] for i in members], [tensors[i] for i in members])
        flats.append(flat)
    return flats, views


def round_bf16_updates(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], name: str | None = None) -> None:
    """optimizer.step() on fp32 copies of the bf16 weights (and their gradients), stochastically rounded back.
    Nothing changes for fp32 weights (the demo model, CPU tests). An optimizer that steps each weight alone (`name`
    not in WHOLE_STEP) steps them a chunk at a time: the fp32 copies of one chunk exist at once, not of every
    weight (Z-Image's 6.15 B weights: ~2.5 GiB instead of ~57), and the result is the same bit for bit (the same
    updates, the same random draws in the same order). FLAT_STEP optimizers step a chunk's copies as one buffer."""
    low = [p for p in params if p.dtype == torch.bfloat16]
    if not low:
        return
    sharded = any(hasattr(p, "device_mesh") for p in low)  # FSDP2's DTensor parameters take no .data swap
    swap = _masters if sharded else (_flat_fp32 if name in FLAT_STEP else _fp32_each)
    chunk = step_chunk(name) if name else None
    step = optimizer.step

    def rounded_step(*args, **kwargs):
        result = None
        for members in _chunks(optimizer, chunk):
            with _only(optimizer, members), swap(optimizer, [p for p in low if members is None or id(p) in members]):
                result = step(*args, **kwargs)
        return result

    optimizer.step = rounded_step


def _chunks(optimizer: torch.optim.Optimizer, chunk: int | None):
    """The optimizer's parameters in order, as sets of ids of about `chunk` entries each (None: all at once)."""
    if chunk is None:
        yield None
        return
    members, size = set(), 0
    for p in [p for group in optimizer.param_groups for p in group["params"]]:  # listed before _only narrows them
        members.add(id(p))
        size += p.numel()
        if size >= chunk:
            yield members
            members, size = set(), 0
    if members:
        yield members


@contextmanager
def _only(optimizer: torch.optim.Optimizer, members: set[int] | None):
    """The optimizer sees only `members` (ids) in its groups while it steps; the groups as they were after."""
    if members is None:
        yield
        return
    kept = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in members]
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, kept):
            group["params"] = params


@contextmanager
def _fp32_each(optimizer: torch.optim.Optimizer, low: list[nn.Parameter]):
    """The bf16 weights hold fp32 copies of themselves and their gradients while the optimizer steps; then each
    takes its update stochastically rounded, and its own bf16 gradient back (the step read only the copy)."""
    stored = [(p.data, p.grad) for p in low]
    for p in low:
        grad = p.grad
        p.data = p.data.float()
        p.grad = None if grad is None else grad.float()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, (kept, grad) in zip(low, stored):
                stochastic_round_(kept, p.data)
                p.data = kept
                p.grad = grad


@contextmanager
def _flat_fp32(optimizer: torch.optim.Optimizer, low: list[nn.Parameter]):
    """_fp32_each with the copies as views of flat buffers (fp32_copies), rounded in place with round_flat_; the
    weights take them back by one multi-tensor copy (bf16 holds them exactly). The same values as _fp32_each on the
    CPU, bit for bit."""
    stored = [(p.data, p.grad) for p in low]
    graded = [p for p in low if p.grad is not None]
    values, weight_views = fp32_copies([p.data for p in low])
    _, grad_views = fp32_copies([p.grad for p in graded])
    for p, view in zip(low, weight_views):
        p.data = view
    for p, view in zip(graded, grad_views):
        p.grad = view
    try:
        yield
    finally:
        with torch.no_grad():
            for flat in values:
                round_flat_(flat)
            torch._foreach_copy_([kept for kept, _ in stored], weight_views)
            for p, (kept, grad) in zip(low, stored):
                p.data = kept
                p.grad = grad


@contextmanager
def _masters(optimizer: torch.optim.Optimizer, low: list[nn.Parameter]):
    """_fp32_each for sharded (DTensor) weights: assigning .data to a DTensor parameter changes its dtype label but
    not its shard (torch 2.13), so the optimizer steps fp32 copies put in the weights' places (their state moved
    with them), and each rank rounds its shard back stochastically into the bf16 weight."""
    slots = {id(p): (group, i) for group in optimizer.param_groups for i, p in enumerate(group["params"])}
    masters = []
    for p in low:
        master = nn.Parameter(p.detach().float())
        master.grad = None if p.grad is None else p.grad.float()
        group, i = slots[id(p)]
        group["params"][i] = master
        if p in optimizer.state:
            optimizer.state[master] = optimizer.state.pop(p)
        masters.append((p, master, group, i))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, master, group, i in masters:
                stochastic_round_(local(p), local(master.detach()))
                group["params"][i] = p
                if master in optimizer.state:
                    optimizer.state[p] = optimizer.state.pop(master)
