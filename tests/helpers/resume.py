"""The bitwise-resume assertion: a run stopped and resumed ends where an uninterrupted run ends, bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainer import safetensors_io


def checkpoint_state(run) -> dict[str, np.ndarray]:
    """The tensors of a run's last checkpoint (its state.safetensors): from a finished run's result (its .checkpoint),
    a checkpoint folder, or tensors already read."""
    if isinstance(run, dict):
        return run
    folder = Path(run) if isinstance(run, (str, Path)) else run.checkpoint
    return safetensors_io.read(folder / "state.safetensors")[0]


def assert_bitwise_resume(straight, resumed, *, holds: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """The same tensors in both last checkpoints (LoRA, EMA, optimizer moments, RNG states), each bitwise equal;
    `holds`: name prefixes that must be among them (what the test switched on, e.g. "ema."). Returns the
    uninterrupted run's tensors for the test's further checks."""
    a, b = checkpoint_state(straight), checkpoint_state(resumed)
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    for prefix in holds:
        assert any(key.startswith(prefix) for key in a), f"no {prefix}* tensor in the checkpoint"
    for key in a:
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key
    return a
