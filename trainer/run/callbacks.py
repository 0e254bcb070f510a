"""A front end's side of a run, as one object the loop calls (mlx-lm's TrainingCallback): progress after each
step, validation images, stop and pause. Every method has a no-op default, so a front end overrides only what
it needs, and a new front-end feature is a method here, not a parameter of `loop.train`.

The loop calls, in this order after each step: on_step(report), validate(step, lora) when `validation_due`,
then should_pause() / should_stop() between steps (trainer/run/pause.py), with on_pause(True/False) around a
wait. An error raised by any of them (ComfyUI's stop button) leaves a resumable checkpoint of that step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Callbacks:
    """Subclass and override; the defaults do nothing, never validate, never stop and never pause."""

    validate_every: int = 0  # validate every N steps and at the last step; 0: never (validate_first aside)
    validate_first: bool = False  # validate before the first step of a new run too (logged as step 0)

    def on_start(self, plan: list[str]) -> None:
        """Before the first step of this execution: the backend's memory plan and its auto choices, as lines."""

    def on_step(self, report) -> None:
        """After each step: a trainer.run.steplog.Report (loss figures only on steps where the loss was read)."""

    def validate(self, step: int, lora: Callable) -> list | None:
        """Sample with the LoRA as trained to `step` (EMA weights swapped in when EMA is on); `lora()` gives the
        weights as numpy for a sampler that needs them applied. Returns images ([H,W,3] in 0..1) for the sinks."""
        return None

    def should_stop(self) -> bool:
        """True: stop after this step with a resumable checkpoint (under torchrun every rank stops together)."""
        return False

    def should_pause(self) -> bool:
        """True: wait between steps, memory kept, until it turns false or a stop is asked for."""
        return False

    def on_pause(self, paused: bool) -> None:
        """A wait began (True) or ended (False)."""


class Validation(Callbacks):
    """Validation alone: `validate(step, lora)` every `every` steps and at the last (before the first too with
    `first`); for a front end that hands its samples to another's progress and stop (headless.py → the console)."""

    def __init__(self, validate: Callable, every: int, first: bool = False):
        self.sample, self.validate_every, self.validate_first = validate, every, first

    def validate(self, step: int, lora: Callable) -> list | None:
        return self.sample(step, lora)


NAMES = (
    "on_start",
    "on_step",
    "validate",
    "should_stop",
    "should_pause",
    "on_pause",
    "validate_every",
    "validate_first",
)


def from_functions(**functions: Any) -> Callbacks:
    """Callbacks from loose functions (loop.train's older keywords: on_step=, should_stop=, validate=, ...); a
    None leaves the default. Without `validate` nothing validates, as before."""
    unknown = sorted(set(functions) - set(NAMES))
    if unknown:
        raise TypeError(f"train() got unexpected keyword arguments {unknown}; front-end ones are {list(NAMES)}")
    callbacks = Callbacks()
    for name, value in functions.items():
        if value is not None:
            setattr(callbacks, name, value)  # an instance attribute shadows the no-op method
    if functions.get("validate") is None:
        callbacks.validate_every, callbacks.validate_first = 0, False
    return callbacks


def validation_due(callbacks: Callbacks, done: int, total_steps: int) -> bool:
    """Whether the loop validates after step `done` (0: before the first step of a new run)."""
    if done == 0:
        return bool(callbacks.validate_first)
    every = callbacks.validate_every
    return bool(every) and (done % every == 0 or done == total_steps)
