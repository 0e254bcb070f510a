"""EMA of the LoRA weights: an fp32 shadow, updated after each real optimizer step (as torch_backend/ema.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class Ema:
    def __init__(self, params: dict[str, mx.array], decay: float):
        self.decay = decay
        # The shadow starts at the initial weights (B = 0: the base model).
        self.shadow = {name: p.astype(mx.float32) for name, p in params.items()}
        self.updates = 0

    def update(self, params: dict[str, mx.array], finite: mx.array | None = None) -> None:
        """shadow ← lerp(shadow, param, 1 − decay), in torch.lerp's two forms; lazy until the next step's eval.

        `finite` False (the step's NaN/inf flag, on device) keeps the shadow as it was."""
        weight = 1.0 - self.decay
        for name, shadow in self.shadow.items():
            current = params[name].astype(mx.float32)
            if weight < 0.5:
                moved = shadow + weight * (current - shadow)
            else:
                moved = current - (current - shadow) * (1.0 - weight)
            self.shadow[name] = moved if finite is None else mx.where(finite, moved, shadow)
        self.updates += 1

    def state(self) -> dict[str, np.ndarray]:
        return {name: np.array(value) for name, value in self.shadow.items()}

    def load_state(self, tensors: dict[str, np.ndarray]) -> None:
        missing = sorted(set(self.shadow) - set(tensors))
        if missing:
            raise ValueError(
                f"EMA state lacks {len(missing)} tensor(s), e.g. {missing[:3]}; "
                "the checkpoint was made with other targets or rank"
            )
        for name, shadow in self.shadow.items():
            if tuple(tensors[name].shape) != tuple(shadow.shape):
                raise ValueError(
                    f"EMA tensor {name}: shape {tuple(tensors[name].shape)} in the checkpoint, "
                    f"{tuple(shadow.shape)} in this run"
                )
            self.shadow[name] = mx.array(np.asarray(tensors[name], dtype=np.float32))
