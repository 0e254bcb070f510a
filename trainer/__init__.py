"""Kiln's trainer library: LoRA training for diffusion transformers, independent of ComfyUI.

Public entry points: `config` (TrainConfig, presets), `loop.train`, `lora_format`
(save/load/export), `state` (checkpoints). The CLI is `python -m trainer`.
"""
__version__ = "0.1.0"
