"""Each micro-batch's forward and backward replayed as one CUDA graph per batch shape (`step_graphs`).

At 512-768 px the host paces a step: a Klein 4B step's ~3,000 kernels are launched by ~55 ms of Python
(dynamo's guards, inductor's wrappers, autograd) against ~50 ms of GPU work (bench/RESULTS.md). A CUDA
graph replays the recorded kernels with one launch and none of that Python, whatever the blocks' mode.

One graph per batch signature (tensor shapes and dtypes, and the host values that choose shapes), recorded
at the signature's second micro-batch: its first runs as before, because what a first call does (dynamo
compiles, Triton autotunes, cuBLAS and cuDNN choose plans) may not happen inside a capture. The graphs
share one memory pool (replayed one at a time, nothing of one read by another), so the pool holds the
largest step's activations once, not once per bucket. The gradients are fixed tensors every graph adds
into, zeroed after each optimizer step instead of freed; the optimizer, clipping and EMA stay outside the
graphs (a few multi-tensor kernels, and the learning rate may change each step).

A capture that fails (an op that waits for the host, a graph that does not fit) turns the graphs off for
the run with one log line; capturing runs no kernel, so the micro-batch then runs as before and no step
is lost or counted twice.
"""

from __future__ import annotations

import itertools
import logging
import os
import traceback
from collections import Counter
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

from ...run.faults import first_line

log = logging.getLogger("kiln")

# A/B switch for bench/ (on in every run the config allows).
ENABLED = True


def signature(inputs, device: torch.device) -> tuple | None:
    """What a recorded graph is specific to: the inputs' structure, each `device` tensor's shape and dtype,
    other tensors' and plain values' values (host numbers choose shapes or code). None where a value is not
    hashable."""
    leaves, spec = pytree.tree_flatten(inputs)
    parts = []
    for leaf in leaves:
        if torch.is_tensor(leaf):
            parts.append(
                ("device", leaf.dtype, tuple(leaf.shape))
                if leaf.device.type == device.type
                else ("host", leaf.dtype, tuple(leaf.flatten().tolist()))
            )
            continue
        try:
            hash(leaf)
        except TypeError:
            return None
        parts.append(("value", leaf))
    return repr(spec), tuple(parts)


class CudaRecorder:
    """CUDA graph capture on a side stream into one private pool shared by every graph of the run.

    Not torch.cuda.graph's context: it collects garbage and empties the allocator's cache at each capture
    (~0.5 s of a large process, once per bucket shape). Errors are the capturing thread's only
    ("thread_local"): ComfyUI's server thread reading free memory mid-capture must not void it."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()

    def record(self, fn: Callable[[], torch.Tensor]):
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream())  # the static inputs' copies come first
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                out = fn()
            except BaseException:
                try:  # the capture is void; ending it raises "a previous error during capture": fn's error says why
                    graph.capture_end()
                except Exception:  # noqa: BLE001, S110
                    pass
                raise
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)
        return graph.replay, out


class _Recorded:
    def __init__(self, statics: list[torch.Tensor], replay, out: torch.Tensor):
        self.statics, self.replay, self.out = statics, replay, out


def _device_leaves(inputs, device: torch.device) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(inputs) if torch.is_tensor(leaf) and leaf.device.type == device.type]


def _where(error: BaseException) -> str:
    """The innermost frame of the failure outside torch itself (the model's or Kiln's line that did it)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f"{os.sep}torch{os.sep}" not in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def weights_at(model: torch.nn.Module | None) -> tuple:
    """Where the model's weights and buffers lie: a recorded graph reads them there."""
    if model is None:
        return ()
    return tuple(t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers()))


class StepGraphs:
    """`run(inputs, fn)`: fn(inputs) → the micro-batch's detached loss, after its backward; eager at a
    signature's first call, recorded at its second, replayed from then on.

    `model`: the graphs read its weights where they lay at recording. ComfyUI may put new tensors in their
    place between steps (sampling loads the model without the training adapter, or evicts it for the VAE,
    and loads the training model again), so the graphs are dropped and recorded anew when that happened."""

    def __init__(
        self, params: list[torch.Tensor], device: torch.device, recorder=None, model: torch.nn.Module | None = None
    ):
        self.params, self.device, self.model = params, device, model
        self.recorder = recorder or CudaRecorder()
        self.graphs: dict[tuple, _Recorded] = {}
        self.seen: Counter = Counter()
        self.off = False
        self.weights: tuple = ()  # where the model's weights lay at the last recording (weights_at)

    def run(self, inputs, fn: Callable) -> torch.Tensor:
        key = None if self.off else signature(inputs, self.device)
        if key is None:
            return fn(inputs)
        if self.graphs and weights_at(self.model) != self.weights:
            log.info("[Kiln] step_graphs: the model's weights were reloaded (sampling); its shapes are recorded again")
            self.graphs.clear()
            self.seen.clear()
        recorded = self.graphs.get(key)
        if recorded is None:
            self.seen[key] += 1
            if self.seen[key] < 2:
                return fn(inputs)
            recorded = self._record(key, inputs, fn)
            if recorded is None:
                return fn(inputs)
        torch._foreach_copy_(recorded.statics, _device_leaves(inputs, self.device))
        recorded.replay()
        return recorded.out

    def _record(self, key, inputs, fn) -> _Recorded | None:
        # Gradients every graph adds into: allocated outside the pool, here to stay (zeroed, not freed).
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        static = pytree.tree_map(
            lambda leaf: leaf.clone() if torch.is_tensor(leaf) and leaf.device.type == self.device.type else leaf,
            inputs,
        )
        try:
            replay, out = self.recorder.record(lambda: fn(static))
        except Exception as error:  # noqa: BLE001 — any failed capture: the run goes on without graphs
            self.off, self.graphs = True, {}
            log.warning(
                "[Kiln] step_graphs: this step could not be recorded as a CUDA graph (%s: %s, at %s). "
                "Training goes on without step graphs (host-paced at small buckets); set step_graphs off "
                "to skip the attempt.",
                type(error).__name__,
                first_line(error, 300),
                _where(error),
            )
            return None
        self.graphs[key] = recorded = _Recorded(_device_leaves(static, self.device), replay, out)
        self.weights = weights_at(self.model)
        return recorded
