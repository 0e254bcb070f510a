"""Faults a run survives or stops on cleanly: non-finite steps and out of memory, with messages that say the fix,
and the guards the loop puts around a step, its UI callback and validation, so an error leaves a resumable run."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..config import AUTO, TrainConfig

MAX_NON_FINITE_IN_A_ROW = 3  # skipped steps in a row before the run stops (one bad batch is survivable)


class NonFiniteLoss(RuntimeError):
    """Several steps in a row had a NaN/inf loss or gradient; a resumable checkpoint was saved."""


class OutOfMemory(RuntimeError):
    """A step ran out of device memory; a resumable checkpoint at the last good step was saved."""


def first_line(error: BaseException, limit: int | None = None) -> str:
    """The error's message, first line (at most `limit` characters), for a one-line log or error; "" if empty."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else ""


def is_out_of_memory(error: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA, MPS), Python's MemoryError, and MLX's allocation failures (RuntimeError)."""
    if isinstance(error, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(error).__mro__):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        mark in text for mark in ("out of memory", "insufficient memory", "metal::malloc")
    )


def _batches(entries: list[dict]) -> str:
    return "; ".join(f"step {e['step']}: {', '.join(e['items']) or '(unnamed)'}" for e in entries)


def non_finite_message(cfg: TrainConfig, streak: list[dict], checkpoint: Path) -> str:
    steps = [e["step"] for e in streak]
    return (
        f"steps {steps[0]}–{steps[-1]}: {len(steps)} steps in a row gave a NaN/inf loss or gradient and were "
        f"skipped (weights, optimizer and EMA untouched). Batches: {_batches(streak)}. The run stopped with a "
        f"resumable checkpoint: {checkpoint}. Fix: lower learning_rate (now {cfg.learning_rate:g})"
        + (", set max_grad_norm to 1.0 (now 0: no clipping)" if cfg.max_grad_norm <= 0 else "")
        + ", check those images and captions (delete the latent cache to re-encode them), or train in "
        "mixed_precision 'bf16' or 'no' rather than on fp16 weights; then queue again (it resumes)."
    )


def _speed_settings_holding_memory(cfg: TrainConfig) -> list[str]:
    """Settings a user set that spend memory on speed, never on what trains: each the first fix to try. Their
    auto values fit what is free at the start and step back on their own (torch_backend/fallbacks.py)."""
    fixes = []
    if cfg.checkpoint_budget != AUTO and cfg.checkpoint_budget > 0:
        fixes.append(f"lower checkpoint_budget (now {cfg.checkpoint_budget:g}; 0 keeps the least, auto what fits)")
    if cfg.skip_checkpoint_blocks > 0 and cfg.gradient_checkpointing:
        fixes.append(
            f"set skip_checkpoint_blocks to 0 (now {cfg.skip_checkpoint_blocks}: those blocks keep their activations)"
        )
    if cfg.fp8_compute is True:
        fixes.append("set fp8_compute to auto or off (on a bf16 base it keeps fp8 copies of the block weights)")
    if cfg.step_graphs is True:
        fixes.append("set step_graphs to auto or off (their recorded steps share a memory pool)")
    if cfg.cuda_graphs:
        fixes.append("turn cuda_graphs off (each block's recorded graphs hold their own memory)")
    return fixes


def out_of_memory_message(
    cfg: TrainConfig, error: BaseException, step: int, items: list[str], checkpoint: Path | None
) -> str:
    fixes = [*_speed_settings_holding_memory(cfg), f"lower resolutions (now {cfg.resolutions})"]
    if cfg.batch_size > 1:
        fixes.append(f"lower batch_size (now {cfg.batch_size}; grad_accum keeps the effective batch)")
    if cfg.batch_by != "images":
        fixes.append(f"set batch_by to images (now {cfg.batch_by}: small buckets take several images a step)")
    if not cfg.gradient_checkpointing:
        fixes.append("turn gradient_checkpointing on")
    if cfg.backend == "mlx":
        if cfg.base_quantize in ("auto", "none"):
            fixes.append("set base_quantize to int8 or int4 (a quantized base)")
    else:
        fixes.append("load the base with weight_dtype fp8_e4m3fn (Load Diffusion Model) for a smaller base")
    fixes.append("close other GPU work; `python -m trainer estimate` predicts the memory a config needs")
    first = first_line(error, 300) or type(error).__name__
    saved = (
        f"Saved a resumable checkpoint at step {step}, the last good step: {checkpoint}."
        if checkpoint
        else f"There was nothing new to save at step {step}: no step had finished since the start, or this is one of "
        "several ranks (torchrun), which never save alone; the newest checkpoint resumes the run."
    )
    return (
        f"out of memory at step {step + 1} (batch: {', '.join(items) or '(unnamed)'}): {first}. {saved} "
        f"To fit: {'; '.join(fixes)}. Then queue again: an unchanged run resumes, a changed setting starts anew."
    )


class Draws:
    """Where the random draws stand before a step draws its batches: numpy generator, sampler cursor,
    backend RNG (host copies, µs). A step that fails before updating anything puts them back, so a resume
    draws the same batches."""

    def __init__(self, rng, sampler, backend):
        self.rng, self.sampler, self.backend = rng, sampler, backend
        self.states = (rng.bit_generator.state, sampler.state(), backend.rng_state())

    def put_back(self) -> None:
        self.rng.bit_generator.state = self.states[0]
        self.sampler.load_state(self.states[1])
        self.backend.load_rng_state(self.states[2])


@contextmanager
def out_of_memory_rewinds(
    cfg: TrainConfig, step: int, items: list[str], draws: Draws, save: Callable[[int], Path] | None
) -> Iterator[None]:
    """Around backend.step: out of memory becomes OutOfMemory, with the run left resumable at `step`.

    The failed step changed no weights, optimizer or EMA, so its draws go back and `step`, the last
    good one, is saved (`save` is None when none finished since the start); the message names the fixes."""
    try:
        yield
    except BaseException as error:
        if not is_out_of_memory(error):
            raise
        traceback.clear_frames(error.__traceback__)  # let the failed step's activations go now
        draws.put_back()
        checkpoint = save(step) if save is not None else None
        raise OutOfMemory(out_of_memory_message(cfg, error, step, items, checkpoint)) from error


@contextmanager
def saves_on_error(save: Callable[[int], Any], step: int) -> Iterator[None]:
    """Around a caller's on_step: it may raise (ComfyUI's stop button) with the state at a clean step
    boundary, so `step` is saved (resumable) before the error goes on."""
    try:
        yield
    except BaseException:
        save(step)
        raise


@contextmanager
def validation_out_of_memory(step: int) -> Iterator[None]:
    """Around validation sampling: out of memory becomes OutOfMemory naming the validation settings, not the
    training ones (the guard around it has saved the step)."""
    try:
        yield
    except BaseException as error:
        if not is_out_of_memory(error):
            raise
        traceback.clear_frames(error.__traceback__)
        raise OutOfMemory(
            f"out of memory while sampling validation images at step {step}; the step is saved "
            f"(resumable). In Kiln Validation Settings lower width/height, or raise every"
        ) from error


@contextmanager
def validation_saves_on_error(save: Callable[[int], Any], step: int) -> Iterator[None]:
    """Around validation sampling: any error (the stop button while sampling) saves the step just trained
    first; out of memory becomes OutOfMemory naming the validation settings, not the training ones."""
    with saves_on_error(save, step), validation_out_of_memory(step):
        yield


class Guard:
    """The loop's fault handling, in one place: a step that runs out of memory rewinds its draws and saves the
    last good step; an error in a front end's calls after a step (its progress, validation, pause: ComfyUI's
    stop button) saves that step first. Either way the run is left resumable.

    Under torchrun these error paths are one rank's alone (the others are in the step's all-reduce), and a save
    needs every rank: so nothing is saved there; torchrun stops every rank and the run resumes from its newest
    checkpoint."""

    def __init__(self, cfg: TrainConfig, save: Callable[[int], Path], world: int, start: int):
        self.cfg, self.start, self.every_rank_save = cfg, start, save
        self.save = save if world == 1 else (lambda step: None)

    def non_finite(self, streak: list[dict], done: int) -> None:
        """Too many skipped (NaN/inf) steps in a row: stop with a resumable checkpoint, saved by every rank
        (they read the same figures, so they all stop here)."""
        if len(streak) >= MAX_NON_FINITE_IN_A_ROW:
            raise NonFiniteLoss(non_finite_message(self.cfg, streak, self.every_rank_save(done)))

    def training(self, step: int, items: list[str], draws: Draws):
        """Around backend.step (nothing to save before the run's first step has finished)."""
        return out_of_memory_rewinds(self.cfg, step, items, draws, self.save if step > self.start else None)

    @contextmanager
    def front_end(self, done: int) -> Iterator[None]:
        """Around the front end's calls after step `done` (0: before the first step, nothing to save)."""
        try:
            yield
        except BaseException:
            if done:
                self.save(done)
            raise
