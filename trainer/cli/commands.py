"""The small commands: check-dataset, caption, export, cache, inspect, presets (the LoRA tools: lora_commands.py)."""

from __future__ import annotations

import json
from pathlib import Path


def cmd_check_dataset(args) -> int:
    from ..data.folder import quality
    from ..data.folder.report import format_report
    from ..data.folder.review import review

    from ..data.frames import FrameSettings

    frames = FrameSettings(args.frames, args.fps, args.frame_extraction, args.frame_windows)
    found = review(
        args.dir,
        resolutions=args.resolutions,
        arch=args.arch or "",
        deep=args.deep,
        quality=args.quality,
        frames=frames,
    )
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
    job = CaptionJob(
        style=args.style,
        prompt=args.prompt or "",
        trigger_word=args.trigger or "",
        overwrite=args.overwrite,
        deep=args.deep,
        engine=f"transformers:{model.resolve()}",
    )
    todo, report = plan(args.dir, job)
    if todo:  # the model is loaded only when there is something to caption
        from tqdm import tqdm

        engine = transformers_captioner(
            model, style=job.style, max_tokens=args.max_tokens, seed=args.seed, device=args.device
        )
        if getattr(engine, "note", ""):
            print(f"note: {engine.note}")
        with tqdm(total=len(todo), unit="image", dynamic_ncols=True) as bar:
            report = caption_folder(args.dir, engine, job, progress=lambda done, total: bar.update(done - bar.n))
    print(report.text())
    return 0


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


def cmd_presets(args) -> int:
    from ..config.presets import preset_table

    print(preset_table())
    return 0
