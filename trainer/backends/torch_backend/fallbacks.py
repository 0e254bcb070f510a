"""What an "auto" lever does when its choice fails in a step (TorchBackend.step): it steps back, the run
says so once, and the step is redone from its start, so nothing of the run is lost. Each applies only to
a lever left at "auto" (a number or on/off the user set stands, and its error with it), and none under
torchrun (one rank alone must not change what it computes).

- compile_blocks: torch.compile failed on this machine → eager blocks.
- step_graphs, out of GPU memory: their pool goes, first (it only buys small buckets' speed).
- checkpoint_budget, out of GPU memory: plain checkpointing (budget 0); the estimate is an estimate.
- stream_blocks, out of GPU memory with budget 0: a quarter of the blocks more stream from host memory
  (memory_plan.py), until all do.
"""

from __future__ import annotations

import dataclasses
import traceback

from ...config import AUTO
from ...run.faults import first_line, is_out_of_memory
from .checkpointing import CompileFailed
from . import memory_plan
from .levers import log


def recover(backend, error: BaseException) -> bool:
    """Step back the auto lever `error` is about (True: redo the step), else False: the error stands."""
    if backend.parallel:
        return False
    if isinstance(error, CompileFailed):
        return _compile_off(backend, error)
    if not is_out_of_memory(error):
        return False
    traceback.clear_frames(error.__traceback__)  # the failed step's activations go now
    return any(step_down(backend, error) for step_down in OUT_OF_MEMORY)  # the first that applies


def _compile_off(backend, error: BaseException) -> bool:
    chosen = backend.levers
    if not (chosen.compile and backend.cfg.compile_blocks == AUTO):
        return False
    inner = getattr(error.__cause__, "inner_exception", None) or error.__cause__ or error
    note = f"{chosen.note}; compile failed"
    _step_back(backend, dataclasses.replace(chosen, compile=False, budget=0.0, cuda_graphs=False, note=note))
    log.warning(
        "[Kiln] compile_blocks auto: torch.compile failed here (%s: %s). Training goes on without "
        "compiled blocks (slower); set compile_blocks off to skip the attempt.",
        type(inner).__name__,
        first_line(inner, 300),
    )
    return True


def _graphs_off(backend, error: BaseException) -> bool:
    chosen = backend.levers
    if not (backend.cfg.step_graphs == AUTO and backend.graphs is not None and backend.graphs.graphs):
        return False
    note = f"{chosen.note}; out of memory with step graphs: off"
    _step_back(backend, dataclasses.replace(chosen, step_graphs=False, note=note), rewrap=False)
    log.warning(
        "[Kiln] step_graphs auto: a step ran out of GPU memory beside the step graphs' pool (%s). "
        "Training goes on without them (small buckets slower); set step_graphs off to skip them.",
        first_line(error, 200),
    )
    return True


def _budget_zero(backend, error: BaseException) -> bool:
    chosen = backend.levers
    if not (backend.cfg.checkpoint_budget == AUTO and chosen.budget > 0):
        return False
    note = f"{chosen.note}; out of memory at budget {chosen.budget:g}: 0"
    _step_back(backend, dataclasses.replace(chosen, budget=0.0, note=note))
    log.warning(
        "[Kiln] checkpoint_budget auto: budget %g ran out of GPU memory (%s). Training goes on with "
        "plain checkpointing (budget 0; blocks compile again). Set checkpoint_budget to a number to "
        "choose yourself.",
        chosen.budget,
        first_line(error, 200),
    )
    return True


def _stream_more(backend, error: BaseException) -> bool:
    plan = backend.memory
    gpu = backend.device.type in memory_plan.STREAMS_ON  # elsewhere streaming frees no memory
    if not (gpu and backend.cfg.stream_blocks == AUTO and plan.stream < plan.blocks):
        return False
    count = min(plan.blocks, plan.stream + max(1, plan.blocks // 4))
    released = backend.stream.release() if backend.stream is not None else ({}, [])
    backend.memory = plan.with_stream(count, f"out of memory with {plan.stream} streamed: {count}")
    backend.stream = backend._stream(released)
    # blocks wrapped anew over the larger stream; no step graphs over its copies (levers.step_graphs)
    _step_back(backend, dataclasses.replace(backend.levers, step_graphs=False))
    log.warning(
        "[Kiln] stream_blocks auto: a step ran out of GPU memory with %d of %d blocks streamed (%s). Training "
        "goes on with %d streamed from host memory. Set stream_blocks to a number to choose yourself.",
        plan.stream,
        plan.blocks,
        first_line(error, 200),
        count,
    )
    return True


# Out of GPU memory: the auto levers step down in this order, cheapest in speed first.
OUT_OF_MEMORY = (_graphs_off, _budget_zero, _stream_more)


def _step_back(backend, levers, rewrap: bool = True) -> None:
    """The failed step's gradients go; blocks wrapped anew for the new levers (compile, budget), and fresh
    step graphs (any recorded over the old blocks must not replay)."""
    backend.optimizer.zero_grad(set_to_none=True)
    backend.levers = levers
    if rewrap:
        backend._unwrap_blocks()
        backend._wrap_blocks(levers)
    backend.graphs = backend._step_graphs()
