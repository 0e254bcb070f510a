"""Command line: python -m trainer {demo, train, check-dataset, caption, cache, estimate, export, convert,
inspect, merge, resize, extract}. Run with --help."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def cmd_demo(args) -> int:
    import os

    from ..demo.run import build_data, demo_config, make_dataset, model_for
    from .console import finish, run_loop

    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise SystemExit("the demo runs in one process; under torchrun, train a config with arch = \"demo\" "
                         "(`torchrun --nproc_per_node N -m trainer train CONFIG`, README: Several GPUs)")

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
    result = run_loop(cfg, model_for(cfg), build_data(cfg, dataset), run_dir=run_dir,
                      resume=args.resume, stop_after=args.stop_after)
    print(f"demo run folder: {run_dir} ({time.perf_counter() - started:.1f} s)")
    finish(cfg, result, run_dir, "demo_lora")
    return 0


def cmd_train(args) -> int:
    from ..config import files as config_file
    from ..run import distributed, init_lora

    cfg = config_file.load(args.config)
    cfg, _ = init_lora.prepare(cfg)   # an init_lora file's rank and alpha, before anything uses them
    # Under torchrun: join the other ranks first (each takes its GPU before anything picks one).
    distributed.start(cfg.device, cfg.backend)
    if cfg.arch != "demo":
        return _headless().train_command(args.config, args.resume)
    from ..demo.run import build_data, model_for
    from ..paths import inside
    from .console import finish, run_loop
    if not cfg.dataset_dir:
        raise SystemExit(f"{args.config}: set dataset_dir to a folder of images with same-name .txt captions")
    name = cfg.run_name or f"{cfg.arch}-{time.strftime('%Y%m%d-%H%M%S', distributed.main_time())}"
    run_dir = inside(cfg.output_dir, name, f"{args.config}: run_name")
    model = model_for(cfg)
    with distributed.main_first():   # rank 0 fills the caches; the others read them
        data = build_data(cfg, Path(cfg.dataset_dir), Path(cfg.cache_dir) if cfg.cache_dir else None)
    result = run_loop(cfg, model, data, run_dir=run_dir, resume=args.resume)
    finish(cfg, result, run_dir, name)
    return 0


def _headless():
    """The pack's headless front end (headless.py, beside nodes/), for ComfyUI architectures, whose
    model code is ComfyUI's. The library itself never imports ComfyUI or nodes/."""
    import importlib.util
    import os

    path = os.environ.get("COMFYUI_PATH", "").strip()
    if not path and importlib.util.find_spec("comfy") is None:
        raise SystemExit("this architecture trains ComfyUI's own model code, and ComfyUI is not importable here: "
                         "set COMFYUI_PATH to a ComfyUI checkout (0.17 or newer) and run again, "
                         "or use arch 'demo' to try the trainer without it")
    if path and path not in sys.path:
        sys.path.insert(0, path)
    return import_pack("headless")


PACK = "kiln_pack"


def import_pack(name: str = ""):
    """This repository imported as a package (`kiln_pack.<name>`), the way ComfyUI imports
    custom_nodes/<folder>: `nodes` then never shadows ComfyUI's own `nodes` module."""
    import importlib
    import importlib.util

    if PACK not in sys.modules:
        root = Path(__file__).resolve().parents[2]   # trainer/cli/main.py → the pack root
        spec = importlib.util.spec_from_file_location(PACK, root / "__init__.py",
                                                      submodule_search_locations=[str(root)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACK] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{PACK}.{name}" if name else PACK)


def cmd_check_dataset(args) -> int:
    from ..data.folder import quality
    from ..data.folder.report import format_report
    from ..data.folder.review import review

    found = review(args.dir, resolutions=args.resolutions, arch=args.arch or "", deep=args.deep,
                   quality=args.quality)
    report, buckets, verdicts = found.report, found.buckets, found.verdicts
    if args.json:
        extra = {**({"buckets": buckets} if buckets else {}), **({"verdicts": verdicts} if verdicts else {})}
        print(json.dumps({**report.to_dict(), **extra}, indent=2, ensure_ascii=False))
    else:
        print(format_report(report, buckets, verdicts=[quality.verdict_line(v) for v in verdicts or []]))
    return 0 if report.ok else 1


def cmd_caption(args) -> int:
    from ..data.captioning.jobs import CaptionJob, caption_folder, plan
    from ..data.captioning.models import resolve_model, transformers_captioner

    model = resolve_model(args.model, [])
    job = CaptionJob(style=args.style, prompt=args.prompt or "", trigger_word=args.trigger or "",
                     overwrite=args.overwrite, deep=args.deep, engine=f"transformers:{model.resolve()}")
    todo, report = plan(args.dir, job)
    if todo:   # the model is loaded only when there is something to caption
        from tqdm import tqdm

        engine = transformers_captioner(model, style=job.style, max_tokens=args.max_tokens, seed=args.seed,
                                        device=args.device)
        if getattr(engine, "note", ""):
            print(f"note: {engine.note}")
        with tqdm(total=len(todo), unit="image", dynamic_ncols=True) as bar:
            report = caption_folder(args.dir, engine, job, progress=lambda done, total: bar.update(done - bar.n))
    print(report.text())
    return 0


def _resolutions(text: str) -> list[int]:
    """--resolutions 512,768 → [512, 768]."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated pixel sizes like 512,768, got {text!r}")
    return values


def cmd_estimate(args) -> int:
    from ..config import files as config_file
    from ..data.companions import reference_count
    from ..estimate.common import (
        VARIANTS,
        arch_variants,
        backend_rules,
        format_estimate,
        resolve_variant,
        several_sizes_note,
        variant_from_header,
    )
    from ..run.holdout import estimate_notes as holdout_notes

    cfg = config_file.load(args.config)
    notes = []
    if args.variant is not None:  # a size or an arch: one vocabulary
        variants = resolve_variant(args.variant)
        notes += several_sizes_note(args.variant, variants)
    elif cfg.model_path and Path(cfg.model_path).is_file():
        from ..safetensors_io import read_header
        header, _ = read_header(cfg.model_path)
        variants = [variant_from_header({k: v["shape"] for k, v in header.items()})]
    else:  # the config's arch is enough
        variants = arch_variants(cfg.arch)
        if not variants:
            raise SystemExit(f"give --variant (one of {sorted(VARIANTS)}) or a model_path in {args.config}")
        if cfg.model_path:
            notes.append(f"model_path {cfg.model_path} not found, so not read; estimated from arch {cfg.arch}")
        notes += several_sizes_note(cfg.arch, variants)
    variant = variants[0]
    notes += holdout_notes(cfg)
    for note in notes:
        print(f"note: {note}")
    backend = args.backend or cfg.backend
    estimate = backend_rules(backend).estimate
    base = args.base_dtype or (cfg.base_quantize if backend == "mlx" and cfg.base_quantize != "none" else "bf16")
    references = reference_count(cfg.dataset_dir)   # edit datasets' control folders (both backends train them)
    def estimated(resolution: int, budget: float):
        return estimate(variant, resolution=resolution, batch_size=cfg.batch_size, rank=cfg.rank,
                        targets=tuple(cfg.targets) or None, optimizer=cfg.optimizer,
                        gradient_checkpointing=cfg.gradient_checkpointing, base_dtype=base,
                        mixed_precision=cfg.mixed_precision, skip_checkpoint_blocks=cfg.skip_checkpoint_blocks,
                        preservation=cfg.preservation_weight > 0,
                        **({"checkpoint_budget": budget} if budget else {}),  # torch only
                        **({"fp8_compute": True} if cfg.fp8_compute is True else {}),   # auto: no copies
                        **({"reference_images": references} if references else {}),
                        **({"adapter": cfg.adapter, "lokr_factor": cfg.lokr_factor, "lokr_full_w2": cfg.lokr_full_w2}
                           if cfg.adapter != "lora" else {}))

    budget = cfg.checkpoint_budget
    if budget == "auto":
        budget = _auto_budget(estimated, cfg, backend, args.memory_gb)
    for resolution in cfg.resolutions:
        print(format_estimate(estimated(resolution, budget), device_memory_gb=args.memory_gb))
    _step_graphs_note(estimated, cfg, backend, budget)
    return 0


def _step_graphs_note(estimated, cfg, backend: str, budget: float) -> None:
    """step_graphs' memory pool, which a CUDA run adds where it fits (backends/torch_backend/levers.py)."""
    from ..estimate.torch_step import GRAPH_POOL_FACTOR, graph_resolution

    recorded = graph_resolution(cfg.resolutions, cfg.batch_size)
    if backend != "torch" or cfg.step_graphs is False or recorded is None:
        return
    step = estimated(recorded, budget)
    pool = GRAPH_POOL_FACTOR * (step.total - step.weights) / 2**30
    when = "" if cfg.step_graphs is True else ", where it fits beside the largest step (auto; else they stay off)"
    print(f"note: step_graphs on a CUDA GPU: steps of up to {recorded}x{recorded} px replay as CUDA graphs from a "
          f"memory pool of ~{pool:.1f} GiB more{when}")


def _auto_budget(estimated, cfg, backend: str, memory_gb: float | None) -> float:
    """checkpoint_budget auto as a run on a GPU of --memory-gb would pick it (backends/torch_backend/levers.py)."""
    from ..estimate.torch_step import auto_margin, largest_budget

    if backend != "torch" or not cfg.gradient_checkpointing or cfg.compile_blocks is False:
        return 0.0
    if not memory_gb:
        print("note: checkpoint_budget auto: a run keeps the largest share of activations that fits the GPU's free "
              "memory; estimated here at 0 (plain checkpointing). Give --memory-gb to see what a GPU would get.")
        return 0.0
    largest = max(cfg.resolutions)
    total = int(memory_gb * 2**30)
    weights = estimated(largest, 0.0).weights
    budget = largest_budget(lambda b: (lambda e: e.total - e.weights)(estimated(largest, b)),
                            total - weights - auto_margin(total))
    print(f"note: checkpoint_budget auto → {budget:g} on a {memory_gb:g} GiB GPU (its largest share that leaves "
          f"{auto_margin(total) / 2**30:.1f} GiB free at {largest} px)")
    return budget


def cmd_export(args) -> int:
    from ..lora.files import export

    if Path(args.output).exists() and not args.overwrite:
        raise FileExistsError(f"{args.output} already exists; pass --overwrite to replace it, or choose another -o")
    export(args.lora, args.output, args.format, arch=None if args.arch is None else _arch(args.arch))
    print(f"wrote {args.output} ({args.format})")
    return 0


def cmd_cache(args) -> int:
    from ..data.cache import Cache

    cache = Cache(args.dir)
    if not cache.root.is_dir():
        raise FileNotFoundError(f"{cache.root}: no such cache folder")
    if args.clear or args.max_gb is not None:
        removed = cache.clear() if args.clear else cache.prune(int(args.max_gb * 2**30))
        print(f"removed {removed}")
    print(f"{cache.root}: {cache.usage()}")
    return 0


def cmd_inspect(args) -> int:
    from ..lora.report import describe

    info = describe(args.lora)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        from ..lora.report import format_description
        print(format_description(info))
    return 0


def _arch(name: str):
    from ..archs import get_arch
    return get_arch(name)


def _add_lora_tool_commands(commands) -> None:
    from .lora_commands import add_commands
    add_commands(commands)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer", description="Kiln: LoRA training for diffusion transformers.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train the built-in tiny DiT on a generated image set (CPU, ~1 min)")
    demo.add_argument("--output", default="runs", help="folder for the run folder 'demo' (default: runs)")
    demo.add_argument("--resume", action="store_true", help="continue the demo run from its newest checkpoint")
    demo.add_argument("--steps", type=int, help="total optimizer steps (default 200)")
    demo.add_argument("--stop-after", type=int, help="stop (with a resumable checkpoint) once this step is done")
    demo.add_argument("--checkpoint-every", type=int, help="save a checkpoint every N steps (default 50; 0: at the end)")
    demo.add_argument("--backend", choices=["torch", "mlx"],
                      help="training backend (default torch; mlx needs MLX: Apple Silicon, or mlx[cpu] on Linux)")
    demo.set_defaults(func=cmd_demo)

    from ..archs import (
        ARCHS,  # the config's `arch`, each with what it is for (the registry's descriptions)
    )

    train = commands.add_parser(
        "train", help="train from a .toml/.json config (see trainer/config/fields.py for every key)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="arch (in the config):\n" + "\n".join(f"  {a.name:14} {a.description}" for a in ARCHS.values()))
    train.add_argument("config", help="path to the config file")
    train.add_argument("--resume", action="store_true", help="continue from the run folder's newest checkpoint")
    train.set_defaults(func=cmd_train)

    check = commands.add_parser("check-dataset", help="scan a dataset folder: usable images, skipped files, fixes")
    check.add_argument("dir", help="the dataset folder (images with same-name .txt captions)")
    check.add_argument("--deep", action="store_true", help="decode every image fully (slower; catches corrupt data)")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument("--resolutions", type=_resolutions,
                       help="bucket resolutions, e.g. 512,768 (default: dataset.json's, else 512)")
    check.add_argument("--no-quality", dest="quality", action="store_false",
                       help="skip the quality pass (near-duplicates, blur, caption length, a verdict per image)")
    check.add_argument("--arch", choices=list(ARCHS), help="check caption lengths against this family's text "
                       "encoder only (default: every family's)")
    check.set_defaults(func=cmd_check_dataset)

    from ..data.captioning.jobs import STYLES

    cap = commands.add_parser("caption", help="write a .txt caption beside each image that has none, with a "
                              "local transformers model (Florence-2, BLIP, Qwen2.5-VL, ...)")
    cap.add_argument("dir", help="the dataset folder")
    cap.add_argument("--engine", choices=["transformers"], default="transformers",
                     help="transformers (the other engine, ComfyUI's own vision-language text encoders, is the "
                     "Kiln Caption Images node's)")
    cap.add_argument("--model", required=True, help="a transformers model folder (config.json, weights, processor "
                     "files), e.g. ComfyUI/models/LLM/Florence-2-base (florence-community/Florence-2-base)")
    cap.add_argument("--style", choices=list(STYLES), default="short",
                     help="; ".join(f"{name}: {style.description}" for name, style in STYLES.items()))
    cap.add_argument("--prompt", help="the instruction to the model (default: the style's prompt)")
    cap.add_argument("--trigger", help="trigger word put in front of each caption (unless it is already in it)")
    cap.add_argument("--overwrite", action="store_true",
                     help="caption every image; each old caption is kept as <name>.txt.bak")
    cap.add_argument("--max-tokens", type=int, default=256, help="longest caption, in tokens (default 256)")
    cap.add_argument("--seed", type=int, default=0, help="generation seed (the same for every image)")
    cap.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    cap.add_argument("--deep", action="store_true", help="decode every image fully when scanning (catches corrupt data)")
    cap.set_defaults(func=cmd_caption)

    est = commands.add_parser("estimate", help="estimate training memory for a config")
    est.add_argument("config", help="path to the config file")
    est.add_argument("--variant", help="model size (e.g. flux2-klein-9b) or arch (e.g. zimage_turbo; a family of "
                     "several sizes: its smallest); default: read from model_path, else the config's arch")
    est.add_argument("--backend", choices=["torch", "mlx"], help="training backend (default: the config's)")
    est.add_argument("--base-dtype", choices=["bf16", "fp8", "fp32", "int8", "int4"],
                     help="base weights: bf16 (default), fp8 (torch), int8/int4 (mlx; default the config's base_quantize)")
    est.add_argument("--memory-gb", type=float,
                     help="GPU memory in GiB (torch), or the Mac's RAM in GB (mlx), to say whether it fits")
    est.set_defaults(func=cmd_estimate)

    exp = commands.add_parser("export", help="convert a LoRA file to another key format")
    exp.add_argument("lora", help="LoRA .safetensors to read")
    exp.add_argument("--format", required=True, choices=["comfy", "diffusers", "kohya"], help="target key format")
    exp.add_argument("--output", "-o", required=True, help="file to write")
    exp.add_argument("--arch", help="architecture (default: the file's kiln.arch metadata)")
    exp.add_argument("--overwrite", action="store_true", help="replace the output file if it exists")
    exp.set_defaults(func=cmd_export)

    from .lora_commands import add_convert_command
    add_convert_command(commands)

    ins = commands.add_parser("inspect", help="show a LoRA file's format, metadata, settings and modules by block")
    ins.add_argument("lora", help="LoRA .safetensors to read")
    ins.add_argument("--json", action="store_true", help="print everything as JSON (one entry per module)")
    ins.set_defaults(func=cmd_inspect)

    cache = commands.add_parser("cache", help="show, prune or clear a latent/text cache folder")
    cache.add_argument("dir", help="the cache folder (a dataset's .kiln_cache, or cache_dir from the config)")
    cache.add_argument("--max-gb", type=float, help="delete least recently used entries until it fits")
    cache.add_argument("--clear", action="store_true", help="delete every cached entry")
    cache.set_defaults(func=cmd_cache)
    _add_lora_tool_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError) as err:  # OSError: a full disk, a folder where a file goes
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
