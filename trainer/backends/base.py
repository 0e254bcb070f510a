"""The Backend Protocol: what the loop asks of PyTorch and MLX alike.

Arrays cross this boundary as numpy (float32) keyed by ComfyUI module paths, so
nothing outside a backend knows which one runs. Random draws (noise, sigmas,
caption dropout) are made outside, in the loop, from one seeded generator.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from ..archs import Arch
from ..config import TrainConfig
from ..lora.files import LoraWeights


@dataclass
class Batch:
    """One micro-batch, all from one bucket. Shapes: x0/noise [B,C,H,W], context [B,T,D]."""

    latents: np.ndarray
    noise: np.ndarray
    sigmas: np.ndarray  # [B] float32 in (0,1)
    weights: np.ndarray  # [B] float32 loss weights
    context: np.ndarray  # already arch-padded, caption dropout applied
    extras: dict[str, Any] = field(default_factory=dict)  # arch model_extras (guidance, num_tokens)
    items: list[str] = field(default_factory=list)  # the global batch's image names (every rank), for messages
    preservation: Any = None  # trainer.objective.preservation.Preservation: DOP's class-word rows, None when off
    mask: np.ndarray | None = None  # [B,1,H,W] float32 per-cell loss weights (masked training), None: all 1


@dataclass
class StepStats:
    """Device scalars; the loop reads them in bulk when it logs (no host sync per step)."""

    loss: Any
    grad_norm: Any
    finite: Any = True  # device bool: False when the loss or a gradient was NaN/inf (step skipped)


# A LoRA parameter is named '<module path>.lora_A' / '.lora_B' (PEFT's words) inside a backend; tensors that
# leave it (EMA shadow) are keyed '<module path>.A' / '.B', as the trained LoRA is in a checkpoint.
_SAVED_SUFFIX = {".lora_A": ".A", ".lora_B": ".B"}


def saved_name(parameter: str) -> str:
    """'<path>.lora_A' → '<path>.A' (and B); other names as they are."""
    for ours, saved in _SAVED_SUFFIX.items():
        if parameter.endswith(ours):
            return parameter[: -len(ours)] + saved
    return parameter


def parameter_name(saved: str) -> str:
    """'<path>.A' → '<path>.lora_A' (and B): saved_name undone."""
    for ours, suffix in _SAVED_SUFFIX.items():
        if saved.endswith(suffix):
            return saved[: -len(suffix)] + ours
    return saved


def checkpointed(count: int, recompute: bool, skip: int) -> list[bool]:
    """Which of `count` blocks recompute in backward, in block-list order: all but the last `skip`
    (skip_checkpoint_blocks) when gradient checkpointing is on, none when it is off."""
    kept = min(max(skip, 0), count) if recompute else count
    return [index < count - kept for index in range(count)]


def restore_forward(module, previous) -> None:
    """Undo an instance override of `module.forward` (the LoRA, fp8, checkpointing and stream wrappers install
    theirs that way): `previous` is what module.__dict__ held before, None for the class's own forward."""
    if previous is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = previous


# A forward function: (model, x_t, sigmas, context, extras) -> velocity, same shape as x_t.
Forward = Callable[[Any, Any, Any, Any, dict], Any]


class Backend(Protocol):
    name: str

    def setup(self, model: Any, cfg: TrainConfig, arch: Arch, forward: Forward | None = None) -> None:
        """Inject LoRA into `model` in place, enable checkpointing, build optimizer and EMA."""

    def step(self, micro_batches: list[Batch], lr: float) -> StepStats:
        """Forward, loss, backward over the micro-batches, clip, one optimizer update.

        A NaN/inf loss or gradient skips the update: weights, optimizer state (moments, step count)
        and, at the next update_ema, the EMA shadow stay as they were; StepStats.finite says so."""

    def update_ema(self) -> None: ...

    def eval_loss(self, batches: list[Batch]) -> float:
        """The mean weighted loss over every row of `batches`, without gradients, with the weights a user
        keeps (EMA when on) and LoRA dropout off: the held-out loss (trainer/run/holdout.py). No update."""

    def scalars(self, values: list[Any]) -> list[float]:
        """Device scalars → floats, in one transfer."""

    def sampling(self) -> AbstractContextManager:
        """Around validation sampling: EMA weights in (when on), LoRA dropout off."""

    def lora_state(self) -> dict[str, LoraWeights]: ...
    def load_lora_state(self, lora: dict[str, LoraWeights]) -> None: ...
    def ema_state(self) -> dict[str, np.ndarray]:
        """The fp32 shadow keyed '<module path>.A' / '.B' (saved_name); empty when EMA is off."""

    def load_ema_state(self, tensors: dict[str, np.ndarray]) -> None: ...
    def optimizer_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]: ...
    def load_optimizer_state(self, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None: ...
    def rng_state(self) -> dict[str, np.ndarray]: ...
    def load_rng_state(self, tensors: dict[str, np.ndarray]) -> None: ...
    def ema_weights(self) -> AbstractContextManager[None]:
        """Within the block the model runs with the EMA weights."""

    def plan(self) -> list[str]:
        """Before the first step: where the model's memory goes and what "auto" chose, in lines for people."""
        ...

    def trainable_parameter_count(self) -> int: ...
    def peak_memory_bytes(self) -> int: ...
    def teardown(self) -> None:
        """Remove LoRA and checkpointing: the model is exactly as it was before setup."""
