"""`python -m trainer train CONFIG` for ComfyUI architectures: ComfyUI as a library, no server.

A front end beside nodes/, not part of the library: trainer/ never imports ComfyUI or nodes/; its
CLI hands ComfyUI architectures to this module, which reaches ComfyUI only through nodes/comfy/.

Loads the diffusion model, VAE and text encoder from the config's .safetensors paths with
ComfyUI's own loaders, encodes the dataset through the same bridge the nodes use, and runs the
same training sequence (nodes/comfy/training.py), checkpoints and LoRA writer as the node, with
the console's progress bar (Ctrl-C saves a resumable checkpoint; --resume continues it).
"""
from __future__ import annotations

import functools
import time

from .nodes.comfy import loaders as comfy_loaders
from .trainer import config as cfg_module
from .trainer.archs import get_arch
from .trainer.console import finish, run_loop
from .trainer.data.dataset import DataSettings, Dataset
from .trainer.paths import inside


def train_command(config_path: str, resume: bool, loaders=comfy_loaders.load_models) -> int:
    cfg = cfg_module.load(config_path)
    comfy_loaders.start(cpu=cfg.device == "cpu")  # before the bridge imports ComfyUI's model management
    from .nodes.comfy import bridge

    if not cfg.dataset_dir:
        raise SystemExit(f"{config_path}: set dataset_dir to a folder of images with same-name .txt captions")
    name = cfg.run_name or f"{cfg.arch}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = inside(cfg.output_dir, name, f"{config_path}: run_name")  # refused before any loading
    model, vae, clip = loaders(cfg)
    fits = bridge.matching_archs(model)
    if cfg.arch not in fits:
        raise SystemExit(f"{config_path}: arch is {cfg.arch!r} but {cfg.model_path} is a "
                         f"{' / '.join(fits) or 'generic'} model; set arch to match the file")
    settings = DataSettings.from_config(cfg, get_arch(cfg.arch).bucket_divisor)
    dataset = Dataset.load(cfg.dataset_dir, settings, cache_dir=cfg.cache_dir or None)
    dataset = dataset.encode_images(*bridge.vae_encoder(vae)).encode_captions(*bridge.text_encoder(clip))
    dataset.prune_cache(cfg.cache_max_gb)
    print(dataset.summary())
    del vae, clip  # the encoders are not needed for training
    bridge.free_memory()
    result = bridge.train(cfg, model, dataset, adapter=comfy_loaders.training_adapter(cfg),
                          run=functools.partial(run_loop, run_dir=run_dir, resume=resume))
    finish(cfg, result, run_dir, name)
    return 0

