"""The training loop: one straight story from config to a saved LoRA.

    setup → (resume) → for step: batch → backend.step → EMA → held-out loss → front end → checkpoint → result

The front end (trainer/run/callbacks.py) is one object with no-op defaults; faults.Guard is the loop's one
fault handling (an out-of-memory step rewinds, an error in a front end's call saves the step first).

Everything random is drawn here, from one numpy generator seeded by cfg.seed
(noise, sigmas, caption dropout) plus the sampler's own seeded plan, so both
backends see the same draws and a resumed run continues bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..archs import Arch, get_arch
from ..atomic import fault_point
from ..backends import get_backend
from ..config import TrainConfig
from ..data import TrainingData, companion_batch, text_conds
from ..data.sampler import BATCHING, BucketSampler
from ..lora.files import LoraWeights, lora_metadata
from ..objective import flow as objective
from ..objective import preservation
from ..objective.schedules import lr_at
from . import checkpoint_writer, distributed, faults, holdout, init_lora, pause, state
from . import sinks as logging_sinks
from .callbacks import Callbacks, from_functions, validation_due
from .steplog import Report, StepLog  # noqa: F401  (Report: its old import path)


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
    best: holdout.Best | None = None  # the best held-out evaluation (holdout > 0)
    best_lora: Path | None = None  # <run>/best/lora.safetensors: that step's LoRA
    early_stopped: bool = False  # ended by early_stop_patience
    model: dict[str, np.ndarray] | None = None  # adapter full: the diffusion model's weights (EMA ones when on)


def objective_settings(cfg: TrainConfig, arch: Arch) -> objective.ObjectiveSettings:
    """Config + arch default → the flat settings objective.py takes."""
    shift_mode = arch.shift_mode if cfg.shift_mode == "auto" else cfg.shift_mode
    shift = arch.shift if cfg.shift_mode == "auto" else cfg.shift
    sigma_range = objective.parse_sigma_range(cfg.sigma_range) or arch.sigma_range
    return objective.ObjectiveSettings(
        sampling=cfg.timestep_sampling,
        logit_mean=cfg.logit_mean,
        logit_std=cfg.logit_std,
        content_or_style=cfg.content_or_style,
        shift_mode=shift_mode,
        shift=shift,
        loss_weighting=cfg.loss_weighting,
        unmasked_weight=cfg.unmasked_weight,
        sigma_range=sigma_range,
    )


def build_batch(
    data: TrainingData,
    indices: list[int],
    rng: np.random.Generator,
    settings: objective.ObjectiveSettings,
    arch: Arch,
    caption_dropout: float,
    group: distributed.Group = distributed.SINGLE,
    preserve: preservation.Settings = preservation.OFF,
):
    """Stack one bucket's items and draw its noise, sigmas and caption dropout.

    `indices` is the global batch; under torchrun every rank draws the randomness of all of it (the
    generator stays in lockstep on every rank) and keeps the rows of its share (distributed.Group.rows)."""
    from ..backends.base import Batch

    rows, scale = group.rows(len(indices))
    mine = [indices[row] for row in rows]
    latents = np.stack([data.latent(i) for i in mine]).astype(np.float32, copy=False)  # [b,C,H,W] or [b,C,T,H,W]
    shape = (len(indices), *latents.shape[1:])  # the global [B,C,H,W] (a video's [B,C,T,H,W])
    tokens_img = latent_tokens(shape[1:], arch)  # what the model attends over
    draws = objective.draw(rng, shape, settings, caption_dropout, image_tokens=tokens_img)
    # Shuffled-tag variants are drawn only where an item has several, so other runs' draws are unchanged.
    variants = [int(rng.integers(n)) if n > 1 else 0 for n in (data.variants(i) for i in indices)]
    noise, sigmas, weights = draws.noise, draws.sigmas, draws.weights
    if len(rows) != len(indices):  # one of several ranks: its rows, scaled (distributed.Group.rows)
        noise, sigmas, weights = noise[rows], sigmas[rows], (weights[rows] * scale).astype(np.float32)
    contexts = [
        data.empty_context() if draws.drop_caption[row] else data.context(indices[row], variants[row]) for row in rows
    ]
    conds = text_conds.of_rows(data, rows, indices, variants, draws.drop_caption)  # dropped with the captions
    lengths = [c.shape[0] for c in contexts]
    names = [data.name(i) for i in indices]
    extras = {
        **arch.model_extras(len(rows), lengths),
        **text_conds.stacked(conds, names),
        **companion_batch.reference_extras([data.controls(i) for i in mine], arch, names),
        **companion_batch.start_conds(data, mine, arch),
    }
    batch = Batch(
        latents=latents,
        noise=noise,
        sigmas=sigmas,
        weights=weights,
        context=arch.collate_context(contexts),
        extras=extras,
        items=names,
        mask=companion_batch.mask_weights([data.mask(i) for i in mine], shape, settings.unmasked_weight),
    )
    # Regularisation rows' loss weight; DOP's class-word captions (trainer/objective/preservation.py). No draws.
    return preservation.complete(
        batch, data, mine, [variants[row] for row in rows], contexts, scale, arch, preserve, conds=conds
    )


def latent_tokens(shape: tuple, arch: Arch) -> int:
    """Tokens of one latent [C,h,w] or a clip's [C,t,h,w]: (h/patch)(w/patch) per latent frame."""
    frames = shape[1] if len(shape) == 4 else 1
    return frames * (shape[-2] // arch.patch) * (shape[-1] // arch.patch)


def batch_sizes(cfg: TrainConfig, data: TrainingData, arch: Arch) -> dict[str, int]:
    """Images per batch of each bucket (cfg.batch_by), from its tokens per image: image tokens (one
    latent of the bucket) plus the caption's padded minimum."""

    def tokens(indices: list[int]) -> int:
        return latent_tokens(data.latent(indices[0]).shape, arch) + arch.context_tokens

    per_image = {key: tokens(indices) for key, indices in data.buckets.items() if indices}
    return BATCHING[cfg.batch_by](per_image, cfg.batch_size)


def resumed(
    resume: str | Path | None,
    backend,
    rng: np.random.Generator,
    sampler: BucketSampler,
    group: distributed.Group = distributed.SINGLE,
    init_sha256: str = "",
) -> tuple[state.History, int]:
    """(history, first step): a new run's, or the checkpoint's at `resume` with all its state put back.
    A run started from another init LoRA (or from none, or from one) than the config's is refused."""
    if resume is None:
        return state.History(), 0
    checkpoint = state.load_checkpoint(resume)
    started = checkpoint.info.get("config", {}).get("init_lora_sha256", "")
    if started != init_sha256:
        said = [f"init LoRA sha256 {sha[:12]}…" if sha else "a new LoRA" for sha in (started, init_sha256)]
        raise ValueError(
            f"{checkpoint.path}: this run started from {said[0]}, but the config gives "
            f"{said[1]} (init_lora); resume with the run's own init_lora file, or start a "
            "new run (another run_name)"
        )
    history = state.restore(
        checkpoint, backend=backend, numpy_rng=rng, sampler=sampler, rank=group.rank, world=group.world
    )
    return history, checkpoint.step


def best_lora(backend, ema: bool, full: bool = False) -> dict[str, LoraWeights]:
    """What a user keeps (a UI's "save now"): the EMA weights when EMA is on, else the trained ones; of a full
    fine-tune (`full`) the whole diffusion model's tensors by state-dict name, the file's layout."""
    with backend.ema_weights() if ema else contextlib.nullcontext():
        return backend.model_state() if full else backend.lora_state()


@dataclass
class Setup:
    """What a run fixes before its first step: the config (with the init LoRA's rank and alpha), the data
    training sees (held-out images taken out), the seeded generator and sampler every rank shares."""

    cfg: TrainConfig
    arch: Arch
    backend: Any
    group: distributed.Group
    run_dir: Path
    rng: np.random.Generator
    settings: objective.ObjectiveSettings
    data: TrainingData
    held: Any  # the held-out images (trainer/run/holdout.py)
    sampler: BucketSampler
    preserve: preservation.Settings
    init: init_lora.InitLora | None

    def judge(self, history: state.History, sinks: logging_sinks.Sinks) -> holdout.Judge:
        return holdout.Judge(
            self.cfg,
            self.arch,
            self.data,
            self.held,
            run_dir=self.run_dir,
            history=history,
            sinks=sinks,
            main=self.group.is_main,
        )


def set_up(
    cfg: TrainConfig,
    model: Any,
    data: TrainingData,
    run_dir: Path,
    forward: Callable | None,
    init: init_lora.InitLora | None,
) -> Setup:
    """Everything before the loop, in the order that keeps a run's draws the same; the backend set up last."""
    cfg, init = init_lora.prepare(cfg, init)  # before anything reads rank or alpha, or saves the config
    arch, backend = get_arch(cfg.arch), get_backend(cfg.backend)
    group = distributed.start(cfg.device, cfg.backend)  # one process, or this rank of torchrun's
    rng = np.random.default_rng(cfg.seed)
    settings = objective_settings(cfg, arch)
    data, held = holdout.prepare(cfg, data)  # held-out images leave the buckets training sees
    # One seeded sampler of global batches: under torchrun each rank trains on its rows of each.
    global_sizes = {key: size * group.world for key, size in batch_sizes(cfg, data, arch).items()}
    sampler = BucketSampler(data.buckets, global_sizes, cfg.seed)
    preserve = preservation.settings(cfg, data)  # DOP and regularisation images, checked against the data
    companion_batch.check(cfg, data, arch)
    backend.setup(model, cfg, arch, forward)
    return Setup(cfg, arch, backend, group, run_dir, rng, settings, data, held, sampler, preserve, init)


def one_step(run: Setup, step: int, guard: faults.Guard) -> tuple[float, list[str], Any]:
    """Draw the step's micro-batches and train on them: (learning rate, image names, the backend's StepStats)."""
    cfg = run.cfg
    lr = lr_at(
        step,
        base_lr=cfg.learning_rate,
        schedule=cfg.lr_schedule,
        total_steps=cfg.steps,
        warmup_steps=cfg.warmup_steps,
        min_lr_ratio=cfg.min_lr_ratio,
    )
    draws = faults.Draws(run.rng, run.sampler, run.backend)  # an out-of-memory step puts its draws back
    micro_batches = [
        build_batch(
            run.data, run.sampler.next(), run.rng, run.settings, run.arch, cfg.caption_dropout, run.group, run.preserve
        )
        for _ in range(cfg.grad_accum)
    ]
    names = [name for batch in micro_batches for name in batch.items]
    with guard.training(step, names, draws):
        return lr, names, run.backend.step(micro_batches, lr)


def save_run(step: int, *, run: Setup, log: StepLog) -> Path:
    """A resumable checkpoint at `step`; pending step figures are read first so its history is whole.
    Under torchrun every rank calls it: their RNG states go into rank 0's checkpoint, which only rank 0
    writes; the others wait until it is complete (a sharded full run's state is gathered whole on every rank)."""
    log.flush()
    cfg, arch, backend = run.cfg, run.arch, getattr(run.backend, "gathered", lambda: run.backend)()
    rng_states = distributed.gather_arrays(backend.rng_state())
    path = state.step_dir(run.run_dir, step)
    if distributed.current().is_main:
        path = checkpoint_writer.save_checkpoint(
            run.run_dir,
            step,
            backend=backend,
            arch=arch,
            config=cfg.to_dict(),
            numpy_rng=run.rng,
            cursor=run.sampler.state(),
            history=log.history,
            keep=cfg.keep_checkpoints,
            lora_metadata=lora_metadata(cfg, arch, step),
            save_dtype=cfg.save_dtype,
            rank_rng=rng_states[1:],
        )
    distributed.barrier()
    return path


def validate_if_due(done: int, front: Callbacks, run: Setup, sinks: logging_sinks.Sinks) -> None:
    """front.validate(done, lora) on rank 0 when due, its images to the sinks; the others wait at the host
    barrier. Out of memory names the validation settings (after a step: the guard around it saves the step)."""
    if not validation_due(front, done, run.cfg.steps):
        return
    if run.group.is_main:
        named = faults.validation_out_of_memory(done) if done else contextlib.nullcontext()
        with named, run.backend.sampling():
            sinks.log_images(done, "validation", front.validate(done, run.backend.lora_state))
    distributed.barrier()


@dataclass
class Ending:
    """How the loop ended: the newest checkpoint it saved, and whether a stop or early stopping ended it."""

    checkpoint: Path | None = None
    stopped: bool = False
    early_stopped: bool = False

    @classmethod
    def at_start(cls, judge: holdout.Judge, run_dir: Path, start: int) -> Ending:
        """A resumed run that had stopped early (early_stop_patience) ends before its first step, as it was."""
        early = judge.ended(start)
        return cls(state.step_dir(run_dir, start) if early else None, early_stopped=early)


def close(sinks: logging_sinks.Sinks, backend) -> None:
    """The sinks closed, then the backend's model put back as it was, also when closing fails."""
    try:
        sinks.close()
    finally:
        backend.teardown()


def result(run: Setup, log: StepLog, vote: distributed.StopVote, end: Ending, judge: holdout.Judge) -> RunResult:
    """The loop's outcome, once the ranks' vote is closed and every step's figures read."""
    vote.close()
    log.flush()
    backend, history = run.backend, log.history
    ema_lora = best_lora(backend, True) if run.cfg.ema else None
    model = best_lora(backend, True, full=True) if run.cfg.adapter == "full" else None  # EMA's, where it is on
    return RunResult(
        run_dir=run.run_dir,
        step=len(history.lr),
        history=history,
        lora=backend.lora_state(),
        ema_lora=ema_lora,
        checkpoint=end.checkpoint,
        stopped=end.stopped,
        trainable_parameters=backend.trainable_parameter_count(),
        skipped_items=[p.line() for p in getattr(run.data, "skipped", [])],
        best=judge.best(),
        best_lora=judge.best_lora,
        early_stopped=end.early_stopped,
        model=model,
    )


def train(
    cfg: TrainConfig,
    model: Any,
    data: TrainingData,
    *,
    run_dir: str | Path,
    forward: Callable | None = None,
    resume: str | Path | None = None,
    init: init_lora.InitLora | None = None,
    callbacks: Callbacks | None = None,
    **functions: Any,
) -> RunResult:
    """Train a LoRA on `model` in place (restored as it was on return, also after an error), from `init` or
    cfg.init_lora (trainer/run/init_lora.py), or on from the checkpoint at `resume`. `callbacks`: the front end
    (trainer/run/callbacks.py); loose functions (on_step=, should_stop=, validate=, ...) still build one."""
    front = callbacks if callbacks is not None else from_functions(**functions)
    run = set_up(cfg, model, data, Path(run_dir), forward, init)
    cfg, backend, group, sinks = run.cfg, run.backend, run.group, logging_sinks.Sinks([])
    try:
        history, start = resumed(resume, backend, run.rng, run.sampler, group, cfg.init_lora_sha256)
        if run.init is not None and resume is None:  # every rank reads the same weights
            init_lora.load_into(backend, run.init, cfg.ema)
        sinks = logging_sinks.open_sinks(cfg, run.run_dir, start, group.is_main)
        log = StepLog(backend, history, start, cfg.steps, sinks)
        judge, save = run.judge(history, sinks), functools.partial(save_run, run=run, log=log)
        guard, vote = faults.Guard(cfg, save, group.world, start), distributed.StopVote(backend.peak_memory_bytes)
        weights = functools.partial(best_lora, backend, cfg.ema, cfg.adapter == "full")
        end = Ending.at_start(judge, run.run_dir, start)  # a resumed run that had stopped early ends at once
        front.on_start(backend.plan())
        if start == 0:  # the start, logged as step 0 (validate_first)
            validate_if_due(0, front, run, sinks)
        for step in range(start, start if end.early_stopped else cfg.steps):
            lr, names, stats = one_step(run, step, guard)
            done = step + 1
            fault_point(f"rank{group.rank}:step:{done}")  # tests kill one rank here (KILN_FAULT); else nothing
            log.add(done, names, stats, lr)
            backend.update_ema()
            logged = log.flush_due(done, cfg.log_every)
            guard.non_finite(log.streak, done)
            holdout_loss = judge.maybe(done, backend, weights)  # the held-out evaluation, when due
            with guard.front_end(done):  # an error in the front end's calls saves this step first
                front.on_step(log.report(done, lr, logged, weights, holdout_loss, vote.peaks))
                validate_if_due(done, front, run, sinks)
                waited, stop = pause.between_steps(vote, front.should_pause, front.should_stop, front.on_pause)
            log.started += waited  # paused: not counted in speed or ETA
            if stop or judge.stop():  # every rank stops (or pauses) after the same step, holds the same history
                end = Ending(save(done), stopped=stop, early_stopped=not stop)
                break
            if done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                end.checkpoint = save(done)
        return result(run, log, vote, end, judge)
    finally:
        close(sinks, backend)
