"""`python -m trainer train CONFIG` for ComfyUI architectures: ComfyUI as a library, no server.

A front end beside nodes/, not part of the library: trainer/ never imports ComfyUI or nodes/; its
CLI hands ComfyUI architectures to this module, which sets ComfyUI up and then uses the bridge.

Loads the diffusion model, VAE and text encoder from the config's .safetensors
paths with ComfyUI's own loaders, encodes the dataset through the same bridge
the nodes use, and runs the same loop, checkpoints and LoRA writer as the demo
(Ctrl-C saves a resumable checkpoint; --resume continues it).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from .trainer import config as cfg_module
from .trainer.data import MappedLatents
from .trainer.data.dataset import DataSettings, Dataset
from .trainer.paths import inside

CLIP_TYPES = {"flux2": "FLUX2", "zimage": "LUMINA2"}  # arch family → comfy.sd.CLIPType name


def _safetensors(cfg, key: str) -> str:
    path = getattr(cfg, key)
    if not path:
        raise ValueError(f"set {key} to the .safetensors file (headless training loads the model from files)")
    if not Path(path).is_file():
        raise FileNotFoundError(f"{key}: {path} does not exist")
    if not path.endswith(".safetensors"):
        raise ValueError(f"{key}: {path} is not a .safetensors file (Kiln never unpickles .ckpt/.pt files)")
    return path


def load_models(cfg):
    """(MODEL, VAE, CLIP) from files, through ComfyUI's own loaders."""
    import comfy.sd
    import comfy.utils

    from .trainer.archs import get_arch

    family = get_arch(cfg.arch).family
    model = comfy.sd.load_diffusion_model(_safetensors(cfg, "model_path"))
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(_safetensors(cfg, "vae_path")))
    if family not in CLIP_TYPES:
        raise ValueError(f"arch {cfg.arch!r}: headless training knows the text encoders of "
                         f"{sorted(CLIP_TYPES)} models; train other models with the nodes")
    clip = comfy.sd.load_clip(ckpt_paths=[_safetensors(cfg, "text_encoder_path")],
                              clip_type=getattr(comfy.sd.CLIPType, CLIP_TYPES[family]))
    return model, vae, clip


def _comfy(cpu: bool):
    """ComfyUI's bridge, with ComfyUI on the CPU when the config asks (read once, at the import of
    comfy.model_management, which importing the bridge triggers)."""
    if cpu and "comfy.model_management" not in sys.modules:
        from comfy.cli_args import args as comfy_args

        comfy_args.cpu = True
    from .nodes import bridge

    return bridge


def train_command(config_path: str, resume: bool, loaders=load_models) -> int:
    from .trainer.__main__ import _finish, _run

    cfg = cfg_module.load(config_path)
    bridge = _comfy(cfg.device == "cpu")
    if not cfg.dataset_dir:
        raise SystemExit(f"{config_path}: set dataset_dir to a folder of images with same-name .txt captions")
    name = cfg.run_name or f"{cfg.arch}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = inside(cfg.output_dir, name, f"{config_path}: run_name")  # refused before any loading
    model, vae, clip = loaders(cfg)
    detected = bridge.detect_arch(model)
    expected = "zimage" if cfg.arch == "zimage_turbo" else cfg.arch
    if detected != expected:
        raise SystemExit(f"{config_path}: arch is {cfg.arch!r} but {cfg.model_path} is a {detected!r} model")
    settings = DataSettings.from_config(cfg, 16)
    dataset = Dataset.load(cfg.dataset_dir, settings, cache_dir=cfg.cache_dir or None)
    dataset = dataset.encode_images(*bridge.vae_encoder(vae)).encode_captions(*bridge.text_encoder(clip))
    dataset.prune_cache(cfg.cache_max_gb)
    print(dataset.summary())
    del vae, clip  # the encoders are not needed for training
    bridge.free_memory()

    model = bridge.trainable(model)
    train_model = model
    if cfg.training_adapter:
        train_model = bridge.training_adapter_merged(model, bridge.load_lora_file(_safetensors(cfg, "training_adapter")))
    data = MappedLatents(dataset.training_data(), lambda raw: bridge.latents_in(model, raw))
    if cfg.backend == "mlx":
        from .nodes.run import mlx_model  # the node's own conversion: same weights, same MLX port

        result = _run(cfg, mlx_model(train_model, cfg), data, run_dir, resume)
    else:
        with bridge.training_session(train_model, cfg.device) as (module, _device):
            result = _run(cfg, module, data, run_dir, resume, forward=bridge.make_forward(train_model, cfg.arch))
    bridge.free_memory()
    _finish(cfg, result, run_dir, name)
    return 0
