"""Held-out loss: images kept out of training, their loss at fixed draws, and early stopping on it.

The split is a pure function of (seed, the dataset's images): the held-out images are removed from
every bucket before the sampler sees them, so they are never trained on. Each held-out image is
scored at `holdout_sigmas` noise levels spread evenly over (0,1), σ_k = (k + ½)/K, with noise drawn
from its own generator (seeded by the run seed and the image), never from the training generator: an
evaluation leaves the run's draws alone (exact resume), and every evaluation sees the same draws, so
the curve compares between steps. The loss is the unweighted flow-matching MSE, no gradients, with
the weights a user keeps (EMA when on) and LoRA dropout off (Backend.eval_loss).

Early stopping reads only the history ([step, loss] per evaluation): the best step, and evaluations
since it, are recomputed from it, so a resumed run stops where an uninterrupted one would. The best
step's LoRA is written to <run>/best/lora.safetensors (atomic; keep_checkpoints never prunes it).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..archs import Arch
from ..atomic import atomic_write_text
from ..config import TrainConfig

_SPLIT_STREAM = 0x4D1D  # which images are held out: its own stream of the run seed
_DRAW_STREAM = 0x4D1E  # the held-out images' noise: one generator per image
BEST_DIR = "best"


def held_out_count(holdout: float, images: int) -> int:
    """holdout ≥ 1: that many images; 0 < holdout < 1: that share, at least one; 0: none."""
    if holdout <= 0:
        return 0
    return int(holdout) if holdout >= 1 else max(1, round(holdout * images))


def split(buckets: dict[str, list[int]], holdout: float, seed: int) -> tuple[dict[str, list[int]], list[int]]:
    """(training buckets, held-out image indices): the held-out images leave every bucket (repeats too)."""
    images = sorted({index for indices in buckets.values() for index in indices})
    count = held_out_count(holdout, len(images))
    if count == 0:
        return buckets, []
    if count >= len(images):
        raise ValueError(
            f"holdout {holdout:g} keeps {count} of the dataset's {len(images)} image(s) out of "
            "training, leaving none to train on; lower holdout or add images"
        )
    chosen = np.random.default_rng([seed, _SPLIT_STREAM]).choice(len(images), count, replace=False)
    held = sorted(images[i] for i in chosen.tolist())
    gone = set(held)
    training = {key: [i for i in indices if i not in gone] for key, indices in buckets.items()}
    return {key: indices for key, indices in training.items() if indices}, held


class TrainingView:
    """The dataset as training sees it: the same items, without the held-out images in its buckets."""

    def __init__(self, data, buckets: dict[str, list[int]]):
        self.data, self.buckets = data, buckets

    def __getattr__(self, name):
        return getattr(self.data, name)


def sigmas(count: int) -> np.ndarray:
    """count noise levels spread evenly over (0,1): the midpoints of count equal parts."""
    return ((np.arange(count) + 0.5) / count).astype(np.float32)


def batches(data, held: list[int], cfg: TrainConfig, arch: Arch) -> list:
    """The held-out Batches: per image its holdout_sigmas rows, in chunks of batch_size rows (no more than a
    training micro-batch, so an evaluation needs no more memory than a step); same draws every call."""
    from ..backends.base import Batch
    from ..data import text_conds
    from ..data.companion_batch import mask_weights, reference_extras, start_conds

    out = []
    for index in held:
        latent = data.latent(index).astype(np.float32, copy=False)  # [C,H,W]
        noise = np.random.default_rng([cfg.seed, _DRAW_STREAM, index]).standard_normal(
            (cfg.holdout_sigmas, *latent.shape), dtype=np.float32
        )  # [K,C,H,W]
        levels, context = sigmas(cfg.holdout_sigmas), data.context(index, 0)
        conds = text_conds.read(data, "conds", index, 0)  # the caption's other conditioning (SD 3.5: pooled)
        # The image's loss mask and reference latents (edit datasets), as its training batches carry them.
        mask = mask_weights([data.mask(index)], (1, *latent.shape), cfg.unmasked_weight)  # [1,1,H,W] or None
        references = reference_extras([data.controls(index)], arch, [data.name(index)])  # {key: [[1,C,h,w]]}
        start_image = start_conds(data, [index], arch)  # image-to-video: {key: [1,...]}
        for start in range(0, cfg.holdout_sigmas, cfg.batch_size):
            rows = slice(start, min(start + cfg.batch_size, cfg.holdout_sigmas))
            count = rows.stop - rows.start
            extras = {
                **arch.model_extras(count, [context.shape[0]] * count),
                **text_conds.stacked([conds] * count, [data.name(index)]),
                **{key: [np.repeat(a, count, axis=0) for a in slots] for key, slots in references.items()},
                **{key: np.repeat(a, count, axis=0) for key, a in start_image.items()},
            }
            out.append(
                Batch(
                    latents=np.repeat(latent[None], count, axis=0),
                    noise=noise[rows],
                    sigmas=levels[rows],
                    weights=np.ones(count, np.float32),
                    context=arch.collate_context([context] * count),
                    extras=extras,
                    items=[data.name(index)],
                    mask=None if mask is None else np.repeat(mask, count, axis=0),
                )
            )
    return out


def evaluate(backend, held_batches: list) -> float:
    """The mean held-out loss over every row; the backend's random state is put back as it was."""
    saved = backend.rng_state()
    try:
        return backend.eval_loss(held_batches)
    finally:
        backend.load_rng_state(saved)


@dataclass(frozen=True)
class Best:
    """The best held-out evaluation so far, and how many evaluations came after it without improving."""

    step: int
    loss: float
    since: int


def best(points: list[list[float]], min_delta: float) -> Best | None:
    """From the history's [step, loss] pairs: an evaluation improves when its loss is below best − min_delta."""
    found = None
    for step, loss in points:
        if loss is None or not np.isfinite(loss):
            found = found and Best(found.step, found.loss, found.since + 1)
        elif found is None or loss < found.loss - min_delta:
            found = Best(int(step), float(loss), 0)
        else:
            found = Best(found.step, found.loss, found.since + 1)
    return found


def should_stop(cfg: TrainConfig, points: list[list[float]]) -> bool:
    found = best(points, cfg.early_stop_min_delta)
    return bool(cfg.early_stop_patience and found is not None and found.since >= cfg.early_stop_patience)


def best_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / BEST_DIR


def keep_best(
    run_dir: str | Path, step: int, loss: float, lora: dict, *, cfg: TrainConfig, arch: Arch, metadata: dict[str, str]
) -> Path:
    """<run>/best/lora.safetensors (the user's format and dtype) and best.json {step, loss}, each atomic."""
    from ..lora.files import save_lora

    folder = best_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    save_lora(
        folder / "lora.safetensors",
        lora,
        arch=arch,
        fmt=cfg.lora_format,
        dtype=cfg.save_dtype,
        metadata={**metadata, "kiln.holdout_loss": repr(loss)},
    )
    atomic_write_text(folder / "best.json", json.dumps({"step": step, "holdout_loss": loss}))
    return folder / "lora.safetensors"


def read_best(run_dir: str | Path) -> dict[str, Any] | None:
    """best.json of a run folder, or None when the run kept none."""
    path = best_dir(run_dir) / "best.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def prepare(cfg: TrainConfig, data) -> tuple[Any, list[int]]:
    """(the data training sees, held-out indices): the data itself when holdout is 0."""
    buckets, held = split(data.buckets, cfg.holdout, cfg.seed)
    return (TrainingView(data, buckets), held) if held else (data, held)


class Judge:
    """The loop's held-out evaluations: when they are due, the history and loggers they feed, the best
    LoRA they keep (rank 0 writes it) and the early stop they call. Inert when nothing is held out."""

    def __init__(
        self, cfg: TrainConfig, arch: Arch, data, held: list[int], *, run_dir: Path, history, sinks, main: bool = True
    ):
        self.cfg, self.arch, self.run_dir, self.main = cfg, arch, run_dir, main
        self.history, self.sinks = history, sinks
        self.batches = batches(data, held, cfg, arch) if held else []
        self.best_lora: Path | None = best_dir(run_dir) / "lora.safetensors" if read_best(run_dir) else None

    def maybe(self, step: int, backend, weights) -> float | None:
        """The held-out loss at `step` when an evaluation is due (every holdout_every steps and the last), else None."""
        if not self.batches or not (step % self.cfg.holdout_every == 0 or step == self.cfg.steps):
            return None
        loss = evaluate(backend, self.batches)
        self.history.holdout.append([step, loss])
        self.sinks.log_scalars(step, {"holdout_loss": loss})
        found = best(self.history.holdout, self.cfg.early_stop_min_delta)
        if self.main and found is not None and found.step == step and found.since == 0:
            from ..lora.files import lora_metadata

            self.best_lora = keep_best(
                self.run_dir,
                step,
                loss,
                weights(),
                cfg=self.cfg,
                arch=self.arch,
                metadata=lora_metadata(self.cfg, self.arch, step),
            )
        return loss

    def stop(self) -> bool:
        return bool(self.batches) and should_stop(self.cfg, self.history.holdout)

    def ended(self, start: int) -> bool:
        """True for a run resumed (at `start`) after it had stopped early on its held-out loss: it ends at
        once, its best/ LoRA as it was, instead of training on to the next evaluation. Said on stderr."""
        if start == 0 or not self.stop():
            return False
        found = self.best()
        if self.main:
            print(
                f"{self.run_dir}: this run stopped early at step {start} (early_stop_patience "
                f"{self.cfg.early_stop_patience}: no held-out improvement since step {found.step}, loss "
                f"{found.loss:.4f}): it ends at once, nothing more to train; its best LoRA is in "
                f"{best_dir(self.run_dir)}",
                file=sys.stderr,
                flush=True,
            )
        return True

    def best(self) -> Best | None:
        return best(self.history.holdout, self.cfg.early_stop_min_delta) if self.batches else None


def estimate_notes(cfg: TrainConfig) -> list[str]:
    """What `estimate` says about the held-out loss: no memory beyond a step's, and its time."""
    if not cfg.holdout:
        return []
    passes = -(-cfg.holdout_sigmas // cfg.batch_size)
    note = (
        f"held-out loss (holdout {cfg.holdout:g}): forward passes without gradients of at most batch_size rows, "
        f"within a step's memory (counted); {passes} pass(es) per held-out image every {cfg.holdout_every} steps"
    )
    return [note]
