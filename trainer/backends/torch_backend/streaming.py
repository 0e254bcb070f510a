"""The frozen base streamed from host memory: a small card trains a model larger than itself.

The base never changes, so nothing goes back: each streamed block's frozen weights keep their master copy in
pinned host memory, and a ring of `slots` GPU buffers holds the blocks about to run. Block j always lands in
slot j mod slots, and its parameters point at views of that slot once and for all: addresses never change, so
compiled blocks, tensors autograd saved in the forward (they alias the slot, refilled with the same weights
before the block's backward) and CUDA graphs all see one fixed layout.

Copies run on a side stream, `slots - 1` blocks ahead of the compute, in the order the blocks run: the
forward (0, 1, ...), then the backward with its recompute (..., 1, 0), then the next forward, whose first
blocks the backward leaves in place. Each use of a block — a forward, or the start of its backward, seen by
an autograd gate on its outputs — first makes the compute stream wait for that block's copy (copying it
there and then if no prefetch did), then starts the copies that come next into slots whose blocks are done
(the copy stream waits for an event recorded at this use, after every earlier kernel).

Why not ComfyUI's own low-VRAM loading: it casts each weight into a reused buffer, so a backward fails
("modified by an inplace operation"), and its forward streams at 1.4-1.6x the copy floor (bench/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import logging
import weakref

import torch
from torch import nn

from ..base import restore_forward

# Ring slots: one block computing, one copy in flight, one to spare. On an H200 (Z-Image 1024 px,
# bench/RESULTS.md) 2, 3 and 4 slots ran the frozen base's step at 1.12, 1.11 and 1.10x the resident one.
SLOTS = 3
STREAMED: weakref.WeakSet = weakref.WeakSet()  # the blocks a stream holds now (hooked), for `streams`
ALIGN = 512  # bytes: each weight's view in a slot starts as the caching allocator would start it (cuBLAS picks kernels by alignment)


@dataclass
class StreamPlan:
    """What streams: `blocks` (indices into the model's block order) over `slots` GPU buffers."""

    blocks: list[int]
    slots: int
    slot_bytes: int
    streamed_bytes: int

    def gpu_bytes(self) -> int:
        """What the streamed blocks hold on the GPU: the ring."""
        return self.slots * self.slot_bytes


def frozen_weights(block: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """A block's frozen parameters (the base): what streams. Adapters (requires_grad) and buffers stay."""
    return [(name, p) for name, p in block.named_parameters() if not p.requires_grad]


def _layout(weights: list[tuple[str, nn.Parameter]]) -> tuple[list[int], int]:
    offsets, at = [], 0
    for _, p in weights:
        offsets.append(at)
        at += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
    return offsets, at


def streams(model: nn.Module) -> bool:
    """Whether blocks of `model` stream now: their weights point into a GPU ring, which a loader moving or
    re-patching the model's weights would break (nodes/comfy/training.py samples around it)."""
    return any(module in STREAMED for module in model.modules())


def frozen_bytes(block: nn.Module) -> int:
    """The bytes a block's frozen weights take in a ring slot (each aligned as the allocator would)."""
    return _layout(frozen_weights(block))[1]


def spread(count: int, total: int) -> list[int]:
    """`count` of `total` blocks (in the order they run), evenly spread: the resident blocks between two
    streamed ones compute while the next copy runs."""
    if count >= total:
        return list(range(total))
    return sorted({int((k + 0.5) * total / count) for k in range(count)})


def plan(blocks: list[nn.Module], streamed: list[int], slots: int) -> StreamPlan:
    """The ring for `streamed` blocks: each slot as large as the largest streamed block."""
    if slots < 2:
        raise ValueError(f"stream slots must be at least 2 (one computing, one copying), got {slots}")
    sizes = [frozen_bytes(blocks[i]) for i in streamed]
    slots = min(slots, len(streamed)) if streamed else 0
    return StreamPlan(list(streamed), slots, max(sizes, default=0), sum(sizes))


@dataclass
class _Block:
    module: nn.Module
    weights: list[tuple[str, nn.Parameter]]
    offsets: list[int]
    host: list[torch.Tensor] = field(default_factory=list)  # the master copies (pinned on a CUDA device)
    origins: list[torch.device] = field(default_factory=list)  # where each weight was before streaming
    views: list[int] = field(default_factory=list)  # each weight's address in its slot
    ready: object = None  # the copy stream's event after this block's copy


class _BackwardStart(torch.autograd.Function):
    """Identity on a block's outputs; its backward runs as the block's backward begins (before the recompute)."""

    @staticmethod
    def forward(ctx, streamer, position, *outputs):
        ctx.streamer, ctx.position = streamer, position
        views = tuple(t.view_as(t) if torch.is_tensor(t) else t for t in outputs)
        # an output that needed no gradient before the gate needs none after it
        ctx.mark_non_differentiable(*[v for v, t in zip(views, outputs) if torch.is_tensor(t) and not t.requires_grad])
        return views

    @staticmethod
    def backward(ctx, *grads):
        ctx.streamer.use(ctx.position, backward=True)
        return (None, None, *grads)


class BlockStreamer:
    """Streams the frozen weights of `plan.blocks` of `blocks` (in the order they run) to `device`."""

    def __init__(
        self,
        blocks: list[nn.Module],
        stream_plan: StreamPlan,
        device: torch.device,
        log=None,
        hook: bool = True,
        released: tuple[dict, list] = ({}, []),
    ):
        self.device, self.plan, self.log = torch.device(device), stream_plan, log
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.ring = [
            torch.empty(stream_plan.slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(stream_plan.slots)
        ]
        self.holds: list[int | None] = [None] * stream_plan.slots  # which streamed block each slot holds
        self.streamed: list[_Block] = []
        self.previous: list = []
        # host weights pinned in place, unregistered by remove(); and where a released streamer's weights came from
        self.registered: list[torch.Tensor] = list(released[1])
        self.origins: dict[int, torch.device] = dict(released[0])
        for position, index in enumerate(stream_plan.blocks):
            self.streamed.append(self._adopt(blocks[index], position))
        if hook:
            self.hook()

    def _adopt(self, module: nn.Module, position: int) -> _Block:
        """The block's frozen weights moved to host memory (pinned), its parameters pointed at its slot's views."""
        weights = frozen_weights(module)
        offsets, _ = _layout(weights)
        block = _Block(module, weights, offsets)
        slot = self.ring[position % len(self.ring)]
        for (_, p), offset in zip(weights, offsets):
            block.origins.append(self.origins.get(id(p), p.device))
            block.host.append(self._host_copy(p.data))
            p.data = slot[offset : offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
            block.views.append(p.data_ptr())
        return block

    def _verify(self, position: int) -> None:
        """Before a block's forward: its weights are still the ring's. A weight its model's owner replaced between
        steps (ComfyUI re-patching the model after a validation sample: a new Parameter, the right values) is
        taken over as the new master; a weight whose data was moved under the stream cannot be trusted."""
        block = self.streamed[position]
        current = dict(block.module.named_parameters())
        for k, (name, p) in enumerate(block.weights):
            now = current.get(name)
            if now is p and p.data_ptr() == block.views[k]:
                continue
            if now is p or now is None or now.shape != p.shape or now.dtype != p.dtype:
                raise RuntimeError(
                    f"stream_blocks: the weight {name} of streamed block {self.plan.blocks[position]} was moved "
                    "off the GPU ring while the run streamed it (the model's owner unloaded it mid-run); set "
                    "stream_blocks 0 and report this"
                )
            block.host[k] = self._host_copy(now.data)
            now.data = p.data  # the same slot view
            block.weights[k] = (name, now)
            self.holds[position % len(self.ring)] = None  # copied again from the new master

    def hook(self) -> None:
        """Each streamed block's forward (as it is now: checkpointed, compiled) placed behind its copy. Hooked
        outside the checkpoint: a checkpoint's recompute then runs inside the gate's placement."""
        self.previous = [block.module.__dict__.get("forward") for block in self.streamed]
        for position, block in enumerate(self.streamed):
            block.module.forward = self._streamed_forward(block.module.forward, position)
            STREAMED.add(block.module)

    def unhook(self) -> None:
        """The forwards as hook found them; the weights stay in the ring (the blocks can be wrapped anew)."""
        for block, previous in zip(self.streamed, self.previous):
            restore_forward(block.module, previous)
            STREAMED.discard(block.module)
        self.previous = []

    def _host_copy(self, weight: torch.Tensor) -> torch.Tensor:
        """The master copy in host memory: pinned for fast asynchronous copies. A weight already on the host
        (ComfyUI's loaders, its low-VRAM offload) is pinned where it lies, not copied a second time."""
        if weight.device.type != "cpu":
            host = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=self.cuda)
            return host.copy_(weight)
        weight = weight.contiguous()
        if self.cuda and not weight.is_pinned():
            nbytes = weight.numel() * weight.element_size()
            if torch.cuda.cudart().cudaHostRegister(weight.data_ptr(), nbytes, 0) == 0:
                self.registered.append(weight)
            else:
                weight = weight.pin_memory()
        return weight

    def _streamed_forward(self, block_forward, position: int):
        def forward(*args, **kwargs):
            if torch._C._current_graph_task_id() != -1:
                # a checkpoint's recompute inside the backward (the streamer wraps a checkpointed block from
                # inside): the gate on its outputs has placed this block and started the next copies
                self._place(position, self._mark())
                return block_forward(*args, **kwargs)
            self.use(position, backward=False)
            out = block_forward(*args, **kwargs)
            if not torch.is_grad_enabled():
                return out
            tensors = out if isinstance(out, tuple) else (out,)
            if not any(torch.is_tensor(t) and t.requires_grad for t in tensors):
                return out
            gated = _BackwardStart.apply(self, position, *tensors)
            return gated if isinstance(out, tuple) else gated[0]

        return forward

    # ---------------------------------------------------------------- the schedule

    def use(self, position: int, backward: bool) -> None:
        """Block `position` is about to run: its weights in place before its kernels, the next ones on their way."""
        if self.log is not None:
            self.log.append(("backward" if backward else "forward", self.plan.blocks[position]))
        if not backward:
            self._verify(position)
        done = self._mark()
        self._place(position, done)
        # The next uses, each into a slot no block between here and there needs: a slot is refilled only after
        # its block ran (the copy waits for `done`), never while it or a block before the new one still will.
        taken = {position % len(self.ring)}
        for upcoming in self._next_uses(position, backward):
            if upcoming % len(self.ring) in taken:
                break
            taken.add(upcoming % len(self.ring))
            self._load(upcoming, done)

    def _mark(self):
        """An event after every kernel issued so far on the compute stream (None off CUDA)."""
        if not self.cuda:
            return None
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done

    def _place(self, position: int, done) -> None:
        """Block `position` in its slot before the compute stream's next kernel."""
        self._load(position, done)
        block = self.streamed[position]
        if block.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(block.ready)

    def _next_uses(self, position: int, backward: bool) -> list[int]:
        """The blocks that run after `position`, up to slots - 1 of them: the forward's next ones (wrapping
        around to the first blocks when no backward follows, as sampling runs the model again), or the
        backward's."""
        count, step, found = len(self.streamed), -1 if backward else 1, []
        for ahead in range(1, len(self.ring)):
            upcoming = position + step * ahead
            if not backward and upcoming >= count:
                if torch.is_grad_enabled():
                    break  # the backward follows, and it starts with the blocks in place
                upcoming -= count
            if not 0 <= upcoming < count:
                break
            found.append(upcoming)
        return found

    def _load(self, position: int, after) -> None:
        """Copy block `position` into its slot unless it is there; the copy waits for `after` (the slot's
        previous block is done with it)."""
        slot = position % len(self.ring)
        if self.holds[slot] == position:
            return
        block, target = self.streamed[position], self.ring[slot]
        if self.log is not None:
            self.log.append(("copy", self.plan.blocks[position]))
        stream = self.copy_stream
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            if after is not None:
                stream.wait_event(after)
            for host, offset in zip(block.host, block.offsets):
                nbytes = host.numel() * host.element_size()
                target[offset : offset + nbytes].copy_(host.view(-1).view(torch.uint8), non_blocking=True)
            if stream is not None:
                block.ready = torch.cuda.Event()
                block.ready.record(stream)
        self.holds[slot] = position

    def release(self) -> tuple[dict, list]:
        """Unhooked, the ring freed, every streamed weight left in its pinned host copy; returns what a larger
        streamer takes over (`released`): where each weight came from, and the host memory pinned in place."""
        self.unhook()
        origins = {}
        for block in self.streamed:
            for (_, p), host, origin in zip(block.weights, block.host, block.origins):
                p.data, origins[id(p)] = host, origin
        released = (origins, self.registered)
        self.streamed, self.ring, self.registered = [], [], []
        return released

    def remove(self) -> None:
        """Unhooked, and every streamed weight back where it came from as a tensor of its own (a weight that
        came from the host stays there, for its loader to move)."""
        self.unhook()
        for block in self.streamed:  # first off the ring, so the ring is free before any weight goes back:
            for (_, p), host in zip(block.weights, block.host):  # a card that held the model holds it again
                p.data = host
        self.ring = []
        for block in self.streamed:
            for (_, p), host, origin in zip(block.weights, block.host, block.origins):
                if origin.type != "cpu":
                    p.data = host.to(origin, copy=True)
        for weight in self.registered:
            torch.cuda.cudart().cudaHostUnregister(weight.data_ptr())
        self.streamed, self.ring, self.registered = [], [], []


def for_blocks(
    blocks: list[nn.Module], chosen: list[int], device, released: tuple[dict, list] = ({}, [])
) -> BlockStreamer:
    """The `chosen` of `blocks` (indices, in the order they run) streamed through SLOTS slots, unhooked (the
    backend hooks it outside its block wrappers); one log line says what streams. `released`: a smaller
    streamer's (BlockStreamer.release)."""
    stream_plan = plan(blocks, chosen, SLOTS)
    logging.getLogger("kiln").info(
        "[Kiln] stream_blocks %d of %d: %.2f GiB of frozen weights in host memory, a ring of %d GPU slots (%.2f GiB)",
        len(chosen),
        len(blocks),
        stream_plan.streamed_bytes / 2**30,
        stream_plan.slots,
        stream_plan.gpu_bytes() / 2**30,
    )
    return BlockStreamer(blocks, stream_plan, device, hook=False, released=released)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
