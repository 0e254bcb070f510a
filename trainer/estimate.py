"""Memory estimate for one LoRA training step on a full-size Flux2 or Z-Image model.

An estimate, not a measurement: it counts the big tensors and adds a margin.
Per GPU, diffusion model only; the text encoder and VAE are assumed run
beforehand (cached latents and embeddings) or offloaded.

    weights      params x bytes(base_dtype): bf16 2, fp8 1, fp32 4 (frozen, no grads)
    lora         rank*(in+out) per targeted Linear, fp32; gradients the same
    optimizer    per LoRA param: adamw 8 B (exp_avg, exp_avg_sq), adamw8bit 2 B
                 (bitsandbytes; block scales ignored), prodigy 16 B (exp_avg,
                 exp_avg_sq, s, p0; p0 of a zero lora_B is a scalar, so ~14 B real);
                 adafactor 4 B x (rows + cols) per LoRA matrix (torch.optim.Adafactor:
                 factored second moment, no momentum)
    activations  what autograd keeps: the block model below
    workspace    1 GiB (CUDA context, cuBLAS workspace, allocator slack) + 2x the
                 widest Linear output (it and its gradient in backward) + for fp8
                 bases the largest weight upcast to bf16 on use

Tokens: one per 16x16 pixels of the (square, worst-case) bucket in both families (Flux2: latent /16,
patch 1; Z-Image: latent /8, patch 2, padded to a multiple of 32), plus 512 text tokens (Flux2 pads
context to 512; for Z-Image 512 caption tokens is an upper bound).

Block model: bytes autograd keeps per token, read with saved_tensors_hooks from
ComfyUI 0.17's own full-size blocks on CUDA with Kiln's LoRA on every block
Linear under bf16 autocast. D = hidden, M = MLP hidden (Flux2 3D, Z-Image 10240).
A frozen base Linear keeps only its weight; each LoRA branch keeps its bf16
input (measured when every branch kept its own copy; since the branch uses the
input as it comes, Linears sharing one input share it, so Z-Image's w1/w3 term
below counts D per token more than autograd now keeps: a conservative ~4 %
of a Z-Image block); Flux2's LayerNorm keeps an fp32 copy of its input; the q/k
RMSNorm's input is a view that keeps the whole qkv output alive.
    Flux2 double block, per token of either stream:
      bf16  qkv in D, qkv out 3D, SDPA q/k/v/out 4D, proj in D, mlp.0 in D,
            mlp.0 out 2M (gate|up), silu M, mlp.2 in M      = 10D + 4M
      fp32  norm1 and norm2 inputs                          =  2D
    Flux2 single block:
      bf16  linear1 in D, out 3D + 2M (SDPA's v is a view of it), SDPA q/k/out 3D,
            silu M, linear2 in D + M                        =  8D + 4M
      fp32  pre_norm input                                  =  1D
    Z-Image block (layers, noise_refiner, context_refiner):
      bf16  norm1 in D, qkv in D, qkv out 3D, SDPA 4D, out in D, norm2 in D,
            ffn_norm1 in D, w1 and w3 in 2D (a copy per branch), w1/w3/silu
            out 3M, w2 in M, ffn_norm2 in D                 = 15D + 4M
Without checkpointing every block keeps all of this; with per-block
checkpointing each block keeps only its input (D per token) and one block's
internals are rebuilt at a time in backward. The final layer adds 2D per image
token. Not counted: the RoPE table (shared), the rank-r LoRA hiddens, EMA (one
more LoRA copy). Fewer targets save up to ~1D per token per untargeted Linear;
mixed_precision "no" keeps the same tensors in fp32.

Checked on an H200 (torch 2.11, ComfyUI 0.17 models with random weights, Kiln's LoRA, AdamW, one
step): totals within -7%..+9% of peak reserved memory plus context for Klein 4B/9B and Z-Image at
512 and 1024 px, checkpointing on and off (low end: Z-Image without checkpointing, allocator slack).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .archs import get_arch
from .targets import TargetError, select_targets

GIB = 2 ** 30
CUDA_CONTEXT_BYTES = GIB       # context (~0.25 GiB on an H200, more beside a desktop) + slack
TEXT_TOKENS = 512
BASE_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
ACTIVATION_BYTES = {"bf16": 2, "no": 4}   # mixed_precision, as in TrainConfig


@dataclass(frozen=True)
class ModelDims:
    """Full-size architecture facts, as ComfyUI 0.17 builds the model (comfy/model_detection.py)."""

    variant: str
    arch: str                 # trainer.archs key: its default_targets apply
    family: str               # "flux2" | "zimage": picks the layer list and block model
    hidden: int               # D
    heads: int                # head dim 128 in all variants
    double_blocks: int        # Flux2 two-stream blocks; Z-Image 0
    single_blocks: int        # Flux2 single-stream blocks; Z-Image main `layers`
    mlp_ratio: float          # MLP hidden / D (both gated: Flux2 3.0, Z-Image 8/3)
    context_dim: int          # text feature width into txt_in / cap_embedder
    context_tokens: int       # text tokens per sample
    latent_downscale: int     # image pixels per latent cell
    latent_channels: int
    patch: int                # latent cells per token side
    refiner_blocks: int = 0   # Z-Image noise_refiner and context_refiner, each
    guidance_embed: bool = False  # Flux2 Dev's guidance_in

    @property
    def mlp_hidden(self) -> int:
        if self.family == "zimage":  # FeedForward: int(multiplier * dim), rounded up to a multiple of 256
            return -(-int(self.mlp_ratio * self.hidden) // 256) * 256
        return int(self.hidden * self.mlp_ratio)


def _flux2(variant, arch, hidden, double, single, context_dim, guidance=False):
    return ModelDims(variant, arch, "flux2", hidden, hidden // 128, double, single, 3.0, context_dim,
                     TEXT_TOKENS, 16, 128, 1, guidance_embed=guidance)


# Flux2: model_detection.py's flux2 branch (heads = hidden/128, mlp_ratio 3.0, global modulation, gated
# SiLU MLP, no biases; hidden from img_in, blocks counted). Z-Image: its `dim == 3840` branch (30 heads,
# ffn multiplier 8/3 -> 10240, z_image_modulation) and lumina/model.py NextDiT's 2 + 2 refiners.
VARIANTS: dict[str, ModelDims] = {
    "flux2-klein-4b": _flux2("flux2-klein-4b", "flux2_klein", 3072, 5, 20, 7680),
    "flux2-klein-9b": _flux2("flux2-klein-9b", "flux2_klein", 4096, 8, 24, 12288),
    "flux2-dev": _flux2("flux2-dev", "flux2_dev", 6144, 8, 48, 15360, guidance=True),
    "zimage": ModelDims("zimage", "zimage", "zimage", 3840, 30, 0, 30, 8.0 / 3.0, 2560, TEXT_TOKENS, 8, 16, 2,
                        refiner_blocks=2),  # Turbo and base share these dims
}


def get_dims(variant: str | ModelDims) -> ModelDims:
    """VARIANTS[variant]; a ModelDims passes through (for hypothetical sizes)."""
    if isinstance(variant, ModelDims):
        return variant
    try:
        return VARIANTS[variant]
    except KeyError:
        raise ValueError(f"unknown model variant {variant!r}; choose one of {list(VARIANTS)}") from None


def linear_layers(dims: ModelDims) -> dict[str, tuple[int, int]]:
    """Every Linear of the diffusion model: ComfyUI module path -> (in, out), in model order."""
    D, M, io = dims.hidden, dims.mlp_hidden, dims.latent_channels * dims.patch ** 2
    if dims.family == "zimage":
        return _zimage_layers(dims, D, M, io)
    layers = {"img_in": (io, D), "time_in.in_layer": (256, D), "time_in.out_layer": (D, D)}
    if dims.guidance_embed:
        layers.update({"guidance_in.in_layer": (256, D), "guidance_in.out_layer": (D, D)})
    layers["txt_in"] = (dims.context_dim, D)
    for i in range(dims.double_blocks):
        for stream in ("img", "txt"):
            p = f"double_blocks.{i}.{stream}"
            layers.update({f"{p}_attn.qkv": (D, 3 * D), f"{p}_attn.proj": (D, D),
                           f"{p}_mlp.0": (D, 2 * M), f"{p}_mlp.2": (M, D)})  # mlp.0: gate | up
    for i in range(dims.single_blocks):
        layers.update({f"single_blocks.{i}.linear1": (D, 3 * D + 2 * M),   # qkv | gate | up
                       f"single_blocks.{i}.linear2": (D + M, D)})          # attn | mlp -> D
    layers.update({"final_layer.linear": (D, io), "final_layer.adaLN_modulation.1": (D, 2 * D),
                   "double_stream_modulation_img.lin": (D, 6 * D), "double_stream_modulation_txt.lin": (D, 6 * D),
                   "single_stream_modulation.lin": (D, 3 * D)})
    return layers


def _zimage_layers(dims, D, F, io):
    def blocks(group, count, modulated):
        for i in range(count):
            p = f"{group}.{i}"
            yield from {f"{p}.attention.qkv": (D, 3 * D), f"{p}.attention.out": (D, D),
                        f"{p}.feed_forward.w1": (D, F), f"{p}.feed_forward.w2": (F, D),
                        f"{p}.feed_forward.w3": (D, F)}.items()
            if modulated:  # z_image_modulation: from the 256-wide t embedding, no SiLU
                yield f"{p}.adaLN_modulation.0", (256, 4 * D)

    # In ComfyUI's module order: the embedders sit between the refiners and the main layers.
    return {"x_embedder": (io, D),
            **dict(blocks("noise_refiner", dims.refiner_blocks, True)),
            **dict(blocks("context_refiner", dims.refiner_blocks, False)),
            "t_embedder.mlp.0": (256, 1024), "t_embedder.mlp.2": (1024, 256), "cap_embedder.1": (dims.context_dim, D),
            **dict(blocks("layers", dims.single_blocks, True)),
            "final_layer.linear": (D, io), "final_layer.adaLN_modulation.1": (256, D)}


def param_count(dims: ModelDims) -> int:
    """Linear weights + biases + norm scales + pad tokens (everything a checkpoint holds)."""
    layers = linear_layers(dims)
    total = sum(i * o for i, o in layers.values())
    head_dim = dims.hidden // dims.heads
    if dims.family == "flux2":  # no biases; QK RMSNorm scales: 2 per attention
        return total + head_dim * 2 * (2 * dims.double_blocks + dims.single_blocks)
    # Z-Image: biases on every Linear outside the blocks' attention and feed-forward
    total += sum(o for name, (i, o) in layers.items() if ".attention." not in name and ".feed_forward." not in name)
    blocks = 2 * dims.refiner_blocks + dims.single_blocks
    total += blocks * (4 * dims.hidden + 2 * head_dim)  # 4 RMSNorms + q/k norms per block
    return total + dims.context_dim + 2 * dims.hidden   # cap_embedder.0 RMSNorm, x/cap pad tokens


_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def variant_from_header(shapes: dict[str, list[int]]) -> str:
    """The VARIANTS key of a ComfyUI diffusion-model safetensors header (key -> shape)."""
    keys = {}
    for key, shape in shapes.items():
        if isinstance(shape, (list, tuple)):
            keys[next((key[len(p):] for p in _PREFIXES if key.startswith(p)), key)] = list(shape)
    if "double_stream_modulation_img.lin.weight" in keys and "img_in.weight" in keys:
        found = {"family": "flux2", "hidden": keys["img_in.weight"][0],
                 "double_blocks": _count(keys, "double_blocks."), "single_blocks": _count(keys, "single_blocks.")}
    elif "cap_embedder.1.weight" in keys and "noise_refiner.0.attention.qkv.weight" in keys:
        found = {"family": "zimage", "hidden": keys["cap_embedder.1.weight"][0],
                 "single_blocks": _count(keys, "layers.")}
    else:
        sample = sorted(keys)[:5]
        raise ValueError(f"not a Flux2 or Z-Image diffusion model (no double_stream_modulation_img.lin or "
                         f"cap_embedder.1 weight among {len(keys)} tensors, e.g. {sample}); "
                         f"known variants: {list(VARIANTS)}")
    for name, dims in VARIANTS.items():
        if all(getattr(dims, k) == v for k, v in found.items()):
            return name
    raise ValueError(f"{found['family']} model with {found} matches none of the known variants {list(VARIANTS)}")


def _count(keys, prefix: str) -> int:
    indices = {int(k[len(prefix):].split(".")[0]) for k in keys if k.startswith(prefix)}
    return max(indices) + 1 if indices else 0


def _lora_shapes(dims: ModelDims, targets) -> list[tuple[int, int]]:
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


def _blocks(dims: ModelDims, image_tokens: int, text_tokens: int, act: int) -> list[tuple[int, int, int]]:
    """(bytes kept per token inside one block, blocks, tokens each sees) per block list (docstring model)."""
    D, M, joint = dims.hidden, dims.mlp_hidden, image_tokens + text_tokens
    if dims.family == "flux2":
        return [((10 * D + 4 * M) * act + 2 * D * 4, dims.double_blocks, joint),  # fp32: norm1, norm2 inputs
                ((8 * D + 4 * M) * act + D * 4, dims.single_blocks, joint)]       # fp32: pre_norm input
    per_token = (15 * D + 4 * M) * act
    return [(per_token, dims.refiner_blocks, image_tokens), (per_token, dims.refiner_blocks, text_tokens),
            (per_token, dims.single_blocks, joint)]


def _check(dims: ModelDims, resolution, batch_size, rank, optimizer, base_dtype, mixed_precision) -> int:
    """Validate the settings; returns the pixels per token side."""
    for name, value, table in (("optimizer", optimizer, OPTIMIZER_STATE), ("base_dtype", base_dtype, BASE_DTYPE_BYTES),
                               ("mixed_precision", mixed_precision, ACTIVATION_BYTES)):
        if value not in table:
            raise ValueError(f"{name} must be one of {list(table)}, got {value!r}")
    side = dims.latent_downscale * dims.patch
    if resolution < side or resolution % side:
        raise ValueError(f"resolution must be a positive multiple of {side} px for {dims.variant}, got {resolution}")
    if batch_size < 1 or rank < 1:
        raise ValueError(f"batch_size and rank must be >= 1, got {batch_size} and {rank}")
    return side


def _image_tokens(dims: ModelDims, resolution: int, side: int) -> int:
    """Image tokens of a square bucket; Z-Image pads them to a multiple of 32 (pad_tokens_multiple)."""
    tokens = (resolution // side) ** 2
    return -(-tokens // 32) * 32 if dims.family == "zimage" else tokens


def _widest_output(dims: ModelDims) -> int:
    """Features of the widest block Linear output (Flux2's fused linear1, Z-Image's qkv)."""
    return 3 * dims.hidden + 2 * dims.mlp_hidden if dims.family == "flux2" else 3 * dims.hidden


BUDGET_KEPT = 0.6   # share of checkpointing's savings a compiled block keeps per unit of checkpoint_budget


def kept_by_last_blocks(groups: list[tuple[int, int]], skip: int) -> int:
    """Bytes the last `skip` blocks keep when they are not checkpointed (skip_checkpoint_blocks), from
    (bytes per block, blocks) groups in block order."""
    kept = 0
    for block_bytes, count in reversed(groups):
        take = min(count, skip)
        kept, skip = kept + take * block_bytes, skip - take
    return kept


def _activations(dims: ModelDims, image_tokens: int, text_tokens: int, act: int, checkpointing: bool,
                 skip: int = 0) -> int:
    D = dims.hidden
    groups = [group for group in _blocks(dims, image_tokens, text_tokens, act) if group[1]]
    head = 2 * D * act * image_tokens  # final layer: norm input and modulated output
    if not checkpointing:
        return sum(per_token * n * t for per_token, n, t in groups) + head
    boundaries = sum(n * t * D * act for _, n, t in groups)  # each block's input
    kept = kept_by_last_blocks([(per_token * t, n) for per_token, n, t in groups], skip)
    return boundaries + kept + max(per_token * t for per_token, _, t in groups) + head


def estimate(variant: str | ModelDims, *, resolution: int, batch_size: int = 1, rank: int = 32,
             targets: tuple[str, ...] | None = None, optimizer: str = "adamw",
             gradient_checkpointing: bool = True, base_dtype: str = "bf16", mixed_precision: str = "bf16",
             skip_checkpoint_blocks: int = 0, checkpoint_budget: float = 0.0) -> Estimate:
    """Bytes one training step needs at square `resolution` (the largest bucket)."""
    settings = {"variant": variant, "resolution": resolution, "batch_size": batch_size, "rank": rank,
                "targets": targets, "optimizer": optimizer, "gradient_checkpointing": gradient_checkpointing,
                "base_dtype": base_dtype, "mixed_precision": mixed_precision,
                "skip_checkpoint_blocks": skip_checkpoint_blocks, "checkpoint_budget": checkpoint_budget}
    dims = get_dims(variant)
    side = _check(dims, resolution, batch_size, rank, optimizer, base_dtype, mixed_precision)
    image_tokens = _image_tokens(dims, resolution, side)
    text_tokens, act = dims.context_tokens, ACTIVATION_BYTES[mixed_precision]
    tokens = batch_size * (image_tokens + text_tokens)
    shapes = _lora_shapes(dims, targets)
    lora_params = sum(rank * (i + o) for i, o in shapes)

    weights = param_count(dims) * BASE_DTYPE_BYTES[base_dtype]
    activations = batch_size * _activations(dims, image_tokens, text_tokens, act, gradient_checkpointing,
                                            skip_checkpoint_blocks)
    if gradient_checkpointing and checkpoint_budget > 0:
        # 0.6 x the budget's share of what checkpointing saves (eager): measured on an H100 (Z-Image
        # 1024 px, bench/RESULTS.md) compiled blocks kept 0.02-0.44 of it at budgets 0.1-0.8, under
        # 0.6 x budget each time (this estimate 3-14 % above those peaks).
        kept_all = batch_size * _activations(dims, image_tokens, text_tokens, act, False)
        activations += int(BUDGET_KEPT * checkpoint_budget * max(0, kept_all - activations))
    workspace = CUDA_CONTEXT_BYTES + 2 * _widest_output(dims) * tokens * act
    if base_dtype == "fp8":
        workspace += 2 * max(i * o for i, o in linear_layers(dims).values())
    optimizer_bytes = OPTIMIZER_STATE[optimizer](shapes, rank)
    notes = [f"{image_tokens} image + {text_tokens} text tokens per sample"
             + (" (512 caption tokens is an upper bound)" if dims.family == "zimage" else " (context padded to 512)"),
             "diffusion model only: text encoder and VAE cached or offloaded",
             "an estimate: measured peaks on an H200 fell within -7%..+9% of it"]
    if optimizer == "prodigy":
        notes.append("prodigy counted at 16 B/param; its p0 of the zero-initialised lora_B is a scalar (~14 B real)")
    total = weights + 8 * lora_params + optimizer_bytes + activations + workspace
    return Estimate(weights=weights, lora=4 * lora_params, gradients=4 * lora_params, optimizer=optimizer_bytes,
                    activations=activations, workspace=workspace, total=total, lora_params=lora_params,
                    tokens=tokens, notes=notes, settings=settings)


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


def _advice(settings: dict) -> list[tuple[str, dict]]:
    """Changes that lower GPU memory, cheapest in quality first."""
    return ordered_advice(settings, [
        ("optimizer adamw8bit (bitsandbytes)", {"optimizer": "adamw8bit"}, settings["optimizer"] in ("adamw", "prodigy")),
        ("base weights fp8", {"base_dtype": "fp8"}, settings["base_dtype"] != "fp8"),
        ("batch size 1 (raise grad_accum instead)", {"batch_size": 1}, settings["batch_size"] > 1)])


def backend_rules(backend: str):
    """(estimate, advice, usable GiB for a device of `memory_gb`, what the memory is) per backend."""
    if backend == "mlx":
        from .estimate_mlx import advice, estimate_mlx, mlx_budget_gib
        return (estimate_mlx, advice, mlx_budget_gib,
                lambda gb, usable: f"a {gb:g} GB Mac (MLX may use 95 % of its GPU working set: {usable:.1f} GiB)")
    return estimate, _advice, lambda gb: gb, lambda gb, usable: f"{gb:g} GiB"


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
    run, advice, usable, device = backend_rules(s.get("backend", "torch") if s else "torch")
    budget_gib = usable(device_memory_gb)
    where = device(device_memory_gb, budget_gib)
    budget = budget_gib * GIB
    if est.total <= budget:
        lines.append(f"fits in {where} ({(budget - est.total) / GIB:.1f} GiB to spare)")
        return "\n".join(lines)
    lines.append(f"does not fit in {where} (needs {est.total / GIB:.1f} GiB); try, in order:")
    changes: dict = {}
    arguments = {k: v for k, v in s.items() if k != "backend"} if s else {}
    for label, change in advice(s) if s else []:
        changes.update(change)
        total = run(**{**arguments, **changes}).total
        fits = total <= budget
        lines.append(f"  + {label}: {total / GIB:.1f} GiB" + (" (fits)" if fits else ""))
        if fits:
            break
    else:
        lines.append("  still too large: use a GPU with more memory or a smaller variant")
    return "\n".join(lines)
