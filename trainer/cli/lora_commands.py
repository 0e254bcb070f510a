"""`python -m trainer merge | resize | extract | convert`: the LoRA file commands from a shell. merge, resize and
extract (lora_tools.py, lora_extract.py) print the energy report; convert (lora_sources.py) the placement report.
Each writes its LoRA atomically in the chosen key format."""

from __future__ import annotations

import json
from pathlib import Path

_FORMATS, _DTYPES = ("comfy", "diffusers", "kohya"), ("bf16", "fp16", "fp32")


def _input(text: str) -> tuple[str, float]:
    """IN or IN:weight → (path, weight); a ':' not followed by a number is part of the path (C:\\…)."""
    path, colon, weight = text.rpartition(":")
    if colon:
        try:
            return path, float(weight)
        except ValueError:
            pass
    return text, 1.0


def _rule(args, *, rank_required: bool = False):
    from ..lora.tools import RankRule

    methods = [
        (name, getattr(args, name))
        for name in ("sv_ratio", "sv_fro", "sv_cumulative")
        if getattr(args, name) is not None
    ]
    if not methods:
        if args.rank is None:
            if rank_required:
                raise ValueError(
                    "give --rank R (and optionally --sv-ratio/--sv-fro/--sv-cumulative with it as the cap)"
                )
            return None
        return RankRule(args.rank)
    if rank_required and args.rank is None:
        raise ValueError(
            f"--{methods[0][0].replace('_', '-')} needs --rank as its cap when extracting (e.g. --rank 64)"
        )
    return RankRule(args.rank, *methods[0])


def _metadata(sources: list[dict[str, str]], arch: str | None, title: str, operation: dict, summary: str):
    from ..lora.files import build_metadata

    words: list[str] = []
    for metadata in sources:
        try:
            found = json.loads(metadata.get("kiln.trigger_words", "[]"))
        except json.JSONDecodeError:
            found = []
        words += [w for w in found if isinstance(w, str) and w not in words]
    return build_metadata(
        arch_name=arch or "generic",
        config={},
        steps=0,
        trigger_words=words,
        title=title,
        notes=summary,
        extra={"kiln.lora_tool": json.dumps(operation, sort_keys=True)},
    )


def _write(args, lora, report, sources: list[dict[str, str]], operation: dict) -> int:
    from ..archs import guess_arch
    from ..lora.files import save_lora
    from ..lora.tools import format_report

    out = Path(args.output)
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it, or choose another name")
    arch = (
        args.arch
        or next((m["kiln.arch"] for m in sources if m.get("kiln.arch") not in (None, "generic")), None)
        or guess_arch(lora)
    )
    text = format_report(report)
    metadata = _metadata(sources, arch, out.stem, {**operation, "kept": report.kept}, text.splitlines()[0])
    save_lora(out, lora, arch=arch, fmt=args.format, dtype=args.dtype, metadata=metadata)
    print(json.dumps(report.to_dict(), indent=2) if args.json else text)
    print(f"wrote {out} ({args.format}, {args.dtype}, {len(lora)} modules)")
    return 0


def cmd_merge(args) -> int:
    from ..lora.files import load_lora
    from ..lora.tools import merge

    inputs = [_input(text) for text in args.inputs]
    loaded = [load_lora(path, arch=args.arch) for path, _ in inputs]  # merge() refuses LoKr/LoHa/DoRA by name
    rule = _rule(args)
    lora, report = merge(
        [lora for lora, _ in loaded], [w for _, w in inputs], rule, sources=[Path(path).name for path, _ in inputs]
    )
    operation = {
        "operation": "merge",
        "inputs": [{"file": Path(p).name, "weight": w} for p, w in inputs],
        "rule": rule.describe() if rule else "exact",
    }
    return _write(args, lora, report, [metadata for _, metadata in loaded], operation)


def cmd_resize(args) -> int:
    from ..lora.adapters import require_lora
    from ..lora.files import load_lora
    from ..lora.tools import resize

    source, metadata = load_lora(args.input, arch=args.arch)
    require_lora(source, "resize", args.input)
    rule = _rule(args, rank_required=False)
    if rule is None:
        raise ValueError("give --rank R, or --sv-ratio / --sv-fro / --sv-cumulative (with --rank as a cap)")
    lora, report = resize(source, rule)
    return _write(
        args, lora, report, [metadata], {"operation": "resize", "input": Path(args.input).name, "rule": rule.describe()}
    )


def cmd_extract(args) -> int:
    from ..lora.extract import ModelFile, extract

    rule = _rule(args, rank_required=True)
    device = args.device or _default_device()
    lora, report = extract(
        ModelFile(args.base),
        ModelFile(args.tuned),
        rule,
        clamp_quantile=args.clamp_quantile,
        min_diff=args.min_diff,
        svd=args.svd,
        device=device,
    )
    operation = {
        "operation": "extract",
        "base": Path(args.base).name,
        "tuned": Path(args.tuned).name,
        "rule": rule.describe(),
        "clamp_quantile": args.clamp_quantile,
        "svd": args.svd,
    }
    return _write(args, lora, report, [], operation)


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _output_options(parser) -> None:
    parser.add_argument("--format", choices=_FORMATS, default="comfy", help="key format of the output (default comfy)")
    parser.add_argument("--dtype", choices=_DTYPES, default="bf16", help="weight dtype of the output (default bf16)")
    parser.add_argument(
        "--arch",
        help="architecture (diffusers names, metadata; default: the inputs' kiln.arch, "
        "else guessed from the module names)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace the output file if it exists")
    parser.add_argument("--json", action="store_true", help="print the energy report as JSON (every module)")


def _rank_options(parser, rank_help: str) -> None:
    parser.add_argument("--rank", type=int, help=rank_help)
    dynamic = parser.add_mutually_exclusive_group()
    dynamic.add_argument("--sv-ratio", type=float, help="dynamic rank: keep σ > σ_max / value (≥ 1, e.g. 10)")
    dynamic.add_argument(
        "--sv-fro", type=float, help="dynamic rank: keep this fraction of each module's Frobenius norm (0–1, e.g. 0.9)"
    )
    dynamic.add_argument(
        "--sv-cumulative", type=float, help="dynamic rank: keep this fraction of each module's Σσ (0–1, e.g. 0.9)"
    )


def add_commands(commands) -> None:
    """merge, resize and extract (convert has add_convert_command)."""
    add_merge_command(commands)
    add_resize_command(commands)
    add_extract_command(commands)


def add_merge_command(commands) -> None:
    merge = commands.add_parser(
        "merge",
        help="merge LoRAs into one (weighted; exact, or SVD to --rank)",
        description="Σ weight·ΔW per module. Without --rank the merge is exact (rank = sum of ranks); with --rank "
        "or a dynamic rule, the exact sum reduced by SVD, with the energy kept reported.",
    )
    merge.add_argument("output", help="LoRA file to write")
    merge.add_argument(
        "inputs",
        nargs="+",
        metavar="IN[:weight]",
        help="LoRA files, each with an optional weight (default 1; negative subtracts), e.g. style.safetensors:0.7",
    )
    _rank_options(merge, "reduce the merged LoRA to this rank by SVD (default: exact, rank = sum of ranks)")
    _output_options(merge)
    merge.set_defaults(func=cmd_merge)


def add_resize_command(commands) -> None:
    resize = commands.add_parser(
        "resize",
        help="change a LoRA's rank by SVD; reports the energy kept",
        description="SVD of B·A·scale per module to a fixed or dynamic rank; alpha = new "
        "rank (scale folded), so at full rank the effect is unchanged.",
    )
    resize.add_argument("input", help="LoRA file to read")
    resize.add_argument("output", help="LoRA file to write")
    _rank_options(resize, "the new rank (with a dynamic rule: the most any module keeps)")
    _output_options(resize)
    resize.set_defaults(func=cmd_resize)


def add_extract_command(commands) -> None:
    extract = commands.add_parser(
        "extract",
        help="a LoRA from the difference of two models (fine-tune − base)",
        description="Every weight matrix that differs, tuned − base, reduced by SVD; biases and norms that differ "
        "are reported (a LoRA cannot hold them). Files: ComfyUI diffusion-model .safetensors (or full "
        "checkpoints, whose model.diffusion_model. part is used), bf16/fp16/fp32 or scaled float8.",
    )
    extract.add_argument("base", help="the base model file")
    extract.add_argument("tuned", help="the fine-tuned model file")
    extract.add_argument("output", help="LoRA file to write")
    _rank_options(extract, "rank of each module (with a dynamic rule: the most any module keeps); required")
    extract.add_argument(
        "--clamp-quantile",
        type=float,
        help="clamp factor entries beyond this quantile of their absolute values (kohya's 0.99); default: no clamp",
    )
    extract.add_argument(
        "--min-diff",
        type=float,
        default=0.0,
        help="leave out matrices whose relative change ‖ΔW‖/‖W‖ is at most this (default 0: only equal ones)",
    )
    extract.add_argument(
        "--svd",
        choices=("auto", "full", "lowrank"),
        default="auto",
        help="auto (default): exact SVD up to 1024 wide, randomized (torch.svd_lowrank) above; full: always exact",
    )
    extract.add_argument("--device", help="torch device for the SVDs (default: cuda if available, else cpu)")
    _output_options(extract)
    extract.set_defaults(func=cmd_extract)


def cmd_convert(args) -> int:
    from ..lora.files import convert_file

    if Path(args.output).exists() and not args.overwrite:
        raise FileExistsError(f"{args.output} already exists; pass --overwrite to replace it, or choose another output")
    converted = convert_file(
        args.lora, args.output, arch=args.arch, fmt=args.format, allow_unplaced=args.allow_unplaced
    )
    print(converted.report())
    print(f"wrote {args.output} ({args.format})")
    return 0


def add_convert_command(commands) -> None:
    from ..archs import ARCHS

    conv = commands.add_parser(
        "convert",
        help="read another trainer's LoRA (ai-toolkit, musubi-tuner, SimpleTuner, diffusers/PEFT, kohya, "
        "ComfyUI's trainer, LyCORIS LoKr/LoHa) and write one ComfyUI loads key for key",
    )
    conv.add_argument("lora", help="LoRA .safetensors to read")
    conv.add_argument("output", help="file to write")
    conv.add_argument(
        "--arch",
        choices=list(ARCHS),
        help="architecture (default: the file's kiln.arch, else the one whose module names the keys fit)",
    )
    conv.add_argument(
        "--format",
        default="comfy",
        choices=["comfy", "diffusers", "kohya"],
        help="key layout to write (default comfy; LoKr/LoHa only as comfy)",
    )
    conv.add_argument(
        "--allow-unplaced", action="store_true", help="write the keys that fit and list the others, instead of stopping"
    )
    conv.add_argument("--overwrite", action="store_true", help="replace the output file if it exists")
    conv.set_defaults(func=cmd_convert)
