"""Tiny models and data built in the tests: nothing is downloaded, everything runs on CPU in seconds.

`--comfyui without|only` splits the suite: a test file that calls `comfy_env.require_comfy()` needs
ComfyUI, the rest is the library. ./scripts/test runs the library once and the ComfyUI files once per
ComfyUI tree, each in that tree's own Python environment.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from trainer import config as config_module
from trainer.data import InMemoryData

# Shared test helpers (lora_fixtures) import by module name, in the library and the node tests alike.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))


def tiny_model(seed: int = 0):
    from trainer.tiny_dit import build_tiny_flux

    return build_tiny_flux(seed, hidden=32, heads=2, double_blocks=1, single_blocks=1, in_channels=16,
                           context_dim=32)


def tiny_data(count: int = 6, seed: int = 0, shapes=((4, 4), (4, 6))) -> InMemoryData:
    """Random latents [16,H,W] in two buckets, random [8,32] contexts."""
    rng = np.random.default_rng(seed)
    latents = [rng.standard_normal((16, *shapes[i % len(shapes)])).astype(np.float32) for i in range(count)]
    contexts = [rng.standard_normal((8, 32)).astype(np.float32) for _ in range(count)]
    return InMemoryData.from_arrays(latents, contexts, [f"img_{i}.png" for i in range(count)],
                                    np.zeros((8, 32), np.float32))


def tiny_config(**overrides) -> config_module.TrainConfig:
    settings = dict(arch="demo", device="cpu", mixed_precision="no", steps=10, batch_size=2, rank=4, alpha=4.0,
                    learning_rate=1e-3, checkpoint_every=0, keep_checkpoints=3, log_every=1,
                    resolutions=[64], caption_dropout=0.0, gradient_checkpointing=False)
    settings.update(overrides)
    return config_module.from_dict(settings)


@pytest.fixture
def make_model():
    return tiny_model


@pytest.fixture
def make_data():
    return tiny_data


@pytest.fixture
def make_config():
    return tiny_config


# ---------------------------------------------------------------- the library / ComfyUI split

COMFYUI_CALL = "comfy_env.require_comfy()"


def pytest_addoption(parser):
    parser.addoption("--comfyui", choices=("with", "without", "only"), default="with",
                     help="with: every test (ComfyUI tests skip without COMFYUI_PATH); without: only the tests that "
                          "need no ComfyUI; only: only those that do (test files calling comfy_env.require_comfy())")


def needs_comfyui(path: Path) -> bool:
    return path.suffix == ".py" and path.name.startswith("test_") and COMFYUI_CALL in path.read_text(encoding="utf-8")


def pytest_ignore_collect(collection_path: Path, config):
    part = config.getoption("--comfyui")
    if part == "with" or not collection_path.is_file() or not collection_path.name.startswith("test_"):
        return None
    return True if needs_comfyui(collection_path) != (part == "only") else None
