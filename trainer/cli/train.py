"""`python -m trainer demo` and `python -m trainer train CONFIG`: the one place that sets a run up from a config
(read it, the init LoRA's rank and alpha, join torchrun's ranks, the dataset, the run folder), once, then hands
ComfyUI architectures to headless.py with what it prepared."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .pack import headless

if TYPE_CHECKING:  # `python -m trainer` stays light: the config and torchrun modules load when a command needs them
    from ..config import TrainConfig
    from ..run.distributed import Group


def cmd_demo(args) -> int:
    import os

    from ..demo.run import build_data, demo_config, make_dataset, model_for
    from .console import finish, run_loop

    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise SystemExit(
            'the demo runs in one process; under torchrun, train a config with arch = "demo" '
            "(`torchrun --nproc_per_node N -m trainer train CONFIG`, README: Several GPUs)"
        )

    # A shorter demo keeps the warm-up at a tenth of the run.
    overrides = {}
    if args.steps:
        overrides = {"steps": args.steps, "warmup_steps": max(1, args.steps // 10)}
        if args.steps < 2:
            overrides.update(lr_schedule="constant", warmup_steps=0)
    if args.backend:
        overrides["backend"] = args.backend
    if args.checkpoint_every is not None:
        overrides["checkpoint_every"] = args.checkpoint_every
    cfg = demo_config(**overrides)
    run_dir = Path(args.output) / cfg.run_name
    dataset = run_dir / "dataset"
    if not args.resume or not dataset.is_dir():
        make_dataset(dataset, seed=cfg.seed)
    started = time.perf_counter()
    result = run_loop(
        cfg, model_for(cfg), build_data(cfg, dataset), run_dir=run_dir, resume=args.resume, stop_after=args.stop_after
    )
    print(f"demo run folder: {run_dir} ({time.perf_counter() - started:.1f} s)")
    finish(cfg, result, run_dir, "demo_lora")
    return 0


@dataclass(frozen=True)
class Prepared:
    """A run as the command line set it up: what headless.py gets for a ComfyUI architecture."""

    source: str  # the config file, for messages
    cfg: TrainConfig  # with an init LoRA's rank and alpha
    group: Group  # this rank of torchrun's, or the one process
    name: str  # the run's name (the LoRA file's too)
    run_dir: Path


def prepare(config_path: str) -> Prepared:
    """The five setup steps of a config run, in this order, once."""
    from ..config import files as config_file
    from ..paths import inside
    from ..run import distributed, init_lora

    cfg, _ = init_lora.prepare(config_file.load(config_path))  # an init_lora file's rank and alpha, before any use
    # Under torchrun: join the other ranks first (each takes its GPU before anything picks one, ComfyUI included).
    group = distributed.start(cfg.device, cfg.backend)
    if cfg.arch != "demo":
        headless()  # ComfyUI's model code importable, else a SystemExit that says how, before any other check
    if not cfg.dataset_dir:
        raise SystemExit(f"{config_path}: set dataset_dir to a folder of images with same-name .txt captions")
    name = cfg.run_name or f"{cfg.arch}-{time.strftime('%Y%m%d-%H%M%S', distributed.main_time())}"
    run_dir = inside(cfg.output_dir, name, f"{config_path}: run_name")  # refused before any loading
    return Prepared(config_path, cfg, group, name, run_dir)


def cmd_train(args) -> int:
    return train_config(args.config, args.resume)


def train_config(config_path: str, resume: bool, **headless_options) -> int:
    """Train from a config file: the demo arch here, a ComfyUI architecture through headless.py (its options:
    tests hand it tiny model loaders)."""
    run = prepare(config_path)
    if run.cfg.arch != "demo":
        return headless().train_command(run, resume, **headless_options)
    from ..demo.run import build_data, model_for
    from ..run import distributed
    from .console import finish, run_loop

    cfg = run.cfg
    model = model_for(cfg)
    with distributed.main_first():  # rank 0 fills the caches; the others read them
        data = build_data(cfg, Path(cfg.dataset_dir), Path(cfg.cache_dir) if cfg.cache_dir else None)
    result = run_loop(cfg, model, data, run_dir=run.run_dir, resume=resume)
    finish(cfg, result, run.run_dir, run.name)
    return 0
