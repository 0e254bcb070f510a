"""The command line's parser: one sub-command each, its help, and the function that runs it."""

from __future__ import annotations

import argparse

from .commands import cmd_cache, cmd_caption, cmd_check_dataset, cmd_export, cmd_inspect, cmd_presets
from .estimate import cmd_estimate
from .lora_commands import add_commands, add_convert_command
from .train import cmd_demo, cmd_train


def _resolutions(text: str) -> list[int]:
    """--resolutions 512,768 → [512, 768]."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated pixel sizes like 512,768, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer", description="Kiln: LoRA training for diffusion transformers."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_add_demo, _add_train, _add_check_dataset, _add_caption, _add_estimate, _add_lora_files, _add_cache):
        add(commands)
    _add_presets(commands)
    add_commands(commands)  # merge, resize, extract
    return parser


def _add_demo(commands) -> None:
    demo = commands.add_parser("demo", help="train the built-in tiny DiT on a generated image set (CPU, ~1 min)")
    demo.add_argument("--output", default="runs", help="folder for the run folder 'demo' (default: runs)")
    demo.add_argument("--resume", action="store_true", help="continue the demo run from its newest checkpoint")
    demo.add_argument("--steps", type=int, help="total optimizer steps (default 200)")
    demo.add_argument("--stop-after", type=int, help="stop (with a resumable checkpoint) once this step is done")
    demo.add_argument(
        "--checkpoint-every", type=int, help="save a checkpoint every N steps (default 50; 0: at the end)"
    )
    demo.add_argument(
        "--backend",
        choices=["torch", "mlx"],
        help="training backend (default torch; mlx needs MLX: Apple Silicon, or mlx[cpu] on Linux)",
    )
    demo.set_defaults(func=cmd_demo)


def _add_train(commands) -> None:
    from ..archs import ARCHS  # the config's `arch`, each with what it is for (the registry's descriptions)

    train = commands.add_parser(
        "train",
        help="train from a .toml/.json config (see trainer/config/fields.py for every key)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="arch (in the config):\n" + "\n".join(f"  {a.name:14} {a.description}" for a in ARCHS.values()),
    )
    train.add_argument("config", help="path to the config file")
    train.add_argument("--resume", action="store_true", help="continue from the run folder's newest checkpoint")
    train.set_defaults(func=cmd_train)


def _add_check_dataset(commands) -> None:
    from ..archs import ARCHS

    check = commands.add_parser("check-dataset", help="scan a dataset folder: usable images, skipped files, fixes")
    check.add_argument("dir", help="the dataset folder (images with same-name .txt captions)")
    check.add_argument("--deep", action="store_true", help="decode every image fully (slower; catches corrupt data)")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument(
        "--resolutions", type=_resolutions, help="bucket resolutions, e.g. 512,768 (default: dataset.json's, else 512)"
    )
    check.add_argument(
        "--no-quality",
        dest="quality",
        action="store_false",
        help="skip the quality pass (near-duplicates, blur, caption length, a verdict per image)",
    )
    check.add_argument(
        "--arch",
        choices=list(ARCHS),
        help="check caption lengths against this family's text encoder only (default: every family's)",
    )
    _add_clip_settings(check)
    check.set_defaults(func=cmd_check_dataset)


def _add_clip_settings(command) -> None:
    """The clip settings (trainer/config/data.py's declarations; at their defaults dataset.json's apply)."""
    from ..config import CHOICES, FIELDS, HELP

    for name, kind in (("frames", int), ("fps", float), ("frame_extraction", str), ("frame_windows", int)):
        command.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            default=FIELDS[name].default,
            choices=CHOICES.get(name),
            help=f"clips: {HELP[name]} (default: %(default)s, else dataset.json's)",
        )


def _add_caption(commands) -> None:
    from ..data.captioning.jobs import STYLES

    cap = commands.add_parser(
        "caption",
        help="write a .txt caption beside each image that has none, with a "
        "local transformers model (Florence-2, BLIP, Qwen2.5-VL, ...)",
    )
    cap.add_argument("dir", help="the dataset folder")
    cap.add_argument(
        "--engine",
        choices=["transformers"],
        default="transformers",
        help="transformers (the other engine, ComfyUI's own vision-language text encoders, is the "
        "Kiln Caption Images node's)",
    )
    cap.add_argument(
        "--model",
        required=True,
        help="a transformers model folder (config.json, weights, processor "
        "files), e.g. ComfyUI/models/LLM/Florence-2-base (florence-community/Florence-2-base)",
    )
    cap.add_argument(
        "--style",
        choices=list(STYLES),
        default="short",
        help="; ".join(f"{name}: {style.description}" for name, style in STYLES.items()),
    )
    cap.add_argument("--prompt", help="the instruction to the model (default: the style's prompt)")
    cap.add_argument("--trigger", help="trigger word put in front of each caption (unless it is already in it)")
    cap.add_argument(
        "--overwrite", action="store_true", help="caption every image; each old caption is kept as <name>.txt.bak"
    )
    cap.add_argument("--max-tokens", type=int, default=256, help="longest caption, in tokens (default 256)")
    cap.add_argument("--seed", type=int, default=0, help="generation seed (the same for every image)")
    cap.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    cap.add_argument(
        "--deep", action="store_true", help="decode every image fully when scanning (catches corrupt data)"
    )
    cap.set_defaults(func=cmd_caption)


def _add_estimate(commands) -> None:
    est = commands.add_parser("estimate", help="estimate training memory for a config")
    est.add_argument("config", help="path to the config file")
    est.add_argument(
        "--variant",
        help="model size (e.g. flux2-klein-9b) or arch (e.g. zimage_turbo; a family of "
        "several sizes: its smallest); default: read from model_path, else the config's arch",
    )
    est.add_argument("--backend", choices=["torch", "mlx"], help="training backend (default: the config's)")
    est.add_argument(
        "--base-dtype",
        choices=["bf16", "fp8", "fp32", "int8", "int4"],
        help="base weights: bf16 (default), fp8 (torch), int8 (torch, mlx), int4 (mlx); default: base_quantize",
    )
    est.add_argument(
        "--memory-gb",
        type=float,
        help="GPU memory in GiB (torch), or the Mac's RAM in GB (mlx), to say whether it fits; on torch also "
        "the plan on such a card and a predicted step time on named cards of about that memory",
    )
    est.add_argument(
        "--cards",
        choices=["near", "all"],
        default="near",
        help="with --memory-gb: the named cards to predict for: those within ~20%% of it (near) or all",
    )
    est.add_argument(
        "--frames",
        type=int,
        default=1,
        help="video frames per clip (Wan: 4k+1, e.g. 81); 1 = an image, the only size an image model takes",
    )
    est.add_argument(
        "--processes",
        type=int,
        default=1,
        help="GPUs of a torchrun run (torchrun --nproc_per_node); with sharding shard each holds 1/N of the base "
        "(and of a full fine-tune's gradients, optimizer state and EMA)",
    )
    est.set_defaults(func=cmd_estimate)


def _add_lora_files(commands) -> None:
    exp = commands.add_parser("export", help="convert a LoRA file to another key format")
    exp.add_argument("lora", help="LoRA .safetensors to read")
    exp.add_argument("--format", required=True, choices=["comfy", "diffusers", "kohya"], help="target key format")
    exp.add_argument("--output", "-o", required=True, help="file to write")
    exp.add_argument("--arch", help="architecture (default: the file's kiln.arch metadata)")
    exp.add_argument("--overwrite", action="store_true", help="replace the output file if it exists")
    exp.set_defaults(func=cmd_export)
    add_convert_command(commands)

    ins = commands.add_parser("inspect", help="show a LoRA file's format, metadata, settings and modules by block")
    ins.add_argument("lora", help="LoRA .safetensors to read")
    ins.add_argument("--json", action="store_true", help="print everything as JSON (one entry per module)")
    ins.set_defaults(func=cmd_inspect)


def _add_cache(commands) -> None:
    cache = commands.add_parser("cache", help="show, prune or clear a latent/text cache folder")
    cache.add_argument("dir", help="the cache folder (a dataset's .kiln_cache, or cache_dir from the config)")
    cache.add_argument("--max-gb", type=float, help="delete least recently used entries until it fits")
    cache.add_argument("--clear", action="store_true", help="delete every cached entry")
    cache.set_defaults(func=cmd_cache)


def _add_presets(commands) -> None:
    presets = commands.add_parser("presets", help="list the presets: each one's reason in a line, the settings it sets")
    presets.set_defaults(func=cmd_presets)
