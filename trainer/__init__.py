"""Kiln's trainer library: LoRA training for diffusion transformers, independent of ComfyUI.

The public API, loaded on first use (`import trainer` stays light: no torch, no numpy):

    trainer.TrainConfig, trainer.from_dict      every setting of a run, checked (trainer/config/)
    trainer.train                               the loop: a LoRA trained on a model in place (trainer/run/loop.py)
    trainer.load_lora, trainer.save_lora        LoRA files in Kiln's layouts; load reads every trainer's
    trainer.convert_file                        another trainer's LoRA rewritten as one ComfyUI loads key for key

The sub-packages name the concepts: config/, run/, objective/, lora/, data/, samples/, archs/, backends/,
estimate/, cli/ (`python -m trainer`), demo/. docs/architecture.md is the map.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = {
    "TrainConfig": "config",
    "from_dict": "config",
    "train": "run.loop",
    "load_lora": "lora.files",
    "save_lora": "lora.files",
    "convert_file": "lora.files",
}
__all__ = [*_API, "__version__"]

from .moved import install  # noqa: E402  (the flat layout's old import paths, one release)

install(__name__)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_API[name]}", __name__), name)
