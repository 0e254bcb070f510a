"""Headless training's ComfyUI: started as a library (CPU when the config asks) and the model, VAE and
text encoder loaded from .safetensors files with ComfyUI's own loaders."""

from __future__ import annotations

import sys
from pathlib import Path


def start(cpu: bool) -> None:
    """ComfyUI on the CPU when asked: read once, when comfy.model_management is first imported (which
    importing the bridge does), so this runs before it. Importing the door itself imports no ComfyUI."""
    if cpu and "comfy.model_management" not in sys.modules:
        from comfy.cli_args import args as comfy_args

        comfy_args.cpu = True


def _safetensors(cfg, key: str) -> str:
    path = getattr(cfg, key)
    if not path:
        raise ValueError(f"set {key} to the .safetensors file (headless training loads the model from files)")
    if not Path(path).is_file():
        raise FileNotFoundError(f"{key}: {path} does not exist")
    if not path.endswith(".safetensors"):
        raise ValueError(f"{key}: {path} is not a .safetensors file (Kiln never unpickles .ckpt/.pt files)")
    return path


def load_models(cfg, encoders: bool = True):
    """(MODEL, VAE, CLIP) from the config's files; the text encoder's type is the arch's clip_type. With
    `encoders` off (torchrun's ranks other than 0) the VAE and CLIP are not loaded: (MODEL, None, None)."""
    import comfy.sd
    import comfy.utils

    from ...trainer.archs import ARCHS, get_arch

    clip_type = get_arch(cfg.arch).clip_type
    model = comfy.sd.load_diffusion_model(_safetensors(cfg, "model_path"))
    if not encoders:
        return model, None, None
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(_safetensors(cfg, "vae_path")))
    if not clip_type:
        known = sorted(a.name for a in ARCHS.values() if a.clip_type)
        raise ValueError(
            f"arch {cfg.arch!r}: headless training knows the text encoders of {known}; "
            "train other models with the nodes"
        )
    clip = comfy.sd.load_clip(
        ckpt_paths=[_safetensors(cfg, "text_encoder_path")], clip_type=getattr(comfy.sd.CLIPType, clip_type)
    )
    return model, vae, clip


def training_adapter(cfg):
    """The config's training adapter (a LoRA file), or None."""
    from .lora import load_lora_file

    return load_lora_file(_safetensors(cfg, "training_adapter")) if cfg.training_adapter else None
