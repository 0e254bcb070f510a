"""What the two memory estimates share: trainer/estimate/torch_step.py (torch) and trainer/estimate/mlx_step.py (MLX).

The model side comes from the archs: a variant's `ModelDims` names its arch, and the arch carries the
latent layout (latent_channels, latent_downscale, patch), the default LoRA targets and the family's
`Layout` (its Linears, extra parameters, block model; trainer/archs/layout.py). Nothing here tests a
family name. The backend estimators sit in ESTIMATORS and are imported on first use, so neither
estimate module imports the other.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from ..archs import ARCHS, Arch, get_arch
from ..archs.layout import Layout, ModelDims, Shapes, ceil_to
from ..lora import adapters
from ..lora.targets import TargetError, select_targets

GIB = 2 ** 30
BASE_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
ACTIVATION_BYTES = {"bf16": 2, "no": 4}   # mixed_precision, as in TrainConfig


def _variants() -> dict[str, ModelDims]:
    """Every registered arch's Layout variants, in registry order (archs sharing a Layout list them once)."""
    layouts = {id(arch.layout): arch.layout for arch in ARCHS.values() if arch.layout is not None}
    return {dims.variant: dims for layout in layouts.values() for dims in layout.variants}


VARIANTS: dict[str, ModelDims] = _variants()


def get_dims(variant: str | ModelDims) -> ModelDims:
    """VARIANTS[variant]; a ModelDims passes through (for hypothetical sizes)."""
    if isinstance(variant, ModelDims):
        return variant
    try:
        return VARIANTS[variant]
    except KeyError:
        raise ValueError(f"unknown model variant {variant!r}; choose one of {list(VARIANTS)}") from None


def arch_variants(arch_name: str) -> list[str]:
    """The VARIANTS an arch trains, smallest first; empty for an arch without a Layout (demo, generic).
    Archs sharing one model (zimage_turbo and zimage) share its variants."""
    layout = get_arch(arch_name).layout
    if layout is None:
        return []
    own = [dims for dims in layout.variants if dims.arch == arch_name] or list(layout.variants)
    return [dims.variant for dims in sorted(own, key=param_count)]


def resolve_variant(name: str) -> list[str]:
    """A variant (flux2-klein-9b) or an arch (flux2_klein) -> the variants it names, smallest first."""
    if name in VARIANTS:
        return [name]
    if name in ARCHS and arch_variants(name):
        return arch_variants(name)
    archs = [arch for arch in ARCHS if arch_variants(arch)]
    raise ValueError(f"unknown --variant {name!r}; give a model size ({', '.join(VARIANTS)}) "
                     f"or an arch ({', '.join(archs)})")


def several_sizes_note(name: str, variants: list[str]) -> list[str]:
    """The note an estimate of the smallest of several variants carries; none for one variant."""
    if len(variants) < 2:
        return []
    return [f"{name} comes in {', '.join(variants)}; estimated the smallest, {variants[0]}; "
            f"pick another with --variant {' or --variant '.join(variants[1:])}"]


def arch_of(dims: ModelDims) -> Arch:
    """The arch `dims` names; it must carry a Layout."""
    arch = get_arch(dims.arch)
    if arch.layout is None:
        raise ValueError(f"{dims.variant}: arch {dims.arch!r} has no Layout (trainer/archs/layout.py), so there is "
                         f"no memory estimate for it; known variants: {list(VARIANTS)}")
    return arch


def layout_of(dims: ModelDims) -> Layout:
    return arch_of(dims).layout


def linear_layers(dims: ModelDims) -> Shapes:
    """Every Linear of the diffusion model: ComfyUI module path -> (in, out), in model order."""
    arch = arch_of(dims)
    return arch.layout.linear_layers(dims, arch.latent_channels * arch.patch ** 2)


def param_count(dims: ModelDims) -> int:
    """Linear weights + biases + norm scales + pad tokens (everything a checkpoint holds)."""
    layers = linear_layers(dims)
    return sum(i * o for i, o in layers.values()) + layout_of(dims).extra_params(dims, layers)


_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def variant_from_header(shapes: dict[str, list[int]]) -> str:
    """The VARIANTS key of a ComfyUI diffusion-model safetensors header (key -> shape)."""
    keys = {}
    for key, shape in shapes.items():
        if isinstance(shape, (list, tuple)):
            keys[next((key[len(p):] for p in _PREFIXES if key.startswith(p)), key)] = list(shape)
    layouts = list({id(layout_of(dims)): layout_of(dims) for dims in VARIANTS.values()}.values())
    layout = next((layout for layout in layouts if all(k in keys for k in layout.header.markers)), None)
    if layout is None:
        names = " or ".join(layout.name for layout in layouts)
        markers = " or ".join(layout.header.markers[0].removesuffix(".weight") for layout in layouts)
        raise ValueError(f"not a {names} diffusion model (no {markers} weight among {len(keys)} tensors, "
                         f"e.g. {sorted(keys)[:5]}); known variants: {list(VARIANTS)}")
    spec = layout.header
    found = {name: keys[key][axis] for name, (key, axis) in spec.sizes.items()}
    found.update({name: _count(keys, prefix) for name, prefix in spec.counts.items()})
    for dims in layout.variants:
        if all(getattr(dims, k) == v for k, v in found.items()):
            return dims.variant
    raise ValueError(f"{layout.name} model with {found} matches none of the known variants {list(VARIANTS)}")


def _count(keys, prefix: str) -> int:
    indices = {int(k[len(prefix):].split(".")[0]) for k in keys if k.startswith(prefix)}
    return max(indices) + 1 if indices else 0


def lora_shapes(dims: ModelDims, targets) -> list[tuple[int, int]]:
    """(in, out) of every Linear the targets (None: the arch's defaults) select."""
    layers = linear_layers(dims)
    patterns = get_arch(dims.arch).default_targets if targets is None else tuple(targets)
    try:
        return [layers[name] for name in select_targets(list(layers), patterns)]
    except TargetError as err:
        raise ValueError(f"{dims.variant}: {err}") from None


def _per_param(nbytes: int):
    return lambda shapes, rank: nbytes * sum(rank * (i + o) for i, o in shapes)


# Optimizer state in bytes, from the targeted (in, out) shapes and the rank.
OPTIMIZER_STATE = {
    "adamw": _per_param(8),
    "adamw8bit": _per_param(2),
    "adafactor": lambda shapes, rank: 4 * sum((rank + i) + (o + rank) for i, o in shapes),  # A [r,in], B [out,r]
    "prodigy": _per_param(16),
}


def adapter_costs(kind: str, shapes, rank: int, optimizer: str, *, lokr_factor: int = -1, lokr_full_w2: bool = False,
                  tokens: int = 0, act: int = 2, blocks: int = 1, checkpointing: bool = True) -> tuple[int, int, int, str]:
    """(trainable params, optimizer bytes, extra step bytes, note) of adapter lokr/loha/dora (trainer/lora/adapters.py).
    Extra: LoHa builds its ΔW [out, in] per layer (two fp32 products kept for backward, ΔW, its bf16 cast: 14 B
    a weight entry); DoRA keeps its scaled input [tokens, in] per layer. Checkpointing keeps one block's worth
    (taken as the targeted layers' share of one block, an approximation)."""
    per_layer = [adapters.tensor_shapes(kind, i, o, rank, lokr_factor, lokr_full_w2) for i, o in shapes]
    params = sum(r * c for layer in per_layer for r, c in layer)
    if optimizer == "adafactor":   # factored second moment of each 2-D tensor: rows + columns
        optimizer_bytes = 4 * sum(r + c for layer in per_layer for r, c in layer)
    else:
        optimizer_bytes = {"adamw": 8, "adamw8bit": 2, "prodigy": 16}[optimizer] * params
    extra = {"loha": sum(14 * i * o for i, o in shapes), "dora": sum(act * tokens * i for i, _ in shapes)}.get(kind, 0)
    if checkpointing:
        extra = extra // max(blocks, 1)
    note = {"loha": "loha builds each layer's ΔW [out, in] in the step (counted in the workspace)",
            "dora": "dora keeps each layer's scaled input (counted in the workspace)"}.get(kind, f"adapter {kind}")
    return params, optimizer_bytes, extra, note


def check_settings(dims: ModelDims, resolution, batch_size, rank, optimizer, base_dtype, mixed_precision) -> int:
    """Validate the settings; returns the pixels per token side."""
    for name, value, table in (("optimizer", optimizer, OPTIMIZER_STATE), ("base_dtype", base_dtype, BASE_DTYPE_BYTES),
                               ("mixed_precision", mixed_precision, ACTIVATION_BYTES)):
        if value not in table:
            raise ValueError(f"{name} must be one of {list(table)}, got {value!r}")
    arch = arch_of(dims)
    side = arch.latent_downscale * arch.patch
    if resolution < side or resolution % side:
        raise ValueError(f"resolution must be a positive multiple of {side} px for {dims.variant}, got {resolution}")
    if batch_size < 1 or rank < 1:
        raise ValueError(f"batch_size and rank must be >= 1, got {batch_size} and {rank}")
    return side


def image_token_count(dims: ModelDims, resolution: int, side: int) -> int:
    """Image tokens of a square bucket, padded as the model pads them (Layout.token_multiple)."""
    return ceil_to((resolution // side) ** 2, layout_of(dims).token_multiple)


def block_bytes(dims: ModelDims, image_tokens: int, text_tokens: int, act: int) -> list[tuple[int, int, int]]:
    """(bytes kept per token inside one block, blocks, tokens each sees) per block group, empty ones left out."""
    return [(group.kept * act + group.kept_fp32 * 4, group.count, group.tokens)
            for group in layout_of(dims).blocks(dims, image_tokens, text_tokens) if group.count]


def widest_output(dims: ModelDims) -> int:
    """Features of the widest per-token block Linear output: it and its gradient meet in backward."""
    return layout_of(dims).widest_output(dims)


def kept_by_last_blocks(groups: list[tuple[int, int]], skip: int) -> int:
    """Bytes the last `skip` blocks keep when they are not checkpointed (skip_checkpoint_blocks), from
    (bytes per block, blocks) groups in block order."""
    kept = 0
    for block_bytes, count in reversed(groups):
        take = min(count, skip)
        kept, skip = kept + take * block_bytes, skip - take
    return kept


@dataclass
class Estimate:
    """Bytes per part of one training step; `total` is their sum."""

    weights: int
    lora: int
    gradients: int
    optimizer: int
    activations: int
    workspace: int
    total: int
    lora_params: int
    tokens: int               # sequence tokens per step: batch x (image + text)
    notes: list[str] = field(default_factory=list)
    settings: dict = field(default_factory=dict)  # the estimate() arguments, for what-if advice


# preservation_weight > 0 (trainer/objective/preservation.py): what differential output preservation costs a step.
PRESERVATION_NOTE = ("differential output preservation: the forward with grad runs twice the batch (the rows and "
                     "their class-word rows; counted above), and one more forward without grad a step (one block's "
                     "activations at a time): 2.3-2.4x a plain step's time on an H100")


def preservation_rows(batch_size: int, preservation: bool) -> int:
    """Rows of the forward with grad: DOP adds each row's class-word row."""
    return batch_size * (2 if preservation else 1)


def ordered_advice(settings: dict, backend_steps: list[tuple[str, dict, bool]]) -> list[tuple[str, dict]]:
    """Changes that lower memory, cheapest in quality first: checkpointing (every block), the backend's
    own steps, then lower resolutions; only those that change something."""
    steps = [("checkpoint_budget 0 (each block keeps only its input)", {"checkpoint_budget": 0.0},
              settings["gradient_checkpointing"] and settings.get("checkpoint_budget", 0) > 0),
             ("skip_checkpoint_blocks 0 (every block recomputed)", {"skip_checkpoint_blocks": 0},
              settings["gradient_checkpointing"] and settings.get("skip_checkpoint_blocks", 0) > 0),
             ("gradient checkpointing on", {"gradient_checkpointing": True}, not settings["gradient_checkpointing"]),
             *backend_steps]
    steps += [(f"resolution {res}", {"resolution": res}, res < settings["resolution"]) for res in (768, 512)]
    return [(label, change) for label, change, useful in steps if useful]


class EstimatorRules(NamedTuple):
    """One backend's estimate, its advice, the usable GiB of a device of `memory_gb`, and what that memory is."""

    estimate: Callable[..., Estimate]
    advice: Callable[[dict], list[tuple[str, dict]]]
    usable_gib: Callable[[float], float]
    device: Callable[[float, float], str]


# Backend -> the module whose RULES estimate for it, imported on first use.
ESTIMATORS = {"torch": "torch_step", "mlx": "mlx_step"}


def backend_rules(backend: str) -> EstimatorRules:
    """The estimate, advice and memory budget of `backend` (a key of ESTIMATORS)."""
    try:
        module = ESTIMATORS[backend]
    except KeyError:
        raise ValueError(f"backend must be one of {list(ESTIMATORS)}, got {backend!r}") from None
    return importlib.import_module(f".{module}", __package__).RULES


def format_estimate(est: Estimate, *, device_memory_gb: float | None = None) -> str:
    """A readable table; with device memory (GiB as nvidia-smi shows; for MLX the Mac's RAM in GB):
    fits or not, and what to change."""
    s = est.settings
    title = (f"Memory estimate: {get_dims(s['variant']).variant}, {s['resolution']} px, batch {s['batch_size']}, "
             f"rank {s['rank']}, {s['optimizer']}, checkpointing {'on' if s['gradient_checkpointing'] else 'off'}"
             + "".join(f" ({key.replace('_', ' ')} {s[key]:g})" for key in ("skip_checkpoint_blocks", "checkpoint_budget")
                       if s['gradient_checkpointing'] and s.get(key)) + ", "
             f"base {s['base_dtype']}, mixed precision {s['mixed_precision']}"
             + (", backend mlx" if s.get("backend") == "mlx" else "")) if s else "Memory estimate"
    rows = [("weights", est.weights), ("LoRA (fp32)", est.lora), ("gradients", est.gradients),
            ("optimizer state", est.optimizer), ("activations", est.activations),
            ("workspace", est.workspace), ("total", est.total)]
    lines = [title] + [f"  {name:<16}{size / GIB:8.2f} GiB" for name, size in rows]
    lines.append(f"  LoRA params {est.lora_params / 1e6:.1f} M, {est.tokens} tokens per step")
    lines += [f"  note: {note}" for note in est.notes]
    if device_memory_gb is None:
        return "\n".join(lines)
    rules = backend_rules(s.get("backend", "torch") if s else "torch")
    budget_gib = rules.usable_gib(device_memory_gb)
    where = rules.device(device_memory_gb, budget_gib)
    budget = budget_gib * GIB
    if est.total <= budget:
        lines.append(f"fits in {where} ({(budget - est.total) / GIB:.1f} GiB to spare)")
        return "\n".join(lines)
    lines.append(f"does not fit in {where} (needs {est.total / GIB:.1f} GiB); try, in order:")
    changes: dict = {}
    arguments = {k: v for k, v in s.items() if k != "backend"} if s else {}
    for label, change in rules.advice(s) if s else []:
        changes.update(change)
        total = rules.estimate(**{**arguments, **changes}).total
        fits = total <= budget
        lines.append(f"  + {label}: {total / GIB:.1f} GiB" + (" (fits)" if fits else ""))
        if fits:
            break
    else:
        lines.append("  still too large: use a GPU with more memory or a smaller variant")
    return "\n".join(lines)
