"""The step log: each step's figures into the run's history, read from the device in batches, and the report a
front end shows after each step (trainer/run/callbacks.py: on_step)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..lora.files import LoraWeights
from . import sinks as logging_sinks
from . import state
from .plot import smoothed


@dataclass
class Report:
    """What a UI shows after each step; loss figures only on steps where the loss was read."""

    step: int  # optimizer steps done
    total_steps: int
    lr: float
    it_per_s: float
    eta_s: float
    peak_memory_bytes: int
    loss: float | None = None
    loss_smooth: float | None = None
    grad_norm: float | None = None
    skipped_steps: int = 0  # steps skipped so far for a NaN/inf loss or gradient (as read)
    holdout_loss: float | None = None  # on steps with a held-out evaluation (trainer/run/holdout.py)
    # several ranks: each rank's peak accelerator bytes, in rank order (a step late: distributed.StopVote)
    peak_memory_per_rank: list[int] = field(default_factory=list)
    weights: Callable[[], dict[str, LoraWeights]] | None = field(
        default=None, repr=False, compare=False
    )  # best LoRA now


def finite(value: float) -> float | None:
    """A figure for a UI (JSON has no NaN): None when not finite."""
    return value if np.isfinite(value) else None


class StepLog:
    """Step figures into the history. The backend's loss, norm and finite flag stay device scalars until
    `flush` reads them all in one transfer (no host sync per step); it also keeps the latest run of
    consecutive skipped (non-finite) steps, which stops the run when too long."""

    def __init__(
        self, backend, history: state.History, start: int, total_steps: int, sinks: logging_sinks.Sinks | None = None
    ):
        self.backend, self.history, self.start, self.total_steps = backend, history, start, total_steps
        self.sinks = sinks or logging_sinks.Sinks([])  # TensorBoard / W&B: each step's figures as read
        self.pending: list = []  # (step, image names, StepStats, lr) not yet read
        self.streak: list = []  # history.skipped entries of the latest run of skipped steps
        self.started = time.perf_counter()

    def add(self, step: int, items: list[str], stats, lr: float) -> None:
        self.pending.append((step, items, stats, lr))
        self.history.lr.append(lr)

    def flush(self) -> None:
        stats = [v for _, _, s, _ in self.pending for v in (s.loss, s.grad_norm, s.finite)]
        values = self.backend.scalars(stats)
        for (step_done, items, _, lr), loss, norm, finite in zip(
            self.pending, values[0::3], values[1::3], values[2::3]
        ):
            self.history.loss.append(loss)
            self.history.grad_norm.append(norm)
            self.sinks.log_scalars(step_done, {"loss": loss, "grad_norm": norm, "learning_rate": lr})
            if finite:
                self.streak.clear()
            else:  # the backend left weights, optimizer and EMA alone: count it and name the images
                self.history.skipped.append({"step": step_done, "items": items})
                self.streak.append(self.history.skipped[-1])
        self.pending.clear()

    def flush_due(self, done: int, log_every: int) -> bool:
        """Read the pending figures every `log_every` steps and at the last step; whether it did."""
        logged = done % log_every == 0 or done == self.total_steps
        if logged:
            self.flush()
        return logged

    def report(
        self,
        done: int,
        lr: float,
        logged: bool,
        weights: Callable[[], dict[str, LoraWeights]],
        holdout_loss: float | None = None,
        peaks: list[int] | None = None,
    ) -> Report:
        """Speed and ETA over the steps of this call; loss figures only where `logged` (just flushed)."""
        elapsed = time.perf_counter() - self.started
        rate = (done - self.start) / elapsed if elapsed > 0 else 0.0
        history = self.history
        return Report(
            step=done,
            total_steps=self.total_steps,
            lr=lr,
            it_per_s=rate,
            eta_s=(self.total_steps - done) / rate if rate > 0 else 0.0,
            peak_memory_bytes=self.backend.peak_memory_bytes(),
            loss=finite(history.loss[-1]) if logged else None,
            loss_smooth=finite(smoothed(history.loss[-200:])[-1]) if logged else None,
            grad_norm=finite(history.grad_norm[-1]) if logged else None,
            skipped_steps=len(history.skipped),
            weights=weights,
            holdout_loss=holdout_loss,
            peak_memory_per_rank=list(peaks or []),
        )
