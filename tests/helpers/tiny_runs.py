"""The tiny model, data and config the library tests train on (conftest.py's fixtures hand them out; a test
module that needs them outside a fixture imports them from here: `from helpers.tiny_runs import tiny_data`)."""

from __future__ import annotations

import numpy as np

from trainer import config as config_module
from trainer.data import InMemoryData
from trainer.run.loop import train


def tiny_model(seed: int = 0):
    from trainer.demo.tiny_dit import build_tiny_flux

    return build_tiny_flux(seed, hidden=32, heads=2, double_blocks=1, single_blocks=1, in_channels=16, context_dim=32)


def tiny_data(count: int = 6, seed: int = 0, shapes=((4, 4), (4, 6))) -> InMemoryData:
    """Random latents [16,H,W] in two buckets, random [8,32] contexts."""
    rng = np.random.default_rng(seed)
    latents = [rng.standard_normal((16, *shapes[i % len(shapes)])).astype(np.float32) for i in range(count)]
    contexts = [rng.standard_normal((8, 32)).astype(np.float32) for _ in range(count)]
    return InMemoryData.from_arrays(
        latents, contexts, [f"img_{i}.png" for i in range(count)], np.zeros((8, 32), np.float32)
    )


def tiny_config(**overrides) -> config_module.TrainConfig:
    settings = {
        "arch": "demo",
        "device": "cpu",
        "mixed_precision": "no",
        "steps": 10,
        "batch_size": 2,
        "rank": 4,
        "alpha": 4.0,
        "learning_rate": 1e-3,
        "checkpoint_every": 0,
        "keep_checkpoints": 3,
        "log_every": 1,
        "resolutions": [64],
        "caption_dropout": 0.0,
        "gradient_checkpointing": False,
    }
    settings.update(overrides)
    return config_module.from_dict(settings)


def companion_data(masks=True, controls=False, count=6, seed=0) -> InMemoryData:
    rng = np.random.default_rng(seed)
    shapes = ((4, 4), (4, 6))
    latents = [rng.standard_normal((16, *shapes[i % 2])).astype(np.float32) for i in range(count)]
    contexts = [rng.standard_normal((8, 32)).astype(np.float32) for _ in range(count)]
    data = InMemoryData.from_arrays(
        latents, contexts, [f"img_{i}.png" for i in range(count)], np.zeros((8, 32), np.float32)
    )
    if masks:  # every other image masked, left half white
        data.masks = [
            np.concatenate([np.ones((1, 4, l.shape[2] // 2)), np.zeros((1, 4, l.shape[2] // 2))], 2).astype(np.float32)
            if i % 2 == 0
            else None
            for i, l in enumerate(latents)
        ]
    if controls:
        data.control_latents = [[rng.standard_normal(l.shape).astype(np.float32)] for l in latents]
    return data


def train_until(run_dir, model, data, cfg, *, stop_at: int | None = None, resume: bool = False):
    """train() into run_dir: stopped after `stop_at` steps (as a dashboard Stop would), or resumed from run_dir's
    last checkpoint; the resume tests run one straight, one stopped, then resumed."""
    progress = []
    stop = (lambda: len(progress) >= stop_at) if stop_at else None
    return train(
        cfg, model, data, run_dir=run_dir, resume=run_dir if resume else None, on_step=progress.append, should_stop=stop
    )
