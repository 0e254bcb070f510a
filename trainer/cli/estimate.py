"""`python -m trainer estimate CONFIG`: the memory a config needs, per resolution, with the notes that explain it."""

from __future__ import annotations

from pathlib import Path


def _variant(cfg, args) -> tuple[object, list[str]]:
    """The model size to estimate (--variant, else the model_path's header, else the config's arch) and the
    notes that say how it was chosen."""
    from ..estimate.common import VARIANTS, arch_variants, resolve_variant, several_sizes_note, variant_from_header

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
    return variants[0], notes


def cmd_estimate(args) -> int:
    from ..config import files as config_file
    from ..data.companions import reference_count
    from ..estimate.common import backend_rules, format_estimate, get_dims, latent_frames
    from ..run.holdout import estimate_notes as holdout_notes

    cfg = config_file.load(args.config)
    variant, notes = _variant(cfg, args)
    notes += holdout_notes(cfg)
    for note in notes:
        print(f"note: {note}")
    backend = args.backend or cfg.backend
    if getattr(args, "frames", 1) > 1 and backend != "torch":
        raise SystemExit("--frames: only the torch backend trains video models (Wan); give --backend torch")
    if cfg.adapter == "full" and backend != "torch":
        raise SystemExit("adapter full (full fine-tune) trains on the torch backend only; give --backend torch")
    shards = _shards(cfg, getattr(args, "processes", 1))
    estimate = backend_rules(backend).estimate
    base = args.base_dtype or (cfg.base_quantize if cfg.base_quantize not in ("auto", "none") else "bf16")
    references = reference_count(cfg.dataset_dir)  # edit datasets' control folders (both backends train them)

    def estimated(resolution: int, budget: float):
        return estimate(
            variant,
            resolution=resolution,
            batch_size=cfg.batch_size,
            rank=cfg.rank,
            targets=tuple(cfg.targets) or None,
            optimizer=cfg.optimizer,
            gradient_checkpointing=cfg.gradient_checkpointing,
            base_dtype=base,
            mixed_precision=cfg.mixed_precision,
            skip_checkpoint_blocks=cfg.skip_checkpoint_blocks,
            preservation=cfg.preservation_weight > 0,
            **({"checkpoint_budget": budget} if budget else {}),  # torch only
            **({"stream_blocks": cfg.stream_blocks} if cfg.stream_blocks not in (0, "auto") else {}),  # torch only
            **({"fp8_compute": True} if cfg.fp8_compute is True else {}),  # auto: no copies
            **({"reference_images": references} if references else {}),
            **({"frames": args.frames} if getattr(args, "frames", 1) > 1 else {}),  # torch only
            **({"offload_activations": True} if cfg.offload_activations is True else {}),  # torch only
            **(
                {"adapter": cfg.adapter, "lokr_factor": cfg.lokr_factor, "lokr_full_w2": cfg.lokr_full_w2}
                if cfg.adapter != "lora"
                else {}
            ),
            **({"ema": cfg.ema} if cfg.adapter == "full" else {}),  # a LoRA's EMA is a few MB: not counted
            **({"shards": shards} if shards > 1 else {}),  # torch only
        )

    budget = cfg.checkpoint_budget
    if budget == "auto":
        budget = _auto_budget(estimated, cfg, backend, args.memory_gb)
    for resolution in cfg.resolutions:
        print(format_estimate(estimated(resolution, budget), device_memory_gb=args.memory_gb))
    _step_graphs_note(estimated, cfg, backend, budget, latent_frames(get_dims(variant), getattr(args, "frames", 1)))
    if args.memory_gb and backend == "torch":  # after today's output, which stays as it was
        _card_plans(estimated(max(cfg.resolutions), 0.0).settings, cfg, args)
    return 0


def _shards(cfg, processes: int) -> int:
    """The ranks the base (a full run: weights, gradients, optimizer state, EMA) is split over per GPU: --processes
    under sharding shard; auto decides at the start of a run, so it is estimated whole (said in a note)."""
    if processes > 1 and cfg.sharding == "auto":
        print(
            f"note: sharding auto decides at the run's start; estimated whole on each of {processes} GPUs "
            "(set sharding shard to see the split)"
        )
    return processes if processes > 1 and cfg.sharding == "shard" else 1


def _card_plans(settings: dict, cfg, args) -> None:
    """`--memory-gb`: the plan on that card and the predicted step on named cards; where the run does not fit even
    streamed, the plan a run's auto then takes (memory_plan.py): the blocks' kept inputs on the host
    (offload_activations auto), else the base in int8 (base_quantize auto), with the inputs on the host if need be."""
    from ..config.checks import offload_possible
    from ..estimate.cards import card_plan, plan_lines

    if cfg.adapter == "full":  # nothing streams or quantizes: the table above is the plan
        print(
            f"a full fine-tune keeps every trained block on the GPU: the table above is its plan on {args.memory_gb:g} GiB"
        )
        return
    every = getattr(args, "cards", None) == "all"
    budget = cfg.checkpoint_budget if cfg.compile_blocks is not False else 0.0  # auto needs compiled blocks
    print("\n".join(plan_lines(settings, args.memory_gb, budget, every)))

    def fits(chosen: dict) -> bool:
        return card_plan(chosen, args.memory_gb).streamed is not None

    offload = cfg.offload_activations == "auto" and offload_possible(cfg)  # as memory_plan._may_offload
    moved = " with the blocks' kept inputs in pinned host memory (offload_activations auto → on; their copies, two a "
    moved += "block a step, are not in the predicted times)"
    if fits(settings):
        return
    if offload and fits({**settings, "offload_activations": True}):  # each block recomputed whole: no budget
        print(f"the step fits{moved}:")
        print("\n".join(plan_lines({**settings, "offload_activations": True}, args.memory_gb, 0.0, every)))
        small = {**settings, "base_dtype": "int8"}
        if settings["base_dtype"] == "bf16" and cfg.base_quantize in ("auto", "int8") and fits(small):
            # auto keeps the base exact; the int8 plan beside it streams half the bytes (faster where copies bound)
            print("or with the base rounded to int8 instead (set base_quantize int8; half the bytes to stream):")
            print("\n".join(plan_lines(small, args.memory_gb, budget, every)))
    elif cfg.base_quantize == "auto" and settings["base_dtype"] == "bf16":
        small = {**settings, "base_dtype": "int8"}
        inputs = offload and not fits(small) and fits({**small, "offload_activations": True})
        print(
            f"base_quantize auto → int8 (in bf16 the run does not fit {args.memory_gb:g} GiB even streamed)"
            + (moved if inputs else "")
            + ":"
        )
        small = {**small, "offload_activations": True} if inputs else small
        print("\n".join(plan_lines(small, args.memory_gb, 0.0 if inputs else budget, every)))


def _step_graphs_note(estimated, cfg, backend: str, budget: float, frames: int = 1) -> None:
    """step_graphs' memory pool, which a CUDA run adds where it fits (backends/torch_backend/levers.py)."""
    from ..estimate.torch_step import GRAPH_POOL_FACTOR, graph_resolution

    recorded = graph_resolution(cfg.resolutions, cfg.batch_size * frames)  # a clip's latent frames: pixels too
    if backend != "torch" or cfg.step_graphs is False or recorded is None:
        return
    step = estimated(recorded, budget)
    pool = GRAPH_POOL_FACTOR * (step.total - step.weights) / 2**30
    when = "" if cfg.step_graphs is True else ", where it fits beside the largest step (auto; else they stay off)"
    print(
        f"note: step_graphs on a CUDA GPU: steps of up to {recorded}x{recorded} px replay as CUDA graphs from a "
        f"memory pool of ~{pool:.1f} GiB more{when}"
    )


def _auto_budget(estimated, cfg, backend: str, memory_gb: float | None) -> float:
    """checkpoint_budget auto as a run on a GPU of --memory-gb would pick it (backends/torch_backend/levers.py)."""
    from ..estimate.torch_step import auto_margin, budget_on

    if backend != "torch" or not cfg.gradient_checkpointing or cfg.compile_blocks is False:
        return 0.0
    if not memory_gb:
        print(
            "note: checkpoint_budget auto: a run keeps the largest share of activations that fits the GPU's free "
            "memory; estimated here at 0 (plain checkpointing). Give --memory-gb to see what a GPU would get."
        )
        return 0.0
    largest = max(cfg.resolutions)
    total = int(memory_gb * 2**30)
    budget = budget_on(lambda b: estimated(largest, b), total)
    print(
        f"note: checkpoint_budget auto → {budget:g} on a {memory_gb:g} GiB GPU (its largest share that leaves "
        f"{auto_margin(total) / 2**30:.1f} GiB free at {largest} px)"
    )
    return budget
