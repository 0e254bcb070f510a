"""The training loop: one straight story from config to a saved LoRA.

    setup → (resume) → for step: batch → backend.step → EMA → report → checkpoint → final save

Everything random is drawn here, from one numpy generator seeded by cfg.seed
(noise, sigmas, caption dropout) plus the sampler's own seeded plan, so both
backends see the same draws and a resumed run continues bit for bit.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..archs import Arch, get_arch
from ..atomic import fault_point
from ..backends import get_backend
from ..config import TrainConfig
from ..data import TrainingData, companion_batch
from ..data.sampler import BATCHING, BucketSampler
from ..lora.files import LoraWeights, lora_metadata
from ..objective import flow as objective
from ..objective import preservation
from ..objective.schedules import lr_at
from . import distributed, faults, holdout, init_lora, pause, state
from . import sinks as logging_sinks
from .plot import smoothed


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
    holdout_loss: float | None = None   # on steps with a held-out evaluation (trainer/run/holdout.py)
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
    best: holdout.Best | None = None     # the best held-out evaluation (holdout > 0)
    best_lora: Path | None = None        # <run>/best/lora.safetensors: that step's LoRA
    early_stopped: bool = False          # ended by early_stop_patience


def objective_settings(cfg: TrainConfig, arch: Arch) -> objective.ObjectiveSettings:
    """Config + arch default → the flat settings objective.py takes."""
    shift_mode = arch.shift_mode if cfg.shift_mode == "auto" else cfg.shift_mode
    shift = arch.shift if cfg.shift_mode == "auto" else cfg.shift
    return objective.ObjectiveSettings(
        sampling=cfg.timestep_sampling, logit_mean=cfg.logit_mean, logit_std=cfg.logit_std,
        content_or_style=cfg.content_or_style, shift_mode=shift_mode, shift=shift,
        loss_weighting=cfg.loss_weighting, unmasked_weight=cfg.unmasked_weight)


def build_batch(data: TrainingData, indices: list[int], rng: np.random.Generator,
                settings: objective.ObjectiveSettings, arch: Arch, caption_dropout: float,
                group: distributed.Group = distributed.SINGLE, preserve: preservation.Settings = preservation.OFF):
    """Stack one bucket's items and draw its noise, sigmas and caption dropout.

    `indices` is the global batch; under torchrun every rank draws the randomness of all of it (the
    generator stays in lockstep on every rank) and keeps the rows of its share (distributed.Group.rows)."""
    from ..backends.base import Batch

    rows, scale = group.rows(len(indices))
    mine = [indices[row] for row in rows]
    latents = np.stack([data.latent(i) for i in mine]).astype(np.float32, copy=False)  # [b,C,H,W]
    shape = (len(indices), *latents.shape[1:])                                          # the global [B,C,H,W]
    tokens_img = (shape[2] // arch.patch) * (shape[3] // arch.patch)  # what the model attends over
    draws = objective.draw(rng, shape, settings, caption_dropout, image_tokens=tokens_img)
    # Shuffled-tag variants are drawn only where an item has several, so other runs' draws are unchanged.
    variants = [int(rng.integers(n)) if n > 1 else 0 for n in (data.variants(i) for i in indices)]
    noise, sigmas, weights = draws.noise, draws.sigmas, draws.weights
    if len(rows) != len(indices):   # one of several ranks: its rows, scaled (distributed.Group.rows)
        noise, sigmas, weights = noise[rows], sigmas[rows], (weights[rows] * scale).astype(np.float32)
    contexts = [data.empty_context() if draws.drop_caption[row] else data.context(indices[row], variants[row])
                for row in rows]
    lengths = [c.shape[0] for c in contexts]
    names = [data.name(i) for i in indices]
    extras = {**arch.model_extras(len(rows), lengths),
              **companion_batch.reference_extras([data.controls(i) for i in mine], arch, names)}
    batch = Batch(latents=latents, noise=noise, sigmas=sigmas, weights=weights,
                  context=arch.collate_context(contexts), extras=extras, items=names,
                  mask=companion_batch.mask_weights([data.mask(i) for i in mine], shape, settings.unmasked_weight))
    # Regularisation rows' loss weight; DOP's class-word captions (trainer/objective/preservation.py). No draws.
    return preservation.complete(batch, data, mine, [variants[row] for row in rows], contexts, scale, arch, preserve)


def batch_sizes(cfg: TrainConfig, data: TrainingData, arch: Arch) -> dict[str, int]:
    """Images per batch of each bucket (cfg.batch_by), from its tokens per image: image tokens (one
    latent of the bucket) plus the caption's padded minimum."""
    def tokens(indices: list[int]) -> int:
        _, height, width = data.latent(indices[0]).shape
        return (height // arch.patch) * (width // arch.patch) + arch.context_tokens

    per_image = {key: tokens(indices) for key, indices in data.buckets.items() if indices}
    return BATCHING[cfg.batch_by](per_image, cfg.batch_size)


def _finite(value: float) -> float | None:
    """A figure for a UI (JSON has no NaN): None when not finite."""
    return value if np.isfinite(value) else None


class StepLog:
    """Step figures into the history. The backend's loss, norm and finite flag stay device scalars until
    `flush` reads them all in one transfer (no host sync per step); it also keeps the latest run of
    consecutive skipped (non-finite) steps, which stops the run when too long."""

    def __init__(self, backend, history: state.History, start: int, total_steps: int,
                 sinks: logging_sinks.Sinks | None = None):
        self.backend, self.history, self.start, self.total_steps = backend, history, start, total_steps
        self.sinks = sinks or logging_sinks.Sinks([])   # TensorBoard / W&B: each step's figures as read
        self.pending: list = []  # (step, image names, StepStats, lr) not yet read
        self.streak: list = []   # history.skipped entries of the latest run of skipped steps
        self.started = time.perf_counter()

    def add(self, step: int, items: list[str], stats, lr: float) -> None:
        self.pending.append((step, items, stats, lr))
        self.history.lr.append(lr)

    def flush(self) -> None:
        stats = [v for _, _, s, _ in self.pending for v in (s.loss, s.grad_norm, s.finite)]
        values = self.backend.scalars(stats)
        for (step_done, items, _, lr), loss, norm, finite in zip(self.pending, values[0::3], values[1::3],
                                                                 values[2::3]):
            self.history.loss.append(loss)
            self.history.grad_norm.append(norm)
            self.sinks.log_scalars(step_done, {"loss": loss, "grad_norm": norm, "learning_rate": lr})
            if finite:
                self.streak.clear()
            else:  # the backend left weights, optimizer and EMA alone: count it and name the images
                self.history.skipped.append({"step": step_done, "items": items})
                self.streak.append(self.history.skipped[-1])
        self.pending.clear()

    def report(self, done: int, lr: float, logged: bool, weights: Callable[[], dict[str, LoraWeights]],
               holdout_loss: float | None = None) -> Report:
        """Speed and ETA over the steps of this call; loss figures only where `logged` (just flushed)."""
        elapsed = time.perf_counter() - self.started
        rate = (done - self.start) / elapsed if elapsed > 0 else 0.0
        history = self.history
        return Report(step=done, total_steps=self.total_steps, lr=lr, it_per_s=rate,
                      eta_s=(self.total_steps - done) / rate if rate > 0 else 0.0,
                      peak_memory_bytes=self.backend.peak_memory_bytes(),
                      loss=_finite(history.loss[-1]) if logged else None,
                      loss_smooth=_finite(smoothed(history.loss[-200:])[-1]) if logged else None,
                      grad_norm=_finite(history.grad_norm[-1]) if logged else None,
                      skipped_steps=len(history.skipped), weights=weights, holdout_loss=holdout_loss)


def resumed(resume: str | Path | None, backend, rng: np.random.Generator,
            sampler: BucketSampler, group: distributed.Group = distributed.SINGLE,
            init_sha256: str = "") -> tuple[state.History, int]:
    """(history, first step): a new run's, or the checkpoint's at `resume` with all its state put back.
    A run started from another init LoRA (or from none, or from one) than the config's is refused."""
    if resume is None:
        return state.History(), 0
    checkpoint = state.load_checkpoint(resume)
    started = checkpoint.info.get("config", {}).get("init_lora_sha256", "")
    if started != init_sha256:
        said = [f"init LoRA sha256 {sha[:12]}…" if sha else "a new LoRA" for sha in (started, init_sha256)]
        raise ValueError(f"{checkpoint.path}: this run started from {said[0]}, but the config gives "
                         f"{said[1]} (init_lora); resume with the run's own init_lora file, or start a "
                         "new run (another run_name)")
    history = state.restore(checkpoint, backend=backend, numpy_rng=rng, sampler=sampler,
                            rank=group.rank, world=group.world)
    return history, checkpoint.step


def best_lora(backend, ema: bool) -> dict[str, LoraWeights]:
    """What a user keeps (a UI's "save now"): the EMA weights when EMA is on, else the trained ones."""
    if not ema:
        return backend.lora_state()
    with backend.ema_weights():
        return backend.lora_state()


def save_run(step: int, *, cfg: TrainConfig, arch: Arch, backend, run_dir: Path, rng: np.random.Generator,
             sampler: BucketSampler, log: StepLog) -> Path:
    """A resumable checkpoint at `step`; pending step figures are read first so its history is whole.
    Under torchrun every rank calls it: their RNG states go into rank 0's checkpoint, which only rank 0
    writes; the others wait until it is complete."""
    log.flush()
    rng_states = distributed.gather_arrays(backend.rng_state())
    group = distributed.current()
    path = state.step_dir(run_dir, step)
    if group.is_main:
        path = state.save_checkpoint(
            run_dir, step, backend=backend, arch=arch, config=cfg.to_dict(), numpy_rng=rng,
            cursor=sampler.state(), history=log.history, keep=cfg.keep_checkpoints,
            lora_metadata=lora_metadata(cfg, arch, step), save_dtype=cfg.save_dtype, rank_rng=rng_states[1:])
    distributed.barrier()
    return path


def _one_rank_save(save: Callable[[int], Path], group: distributed.Group) -> Callable[[int], Path | None]:
    """The save of an error path, which one rank may take alone (out of memory, an error in a UI callback or
    in validation): under torchrun it saves nothing, since a save needs every rank and the others are in the
    step's all-reduce; the run ends (torchrun stops every rank) and resumes from its newest checkpoint."""
    return save if group.world == 1 else (lambda step: None)


def _validate_at(done: int, validate: Callable, backend, sinks, group, alone) -> None:
    """validate(done, lora) on rank 0, its images to the sinks; the others wait at the host barrier."""
    if group.is_main:   # an error saves the step just trained (nothing to save before the first)
        guard = faults.validation_saves_on_error(alone, done) if done else contextlib.nullcontext()
        with guard, backend.sampling():
            sinks.log_images(done, "validation", validate(done, backend.lora_state))
    distributed.barrier()


def train(cfg: TrainConfig, model: Any, data: TrainingData, *, run_dir: str | Path,
          forward: Callable | None = None, resume: str | Path | None = None,
          on_step: Callable[[Report], None] | None = None,
          should_stop: Callable[[], bool] | None = None,
          validate: Callable[[int, Callable], None] | None = None, validate_every: int = 0,
          init: init_lora.InitLora | None = None, validate_first: bool = False,
          should_pause: Callable[[], bool] | None = None,
          on_pause: Callable[[bool], None] | None = None) -> RunResult:
    """Train a LoRA on `model` in place; the model is restored as it was on return, also after an error.

    A new run starts from `init` (else from the file cfg.init_lora names, else a new LoRA), at its rank
    and alpha (trainer/run/init_lora.py); a resumed run continues from its checkpoint.

    `validate(step, lora)` runs every `validate_every` steps and at the last step (and at step 0 of a new
    run with `validate_first`), with the EMA
    weights swapped in when EMA is on; the images it returns ([H,W,3] in 0..1, or None) go to the
    TensorBoard / W&B sinks the config asks for. A torch model samples with its LoRA branches live; `lora()`
    gives the weights as numpy for a sampler that needs them applied (the MLX backend).

    cfg.holdout keeps images out of training for a held-out loss, early stopping and <run>/best/
    (trainer/run/holdout.py); while `should_pause()` the loop waits between steps (trainer/run/pause.py), agreed
    between torchrun's ranks, and says so through `on_pause(True)` / `on_pause(False)`."""
    cfg, init = init_lora.prepare(cfg, init)   # before anything reads rank or alpha, or saves the config
    arch, run_dir, backend = get_arch(cfg.arch), Path(run_dir), get_backend(cfg.backend)
    group = distributed.start(cfg.device, cfg.backend)   # one process, or this rank of torchrun's
    rng = np.random.default_rng(cfg.seed)
    settings = objective_settings(cfg, arch)
    data, held = holdout.prepare(cfg, data)   # held-out images leave the buckets training sees
    # One seeded sampler of global batches: under torchrun each rank trains on its rows of each.
    global_sizes = {key: size * group.world for key, size in batch_sizes(cfg, data, arch).items()}
    sampler = BucketSampler(data.buckets, global_sizes, cfg.seed)
    preserve = preservation.settings(cfg, data)   # DOP and regularisation images, checked against the data
    companion_batch.check(cfg, data, arch)
    backend.setup(model, cfg, arch, forward)
    sinks = logging_sinks.Sinks([])
    try:
        history, start = resumed(resume, backend, rng, sampler, group, cfg.init_lora_sha256)
        if init is not None and resume is None:   # every rank reads the same weights
            init_lora.load_into(backend, init, cfg.ema)
        sinks = logging_sinks.open_sinks(cfg, run_dir, start, group.is_main)
        log = StepLog(backend, history, start, cfg.steps, sinks)
        judge = holdout.Judge(cfg, arch, data, held, run_dir=run_dir, history=history, sinks=sinks, main=group.is_main)
        save = functools.partial(save_run, cfg=cfg, arch=arch, backend=backend, run_dir=run_dir, rng=rng,
                                 sampler=sampler, log=log)
        alone = _one_rank_save(save, group)
        weights = functools.partial(best_lora, backend, cfg.ema)
        stopped, vote = False, distributed.StopVote()
        early_stopped = judge.ended(start)   # a resumed run that had stopped early ends at once, as it was
        checkpoint_path = state.step_dir(run_dir, start) if early_stopped else None
        if validate is not None and validate_first and start == 0:   # the start, logged as step 0
            _validate_at(0, validate, backend, sinks, group, alone)
        for step in range(start, start if early_stopped else cfg.steps):
            lr = lr_at(step, base_lr=cfg.learning_rate, schedule=cfg.lr_schedule, total_steps=cfg.steps,
                       warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio)
            draws = faults.Draws(rng, sampler, backend)  # an out-of-memory step puts its draws back
            micro_batches = [build_batch(data, sampler.next(), rng, settings, arch, cfg.caption_dropout, group,
                                         preserve) for _ in range(cfg.grad_accum)]
            names = [name for batch in micro_batches for name in batch.items]
            done = step + 1
            with faults.out_of_memory_rewinds(cfg, step, names, draws, alone if step > start else None):
                stats = backend.step(micro_batches, lr)
            fault_point(f"rank{group.rank}:step:{done}")   # tests kill one rank here (KILN_FAULT); else nothing
            log.add(done, names, stats, lr)
            backend.update_ema()
            logged = done % cfg.log_every == 0 or done == cfg.steps
            if logged:
                log.flush()
            if len(log.streak) >= faults.MAX_NON_FINITE_IN_A_ROW:
                raise faults.NonFiniteLoss(faults.non_finite_message(cfg, log.streak, save(done)))
            report = log.report(done, lr, logged, weights, judge.maybe(done, backend, weights))
            if on_step is not None:
                with faults.saves_on_error(alone, done):
                    on_step(report)
            if validate is not None and validate_every and (done % validate_every == 0 or done == cfg.steps):
                _validate_at(done, validate, backend, sinks, group, alone)
            with faults.saves_on_error(alone, done):   # paused: waits here (not counted in speed or ETA)
                waited, stop = pause.between_steps(vote, should_pause, should_stop, on_pause)
            log.started += waited
            if stop:   # every rank stops (and pauses) after the same step
                checkpoint_path, stopped = save(done), True
                break
            if judge.stop():   # every rank holds the same held-out history
                checkpoint_path, early_stopped = save(done), True
                break
            if done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                checkpoint_path = save(done)
        vote.close()
        log.flush()
        ema_lora = weights() if cfg.ema else None
        return RunResult(run_dir=run_dir, step=len(history.lr), history=history, lora=backend.lora_state(),
                         ema_lora=ema_lora, checkpoint=checkpoint_path, stopped=stopped,
                         trainable_parameters=backend.trainable_parameter_count(),
                         skipped_items=[p.line() for p in getattr(data, "skipped", [])],
                         best=judge.best(), best_lora=judge.best_lora, early_stopped=early_stopped)
    finally:
        try:
            sinks.close()
        finally:
            backend.teardown()
