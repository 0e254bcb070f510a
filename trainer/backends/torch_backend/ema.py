"""EMA of the LoRA weights (a full fine-tune's: the model's, sharded as they are): an fp32 shadow, updated after
each real optimizer step."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .full import shard_like


class Ema:
    def __init__(self, params: dict[str, torch.nn.Parameter], decay: float):
        self.decay = decay
        self.params = params
        # The shadow starts at the initial weights (B = 0: the base model).
        self.shadow = {name: p.detach().float().clone() for name, p in params.items()}
        self.updates = 0

    @torch.no_grad()
    def update(self, finite: torch.Tensor | None = None) -> None:
        """shadow ← decay·shadow + (1 − decay)·param, for every tensor in one foreach call.

        `finite`, a device bool, is the step's own flag when it was not read on the host: the shadow
        then moves by (1 − decay)·finite·(param − shadow), i.e. not at all after a skipped step."""
        names = list(self.params)
        shadows = [self.shadow[n] for n in names]
        current = [self.params[n].detach().float() for n in names]
        if finite is None:
            torch._foreach_lerp_(shadows, current, 1.0 - self.decay)
        else:
            deltas = torch._foreach_sub(current, shadows)
            torch._foreach_mul_(deltas, finite.float() * (1.0 - self.decay))
            torch._foreach_add_(shadows, deltas)
        self.updates += 1

    @contextmanager
    def swapped_in(self):
        """Run with the EMA weights; the trained weights come back afterwards, also on error."""
        backup = {n: p.detach().clone() for n, p in self.params.items()}
        try:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(self.shadow[n])
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(backup[n])

    def state(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        missing = sorted(set(self.shadow) - set(tensors))
        if missing:
            raise ValueError(
                f"EMA state lacks {len(missing)} tensor(s), e.g. {missing[:3]}; "
                "the checkpoint was made with other targets or rank"
            )
        for name in self.shadow:
            if tuple(tensors[name].shape) != tuple(self.shadow[name].shape):
                raise ValueError(
                    f"EMA tensor {name}: shape {tuple(tensors[name].shape)} in the checkpoint, "
                    f"{tuple(self.shadow[name].shape)} in this run"
                )
            self.shadow[name].copy_(shard_like(self.shadow[name], tensors[name], torch.float32))
