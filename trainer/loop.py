"""The training loop: one straight story from config to a saved LoRA.

    setup → (resume) → for step: batch → backend.step → EMA → report → checkpoint → final save

Everything random is drawn here, from one numpy generator seeded by cfg.seed
(noise, sigmas, caption dropout) plus the sampler's own seeded plan, so both
backends see the same draws and a resumed run continues bit for bit.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import faults, objective, state
from .archs import Arch, get_arch
from .backends import get_backend
from .config import TrainConfig
from .data import TrainingData
from .data.sampler import BucketSampler
from .lora_format import LoraWeights, lora_metadata
from .plot import smoothed
from .schedules import lr_at


@dataclass
class Report:
    """What a UI shows after each step; loss figures only on steps where the loss was read."""

    step: int                    # optimizer steps done
    total_steps: int
    lr: float
    it_per_s: float
    eta_s: float
    peak_memory_bytes: int
    loss: float | None = None
    loss_smooth: float | None = None
    grad_norm: float | None = None
    skipped_steps: int = 0       # steps skipped so far for a NaN/inf loss or gradient (as read)
    weights: Callable[[], dict[str, LoraWeights]] | None = field(default=None, repr=False, compare=False)  # best LoRA now


@dataclass
class RunResult:
    run_dir: Path
    step: int
    history: state.History
    lora: dict[str, LoraWeights]
    ema_lora: dict[str, LoraWeights] | None
    checkpoint: Path | None
    stopped: bool = False
    trainable_parameters: int = 0
    skipped_items: list[str] = field(default_factory=list)


def objective_settings(cfg: TrainConfig, arch: Arch) -> objective.ObjectiveSettings:
    """Config + arch default → the flat settings objective.py takes."""
    shift_mode = arch.shift_mode if cfg.shift_mode == "auto" else cfg.shift_mode
    shift = arch.shift if cfg.shift_mode == "auto" else cfg.shift
    return objective.ObjectiveSettings(
        sampling=cfg.timestep_sampling, logit_mean=cfg.logit_mean, logit_std=cfg.logit_std,
        content_or_style=cfg.content_or_style, shift_mode=shift_mode, shift=shift,
        loss_weighting=cfg.loss_weighting)


def build_batch(data: TrainingData, indices: list[int], rng: np.random.Generator,
                settings: objective.ObjectiveSettings, arch: Arch, caption_dropout: float):
    """Stack one bucket's items and draw its noise, sigmas and caption dropout."""
    from .backends.base import Batch

    latents = np.stack([data.latent(i) for i in indices]).astype(np.float32, copy=False)  # [B,C,H,W]
    tokens_img = (latents.shape[2] // arch.patch) * (latents.shape[3] // arch.patch)  # what the model attends over
    draws = objective.draw(rng, latents.shape, settings, caption_dropout, image_tokens=tokens_img)
    # Shuffled-tag variants are drawn only where an item has several, so other runs' draws are unchanged.
    variants = [int(rng.integers(n)) if n > 1 else 0 for n in (data.variants(i) for i in indices)]
    contexts = [data.empty_context() if drop else data.context(i, v)
                for i, v, drop in zip(indices, variants, draws.drop_caption)]
    lengths = [c.shape[0] for c in contexts]
    return Batch(latents=latents, noise=draws.noise, sigmas=draws.sigmas, weights=draws.weights,
                 context=arch.collate_context(contexts), extras=arch.model_extras(len(indices), lengths),
                 items=[data.name(i) for i in indices])


def _finite(value: float) -> float | None:
    """A figure for a UI (JSON has no NaN): None when not finite."""
    return value if np.isfinite(value) else None


def train(cfg: TrainConfig, model: Any, data: TrainingData, *, run_dir: str | Path,
          forward: Callable | None = None, resume: str | Path | None = None,
          on_step: Callable[[Report], None] | None = None,
          should_stop: Callable[[], bool] | None = None,
          validate: Callable[[int, Callable], None] | None = None, validate_every: int = 0) -> RunResult:
    """Train a LoRA on `model` in place; the model is restored as it was on return, also after an error.

    `validate(step, lora)` runs every `validate_every` steps and at the last step, with the EMA
    weights swapped in when EMA is on. A torch model samples with its LoRA branches live; `lora()`
    gives the weights as numpy for a sampler that needs them applied (the MLX backend)."""
    arch = get_arch(cfg.arch)
    run_dir = Path(run_dir)
    backend = get_backend(cfg.backend)
    rng = np.random.default_rng(cfg.seed)
    settings = objective_settings(cfg, arch)
    sampler = BucketSampler(data.buckets, cfg.batch_size, cfg.seed)
    history = state.History()
    start = 0
    backend.setup(model, cfg, arch, forward)
    try:
        if resume is not None:
            checkpoint = state.load_checkpoint(resume)
            history = state.restore(checkpoint, backend=backend, numpy_rng=rng, sampler=sampler)
            start = checkpoint.step

        def save(step: int) -> Path:
            flush()
            return state.save_checkpoint(
                run_dir, step, backend=backend, arch=arch, config=cfg.to_dict(), numpy_rng=rng,
                cursor=sampler.state(), history=history, keep=cfg.keep_checkpoints,
                lora_metadata=lora_metadata(cfg, arch, step), save_dtype=cfg.save_dtype)

        def best_lora() -> dict[str, LoraWeights]:
            """What a user keeps (a UI's "save now"): the EMA weights when EMA is on, else the trained ones."""
            if not cfg.ema:
                return backend.lora_state()
            with backend.ema_weights():
                return backend.lora_state()

        pending: list = []  # (step, image names, StepStats): device scalars not yet read (no host sync per step)
        streak: list = []   # the latest run of consecutive skipped (non-finite) steps

        def flush() -> None:
            values = backend.scalars([v for _, _, stats in pending for v in (stats.loss, stats.grad_norm, stats.finite)])
            for (step_done, items, _), loss, norm, finite in zip(pending, values[0::3], values[1::3], values[2::3]):
                history.loss.append(loss)
                history.grad_norm.append(norm)
                if finite:
                    streak.clear()
                else:  # the backend left weights, optimizer and EMA alone: count it and name the images
                    history.skipped.append({"step": step_done, "items": items})
                    streak.append(history.skipped[-1])
            pending.clear()

        started, checkpoint_path, stopped = time.perf_counter(), None, False
        for step in range(start, cfg.steps):
            lr = lr_at(step, base_lr=cfg.learning_rate, schedule=cfg.lr_schedule, total_steps=cfg.steps,
                       warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio)
            draws_before = (rng.bit_generator.state, sampler.state(), backend.rng_state())  # host copies, µs
            micro_batches = [build_batch(data, sampler.next(), rng, settings, arch, cfg.caption_dropout)
                             for _ in range(cfg.grad_accum)]
            names = [name for batch in micro_batches for name in batch.items]
            done = step + 1
            try:
                stats = backend.step(micro_batches, lr)
            except BaseException as error:
                if not faults.is_out_of_memory(error):
                    raise
                traceback.clear_frames(error.__traceback__)  # let the failed step's activations go now
                # Weights, optimizer and EMA are still those of `step`; put the draws back to match.
                rng.bit_generator.state = draws_before[0]
                sampler.load_state(draws_before[1])
                backend.load_rng_state(draws_before[2])
                checkpoint = save(step) if step > start else None
                raise faults.OutOfMemory(faults.out_of_memory_message(cfg, error, step, names, checkpoint)) from error
            pending.append((done, names, stats))
            backend.update_ema()
            history.lr.append(lr)
            logged = done % cfg.log_every == 0 or done == cfg.steps
            if logged:
                flush()
            if len(streak) >= faults.MAX_NON_FINITE_IN_A_ROW:
                raise faults.NonFiniteLoss(faults.non_finite_message(cfg, streak, save(done)))
            elapsed = time.perf_counter() - started
            rate = (done - start) / elapsed if elapsed > 0 else 0.0
            report = Report(step=done, total_steps=cfg.steps, lr=lr, it_per_s=rate,
                            eta_s=(cfg.steps - done) / rate if rate > 0 else 0.0,
                            peak_memory_bytes=backend.peak_memory_bytes(),
                            loss=_finite(history.loss[-1]) if logged else None,
                            loss_smooth=_finite(smoothed(history.loss[-200:])[-1]) if logged else None,
                            grad_norm=_finite(history.grad_norm[-1]) if logged else None,
                            skipped_steps=len(history.skipped), weights=best_lora)
            try:
                if on_step is not None:
                    on_step(report)  # may raise (ComfyUI's stop button): state is at a clean step boundary
            except BaseException:
                save(done)
                raise
            if validate is not None and validate_every and (done % validate_every == 0 or done == cfg.steps):
                try:
                    with backend.sampling():
                        validate(done, backend.lora_state)
                except BaseException as error:
                    save(done)  # the stop button during sampling: keep the step just trained
                    if faults.is_out_of_memory(error):
                        traceback.clear_frames(error.__traceback__)
                        raise faults.OutOfMemory(
                            f"out of memory while sampling validation images at step {done}; the step is saved "
                            f"(resumable). In Kiln Validation Settings lower width/height, or raise every") from error
                    raise
            if should_stop is not None and should_stop():
                checkpoint_path, stopped = save(done), True
                break
            if done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                checkpoint_path = save(done)
        flush()
        ema_lora = best_lora() if cfg.ema else None
        return RunResult(run_dir=run_dir, step=len(history.lr), history=history, lora=backend.lora_state(),
                         ema_lora=ema_lora, checkpoint=checkpoint_path, stopped=stopped,
                         trainable_parameters=backend.trainable_parameter_count(),
                         skipped_items=[p.line() for p in getattr(data, "skipped", [])])
    finally:
        backend.teardown()
