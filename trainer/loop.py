"""The training loop: one straight story from config to a saved LoRA.

    setup → (resume) → for step: batch → backend.step → EMA → report → checkpoint → final save

Everything random is drawn here, from one numpy generator seeded by cfg.seed
(noise, sigmas, caption dropout) plus the sampler's own seeded plan, so both
backends see the same draws and a resumed run continues bit for bit.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import lora_format, objective, state
from .archs import Arch, get_arch
from .backends import get_backend
from .config import TrainConfig
from .data import TrainingData
from .data.sampler import BucketSampler
from .lora_format import LoraWeights
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


def lora_metadata(cfg: TrainConfig, arch: Arch, step: int) -> dict[str, str]:
    return lora_format.build_metadata(
        arch_name=arch.name, config=cfg.to_dict(), steps=step,
        trigger_words=[cfg.trigger_word] if cfg.trigger_word else [],
        title=cfg.run_name or f"{arch.name} LoRA")


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

        pending: list = []  # device scalars not yet read (no host sync per step)

        def flush() -> None:
            values = backend.scalars([v for stats in pending for v in (stats.loss, stats.grad_norm)])
            history.loss.extend(values[0::2])
            history.grad_norm.extend(values[1::2])
            pending.clear()

        started, checkpoint_path, stopped = time.perf_counter(), None, False
        for step in range(start, cfg.steps):
            lr = lr_at(step, base_lr=cfg.learning_rate, schedule=cfg.lr_schedule, total_steps=cfg.steps,
                       warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio)
            micro_batches = [build_batch(data, sampler.next(), rng, settings, arch, cfg.caption_dropout)
                             for _ in range(cfg.grad_accum)]
            pending.append(backend.step(micro_batches, lr))
            backend.update_ema()
            history.lr.append(lr)
            done = step + 1
            logged = done % cfg.log_every == 0 or done == cfg.steps
            if logged:
                flush()
            elapsed = time.perf_counter() - started
            rate = (done - start) / elapsed if elapsed > 0 else 0.0
            report = Report(step=done, total_steps=cfg.steps, lr=lr, it_per_s=rate,
                            eta_s=(cfg.steps - done) / rate if rate > 0 else 0.0,
                            peak_memory_bytes=backend.peak_memory_bytes(),
                            loss=history.loss[-1] if logged else None,
                            loss_smooth=smoothed(history.loss[-200:])[-1] if logged else None,
                            grad_norm=history.grad_norm[-1] if logged else None, weights=best_lora)
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
                except BaseException:
                    save(done)  # the stop button during sampling: keep the step just trained
                    raise
            if should_stop is not None and should_stop():
                checkpoint_path, stopped = save(done), True
                break
            if done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                checkpoint_path = save(done)
        flush()
        ema_lora = None
        if cfg.ema:
            with backend.ema_weights():
                ema_lora = backend.lora_state()
        return RunResult(run_dir=run_dir, step=len(history.lr), history=history, lora=backend.lora_state(),
                         ema_lora=ema_lora, checkpoint=checkpoint_path, stopped=stopped,
                         trainable_parameters=backend.trainable_parameter_count(),
                         skipped_items=[p.line() for p in getattr(data, "skipped", [])])
    finally:
        backend.teardown()
