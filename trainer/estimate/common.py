"""What the two memory estimates share: trainer/estimate/torch_step.py (torch) and trainer/estimate/mlx_step.py (MLX).

The model side (variants.py) comes from the archs: a variant's `ModelDims` names its arch, and the arch carries the
latent layout (latent_channels, latent_downscale, patch), the default LoRA targets and the family's
`Layout` (its Linears, extra parameters, block model; trainer/archs/layout.py). Nothing here tests a
family name. The backend estimators sit in ESTIMATORS and are imported on first use, so neither
estimate module imports the other.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from ..archs.layout import ModelDims, ceil_to
from ..lora import adapters
from .variants import (  # noqa: F401 (the model side, importable from here as before)
    VARIANTS,
    arch_of,
    arch_variants,
    get_dims,
    layout_of,
    linear_layers,
    lora_shapes,
    param_count,
    resolve_variant,
    several_sizes_note,
    variant_from_header,
)

GIB = 2**30
BASE_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4, "int8": 1}
INT8_SCALE_BYTES = 4  # base_dtype int8 (torch base_quantize int8): an fp32 scale per output channel of a block Linear
ACTIVATION_BYTES = {"bf16": 2, "no": 4}  # mixed_precision, as in TrainConfig


# Optimizer state per trainable entry, in bytes (torchao's 8-bit AdamW: plus a 4 B scale per 256 entries, left
# out as bitsandbytes' block scales are). adafactor and came also keep row and column statistics of each 2-D
# tensor: adafactor its second moment's, came those and its confidence's.
STATE_BYTES = {
    "adamw": 8,
    "adamw8bit": 2,
    "adafactor": 0,
    "prodigy": 16,
    "lion": 4,
    "came": 4,
    "schedulefree": 8,
    "adamw8bit_torchao": 2,
}
FACTORED = {"adafactor": 1, "came": 2}


def state_bytes(optimizer: str, tensors) -> int:
    """Optimizer state of the trainable 2-D tensors [(rows, columns), ...]."""
    per, factored = STATE_BYTES[optimizer], FACTORED.get(optimizer, 0)
    return sum(per * r * c + 4 * factored * (r + c) for r, c in tensors)


def _lora_state(optimizer: str):
    return lambda shapes, rank: state_bytes(optimizer, [t for i, o in shapes for t in ((rank, i), (o, rank))])


# Optimizer state in bytes, from the targeted (in, out) shapes and the rank (A [r,in], B [out,r]).
OPTIMIZER_STATE = {name: _lora_state(name) for name in STATE_BYTES}


def adapter_costs(
    kind: str,
    shapes,
    rank: int,
    optimizer: str,
    *,
    lokr_factor: int = -1,
    lokr_full_w2: bool = False,
    tokens: int = 0,
    act: int = 2,
    blocks: int = 1,
    checkpointing: bool = True,
) -> tuple[int, int, int, str]:
    """(trainable params, optimizer bytes, extra step bytes, note) of adapter lokr/loha/dora (trainer/lora/adapters.py).
    Extra: LoHa builds its ΔW [out, in] per layer (two fp32 products kept for backward, ΔW, its bf16 cast: 14 B
    a weight entry); DoRA keeps its scaled input [tokens, in] per layer. Checkpointing keeps one block's worth
    (taken as the targeted layers' share of one block, an approximation)."""
    per_layer = [adapters.tensor_shapes(kind, i, o, rank, lokr_factor, lokr_full_w2) for i, o in shapes]
    params = sum(r * c for layer in per_layer for r, c in layer)
    optimizer_bytes = state_bytes(optimizer, [shape for layer in per_layer for shape in layer])
    extra = {"loha": sum(14 * i * o for i, o in shapes), "dora": sum(act * tokens * i for i, _ in shapes)}.get(kind, 0)
    if checkpointing:
        extra = extra // max(blocks, 1)
    note = {
        "loha": "loha builds each layer's ΔW [out, in] in the step (counted in the workspace)",
        "dora": "dora keeps each layer's scaled input (counted in the workspace)",
    }.get(kind, f"adapter {kind}")
    return params, optimizer_bytes, extra, note


def trainable_costs(settings: dict, dims: ModelDims, shapes, tokens: int, act: int) -> tuple[int, int, int, str | None]:
    """(trainable params, optimizer bytes, extra step bytes, note or None) of the estimate's `settings`
    (its arguments by name): a plain LoRA's, or its adapter's (adapter_costs)."""
    kind, rank, optimizer = settings["adapter"], settings["rank"], settings["optimizer"]
    if kind == "full":  # no adapter: every weight trains (full_step.py counts it)
        return 0, 0, 0, None
    if kind == "lora":
        return sum(rank * (i + o) for i, o in shapes), OPTIMIZER_STATE[optimizer](shapes, rank), 0, None
    return adapter_costs(
        kind,
        shapes,
        rank,
        optimizer,
        lokr_factor=settings["lokr_factor"],
        lokr_full_w2=settings["lokr_full_w2"],
        tokens=tokens,
        act=act,
        blocks=dims.double_blocks + dims.single_blocks,
        checkpointing=settings["gradient_checkpointing"],
    )


def check_settings(dims: ModelDims, resolution, batch_size, rank, optimizer, base_dtype, mixed_precision) -> int:
    """Validate the settings; returns the pixels per token side."""
    for name, value, table in (
        ("optimizer", optimizer, OPTIMIZER_STATE),
        ("base_dtype", base_dtype, BASE_DTYPE_BYTES),
        ("mixed_precision", mixed_precision, ACTIVATION_BYTES),
    ):
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


def latent_frames(dims: ModelDims, frames: int) -> int:
    """Latent frames of a clip of `frames` frames (1 for an image): the VAE keeps the first and compresses
    the rest by the arch's frames_per_latent (Wan: 4k+1 frames → k+1)."""
    per_latent = arch_of(dims).frames_per_latent
    if frames < 1 or (frames > 1 and per_latent == 1) or (frames - 1) % per_latent:
        form = "1 (an image model)" if per_latent == 1 else f"{per_latent}k+1 (1, {per_latent + 1}, ...)"
        raise ValueError(f"frames must be {form} for {dims.variant}, got {frames}")
    return 1 + (frames - 1) // per_latent


def block_bytes(dims: ModelDims, image_tokens: int, text_tokens: int, act: int) -> list[tuple[int, int, int]]:
    """(bytes kept per token inside one block, blocks, tokens each sees) per block group, empty ones left out."""
    return [
        (group.kept * act + group.kept_fp32 * 4, group.count, group.tokens)
        for group in layout_of(dims).blocks(dims, image_tokens, text_tokens)
        if group.count
    ]


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
    tokens: int  # sequence tokens per step: batch x (image + text)
    notes: list[str] = field(default_factory=list)
    settings: dict = field(default_factory=dict)  # the estimate() arguments, for what-if advice

    @classmethod
    def summed(
        cls,
        *,
        weights: int,
        lora_params: int,
        optimizer: int,
        activations: int,
        workspace: int,
        tokens: int,
        notes: list[str],
        settings: dict,
    ) -> Estimate:
        """The parts and their total; the LoRA and its gradients are fp32, 4 B a parameter each."""
        total = weights + 8 * lora_params + optimizer + activations + workspace
        return cls(
            weights=weights,
            lora=4 * lora_params,
            gradients=4 * lora_params,
            optimizer=optimizer,
            activations=activations,
            workspace=workspace,
            total=total,
            lora_params=lora_params,
            tokens=tokens,
            notes=notes,
            settings=settings,
        )


# preservation_weight > 0 (trainer/objective/preservation.py): what differential output preservation costs a step.
PRESERVATION_NOTE = (
    "differential output preservation: the forward with grad runs twice the batch (the rows and "
    "their class-word rows; counted above), and one more forward without grad a step (one block's "
    "activations at a time): 2.3-2.4x a plain step's time on an H100"
)


def preservation_rows(batch_size: int, preservation: bool) -> int:
    """Rows of the forward with grad: DOP adds each row's class-word row."""
    return batch_size * (2 if preservation else 1)


def ordered_advice(settings: dict, backend_steps: list[tuple[str, dict, bool]]) -> list[tuple[str, dict]]:
    """Changes that lower memory, cheapest in quality first: checkpointing (every block), the backend's
    own steps, then lower resolutions; only those that change something."""
    steps = [
        (
            "checkpoint_budget 0 (each block keeps only its input)",
            {"checkpoint_budget": 0.0},
            settings["gradient_checkpointing"] and settings.get("checkpoint_budget", 0) > 0,
        ),
        (
            "skip_checkpoint_blocks 0 (every block recomputed)",
            {"skip_checkpoint_blocks": 0},
            settings["gradient_checkpointing"] and settings.get("skip_checkpoint_blocks", 0) > 0,
        ),
        ("gradient checkpointing on", {"gradient_checkpointing": True}, not settings["gradient_checkpointing"]),
        *backend_steps,
    ]
    steps += [(f"resolution {res}", {"resolution": res}, res < settings["resolution"]) for res in (768, 512)]
    return [(label, change) for label, change, useful in steps if useful]


class EstimatorRules(NamedTuple):
    """One backend's estimate, its advice, the usable GiB of a device of `memory_gb`, and what that memory is."""

    estimate: Callable[..., Estimate]
    advice: Callable[[dict], list[tuple[str, dict]]]
    usable_gib: Callable[[float], float]
    device: Callable[[float, float], str]
    # the fewest blocks to stream from host memory for the step to fit `budget` bytes, as an advice line (None: none)
    stream: Callable[[dict, float], str | None] | None = None


# Backend -> the module whose RULES estimate for it, imported on first use.
ESTIMATORS = {"torch": "torch_advice", "mlx": "mlx_step"}


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
    full = bool(s) and s.get("adapter") == "full"
    title = (
        (
            f"Memory estimate: {get_dims(s['variant']).variant}, {s['resolution']} px"
            + (f" × {s['frames']} frames" if s.get("frames", 1) > 1 else "")
            + f", batch {s['batch_size']}, "
            + ("full fine-tune" if s.get("adapter") == "full" else f"rank {s['rank']}")
            + f", {s['optimizer']}, checkpointing {'on' if s['gradient_checkpointing'] else 'off'}"
            + "".join(
                f" ({key.replace('_', ' ')} {s[key]:g})"
                for key in ("skip_checkpoint_blocks", "checkpoint_budget")
                if s["gradient_checkpointing"] and s.get(key)
            )
            + ", "
            f"base {s['base_dtype']}, mixed precision {s['mixed_precision']}"
            + (", backend mlx" if s.get("backend") == "mlx" else "")
        )
        if s
        else "Memory estimate"
    )
    rows = [
        ("weights", est.weights),
        ("EMA (fp32)" if full else "LoRA (fp32)", est.lora),
        ("gradients", est.gradients),
        ("optimizer state", est.optimizer),
        ("activations", est.activations),
        ("workspace", est.workspace),
        ("total", est.total),
    ]
    lines = [title] + [f"  {name:<16}{size / GIB:8.2f} GiB" for name, size in rows]
    trained = "trained params (every weight)" if full else "LoRA params"
    lines.append(f"  {trained} {est.lora_params / 1e6:.1f} M, {est.tokens} tokens per step")
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
    streamed = rules.stream(s, budget) if s and rules.stream else None
    return "\n".join(lines + ([streamed] if streamed else []))
