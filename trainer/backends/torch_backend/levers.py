"""The speed levers a run gets by default: `compile_blocks` and `checkpoint_budget` set to "auto" are
decided here, once, at the start of a run, from the device and its free memory.

compile_blocks auto: on where torch.compile builds fast code for training (CUDA with Triton); off on
CPU, MPS (inductor has no fast backward there) and without Triton. A compile that fails at the first step
falls back to the eager blocks with one log line (backend.py), so "auto" never loses a run.

checkpoint_budget auto: the largest share of each block's activation memory the compiled blocks may keep
(bench/RESULTS.md: on an H100, Z-Image 1024 px went 0.381 → 0.350 → 0.294 s/step at budgets 0, 0.3, 0.8,
for 15.3 → 19.4 → 26.3 GiB) whose estimated step (trainer/estimate/torch_step.py, within −7…+9 % of measured peaks)
fits the memory free at the start, less a margin for validation sampling and the allocator. A model the
estimator does not know (the generic arch) gets 0: plain checkpointing, the memory-safe choice.

step_graphs auto: on for one process on a CUDA GPU where the small steps' CUDA graphs (step_graphs.py) and
their memory pool fit beside the largest step (H200: Klein 4B / Z-Image 512 px 0.074 / 0.132 → 0.048 /
0.071 s/step). fp8_compute auto: on for a base stored in fp8 (fp8_compute below).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from ...config import AUTO, TrainConfig
from . import full
from . import step_graphs as step_graphs_module

log = logging.getLogger("kiln")

GIB = 2**30
# Measured on an H200 (torch 2.11, ComfyUI 0.33, Klein 4B at 1024 px; runs/gpu_next.sh full, fulldiag, cachediag): an
# adapter run with compiled blocks after a full fine-tune's compiled run in the same process failed at its first step
# with "CUDA error: an illegal memory access" (3 of 3), which ends the process's CUDA context (ComfyUI must restart).
# The same run with eager blocks trained, as did the compiled run in a fresh process reading the full run's compile
# cache; at test size it did not fail. Until the cause is found, "auto" compiles no adapter run after a full one.
FULL_COMPILED_HERE: list[str] = []  # the device of each full fine-tune that compiled its blocks on CUDA here


@dataclass(frozen=True)
class Levers:
    compile: bool
    budget: float
    note: str = ""  # how "auto" decided, for the run's log ("" when nothing was auto)
    cuda_graphs: bool = False  # compiled blocks replayed as CUDA graphs (mode "reduce-overhead")
    step_graphs: bool = False  # each micro-batch's forward and backward replayed as a CUDA graph (step_graphs.py)


def can_compile(device: torch.device) -> bool:
    """Where compiled blocks pay: CUDA with a working Triton (inductor's GPU code generator)."""
    if device.type != "cuda":
        return False
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return has_triton()


def base_dtype(model: nn.Module) -> str:
    """The estimator's base_dtype of the loaded weights: fp8 storage (ComfyUI's fp8 files), int8 (base_quantize
    int8, installed before the levers are decided) or bf16."""
    fp8 = {getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)}
    dtypes = {p.dtype for p in model.parameters()}
    return "fp8" if dtypes & fp8 else "int8" if torch.int8 in dtypes else "bf16"


def clip_frames(cfg: TrainConfig) -> int:
    """The frames of the run's longest clip as the estimate counts them: the dataset's `frames` snapped down to the
    arch's 4k+1 for a video model (an image-only run is then over-counted: more streams, nothing fails); 1 else."""
    from ...archs import get_arch
    from ...data.frames import snap

    return snap(cfg.frames) if get_arch(cfg.arch).frames_per_latent > 1 else 1


def estimated_step_bytes(model: nn.Module, cfg: TrainConfig, budget: float, offload: bool | None = None) -> int | None:
    """What one training step adds to the resident weights at the largest bucket, by trainer/estimate/torch_step.py;
    None for a model it does not know. `offload`: with the kept block inputs on the host (default: the setting's
    explicit true). The plan is for a CUDA device: adamw8bit counts as the fp32 AdamW it falls back to where
    bitsandbytes cannot run there (optim.adamw8bit_fallback)."""
    from ...estimate.common import variant_from_header
    from ...estimate.torch_step import estimate
    from .optim import optimizer_that_runs

    try:
        variant = variant_from_header({name: list(t.shape) for name, t in model.state_dict().items()})
        est = estimate(
            variant,
            resolution=max(cfg.resolutions),
            batch_size=cfg.batch_size,
            rank=cfg.rank,
            targets=tuple(cfg.targets) or None,
            optimizer=optimizer_that_runs(cfg.optimizer, torch.device("cuda")),
            gradient_checkpointing=True,
            base_dtype=base_dtype(model),
            mixed_precision=cfg.mixed_precision,
            skip_checkpoint_blocks=cfg.skip_checkpoint_blocks,
            checkpoint_budget=budget,
            preservation=cfg.preservation_weight > 0,
            adapter=cfg.adapter,
            lokr_factor=cfg.lokr_factor,
            lokr_full_w2=cfg.lokr_full_w2,
            frames=clip_frames(cfg),
            offload_activations=cfg.offload_activations is True if offload is None else offload,
            **({"ema": cfg.ema, "shards": _shards(model)} if cfg.adapter == full.FULL else {}),  # a full run's state
        )
        # fp8_compute's copies are resident already (counted in `free`); edit training's reference tokens
        # are not known here (the data is not read): auto's margin covers the rest

    except (ValueError, KeyError):
        return None
    return est.total - est.weights


def _shards(model: nn.Module) -> int:
    """The ranks a sharded full run's weights are split over (1 where none is a DTensor)."""
    return max((p.device_mesh.size() for p in model.parameters() if hasattr(p, "device_mesh")), default=1)


def free_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the GPU now, counting memory torch's allocator holds but does not use. Under a
    cap on this process (torch.cuda.set_per_process_memory_fraction: a shared GPU, or a smaller card
    simulated) the cap is the total and what is left under it the most that is free: torch's allocator
    raises out of memory there, whatever the GPU has beyond it."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    free += torch.cuda.memory_reserved(device) - allocated
    index = device.index if device.index is not None else torch.cuda.current_device()  # torch 2.11 wants one
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _index: 1.0)(index)
    if fraction < 1.0:
        total = int(fraction * total)
        free = min(free, total - allocated)
    return free, total


def auto_budget(model: nn.Module, cfg: TrainConfig, device: torch.device, free_and_total=None) -> tuple[float, str]:
    """(budget, why) for checkpoint_budget auto."""
    from ...estimate.torch_step import auto_margin, largest_budget

    free, total = free_and_total or free_bytes(device)
    margin = auto_margin(total)
    if estimated_step_bytes(model, cfg, 0.0) is None:
        return 0.0, "0 (no memory estimate for this model)"
    budget = largest_budget(lambda b: estimated_step_bytes(model, cfg, b), free - margin)
    need = estimated_step_bytes(model, cfg, budget)
    return budget, (
        f"{budget:g} (a {max(cfg.resolutions)} px step needs ~{need / GIB:.1f} GiB beside the weights; "
        f"{free / GIB:.1f} GiB free, {margin / GIB:.1f} GiB kept back)"
    )


def fp8_compute(model: nn.Module, cfg: TrainConfig, device: torch.device) -> tuple[bool, str]:
    """(on, why) for fp8_compute. auto: on for a base stored in fp8 on a GPU with per-row fp8 matmuls (the
    forward multiplies the stored weight: no copy; on an H100 at 1024 px Flux2 Dev 1.219 → 1.093 s/step,
    Z-Image 0.279 → 0.228, Klein 4B 0.174 → 0.156, each in less memory than ComfyUI's cast per use); a bf16
    base would need fp8 copies of its weights (opt-in: true)."""
    if cfg.fp8_compute != AUTO:
        return bool(cfg.fp8_compute), ""
    if cfg.base_quantize == "int8":  # the int8 base multiplies in int8 instead (int8_base)
        return False, ""
    if cfg.backend != "torch" or cfg.mixed_precision != "bf16" or device.type != "cuda" or base_dtype(model) != "fp8":
        return False, "fp8_compute auto → off (needs a base stored in fp8 on a CUDA GPU, bf16 mixed precision)"
    from .fp8 import check_device

    try:
        check_device(device)
    except ValueError:
        return False, "fp8_compute auto → off (this GPU has no per-row fp8 matmul)"
    return True, "fp8_compute auto → on (the base is stored in fp8: its forward multiplies the stored weights)"


def fp8_stored_backward(
    model: nn.Module, cfg: TrainConfig, device: torch.device, copy_bytes: int, free_and_total=None
) -> tuple[bool, str]:
    """(on, why): under fp8_compute, whether a base stored in fp8 multiplies in fp8 backward too, through a
    transposed copy of its stored block weights (`copy_bytes`, their own size again). Yes where the copy costs
    the step nothing: the checkpoint budget it gets with the copy resident is the one it gets without (auto),
    or the set budget still fits. Measured on an H100 at 1024 px (bench/RESULTS.md): with the backward's bf16
    cast per use, Klein 4B's fp8 step was slower than ComfyUI's own cast (0.199 against 0.174 s/step); with
    the copy 0.156 (Z-Image 0.228, against 0.256 and 0.279), in less memory than ComfyUI's cast. Flux2 Dev's
    copy (30 GiB) does not fit beside its step on 80 GB, and it keeps the cast."""
    if not copy_bytes or device.type != "cuda":
        return False, ""
    from ...estimate.torch_step import AUTO_SAFETY, auto_margin, largest_budget

    free, total = free_and_total or free_bytes(device)
    margin = auto_margin(total)
    need = lambda budget: estimated_step_bytes(model, cfg, budget)
    copy = f"a transposed copy of the stored weights, {copy_bytes / GIB:.1f} GiB"
    if need(0.0) is None:
        return (
            False,
            f"its backward casts the stored weights to bf16 per use ({copy} without a memory estimate for this model)",
        )
    # the budget the step gets without the copy (auto: the largest that fits) must still fit beside it
    budget = largest_budget(need, free - margin) if cfg.checkpoint_budget == AUTO else float(cfg.checkpoint_budget)
    if AUTO_SAFETY * need(budget) <= free - copy_bytes - margin:
        return True, f"its backward in fp8 too ({copy})"
    return False, f"its backward casts the stored weights to bf16 per use ({copy} would cost checkpointing memory)"


# The arch's Triton-quantized Linears only where every bucket is this large: on an H100 (Klein 4B stored in
# fp8, one machine, bench/RESULTS.md) 1024 px steps ran 5 % faster with it, 768 and 512 px steps 21-33 % slower.
KERNEL_MIN_RESOLUTION = 1024


def fp8_base(
    model: nn.Module,
    cfg: TrainConfig,
    device: torch.device,
    blocks: list[nn.Module],
    quantize_kernel: tuple[str, ...] = (),
):
    """fp8_compute decided (fp8_compute, fp8_stored_backward) and installed on `blocks`: (the fp8.Fp8Base, or
    None when off; the log note). `quantize_kernel`: the arch's fact (Arch.fp8_quantize_kernel), taken where
    every bucket is at least KERNEL_MIN_RESOLUTION."""
    on, note = fp8_compute(model, cfg, device)
    if not on:
        return None, note
    from .fp8 import Fp8Base, stored_linears

    stored = sum(m.weight.numel() for m in stored_linears(blocks, device))  # e4m3: a byte each
    backward, why = fp8_stored_backward(model, cfg, device, stored)
    kernel = quantize_kernel if min(cfg.resolutions) >= KERNEL_MIN_RESOLUTION else ()
    return Fp8Base(blocks, device, stored_backward=backward, kernel=kernel), "; ".join(n for n in (note, why) if n)


def int8_base(cfg: TrainConfig, device: torch.device, blocks: list[nn.Module]):
    """base_quantize int8 installed on `blocks`: (the int8.Int8Base, or None when off; the log note)."""
    if cfg.base_quantize != "int8":
        return None, ""
    from .int8 import Int8Base

    note = "" if device.type in ("cuda", "cpu") else f" ({device.type} has no int8 matmul: dequantized per use)"
    return Int8Base(blocks, device), f"base_quantize int8: block Linears in int8 (W8A8){note}"


def step_graphs(
    model: nn.Module,
    cfg: TrainConfig,
    device: torch.device,
    budget: float,
    cuda_graphs: bool,
    parallel: bool,
    free_and_total=None,
    streaming: bool = False,
) -> tuple[bool, str]:
    """(on, why) for step_graphs. auto: on for one process on a CUDA GPU, where the graphs' memory pool (the
    largest recorded step's activations, times GRAPH_POOL_FACTOR) fits beside the largest eager step."""
    if cfg.step_graphs != AUTO and not cfg.step_graphs:
        return False, ""
    why_not = (
        "needs a CUDA GPU"
        if device.type != "cuda"
        else "not under torchrun"
        if parallel
        else "cuda_graphs records the blocks instead"
        if cuda_graphs
        else "blocks stream from host memory beside each step"
        if streaming
        else ""
    )
    if why_not:  # said only where asked for: auto off on a CPU or Mac is no news
        return False, f"step_graphs → off ({why_not})" if cfg.step_graphs is True else ""
    if cfg.step_graphs is True:
        return True, ""
    from ...estimate.torch_step import (
        AUTO_SAFETY,
        GRAPH_POOL_FACTOR,
        auto_margin,
        graph_resolution,
    )

    recorded = graph_resolution(cfg.resolutions, cfg.batch_size)
    if recorded is None:
        return False, "step_graphs auto → off (every bucket's step is large enough to keep the GPU busy)"
    need = estimated_step_bytes(model, cfg, budget)
    step = estimated_step_bytes(model, dataclasses.replace(cfg, resolutions=[recorded]), budget)
    if need is None or step is None:
        return False, "step_graphs auto → off (no memory estimate for this model)"
    pool = GRAPH_POOL_FACTOR * step
    free, total = free_and_total or free_bytes(device)
    if AUTO_SAFETY * (need + pool) > free - auto_margin(total):
        # a lower budget makes room only where there is one to lower (on a 12 GiB card Klein 4B is at 0 already)
        room = ": set checkpoint_budget lower to make room" if budget > 0 else ""
        return False, (
            f"step_graphs auto → off (their memory pool, ~{pool / GIB:.1f} GiB, would not fit beside "
            f"the largest step{room})"
        )
    return True, f"step_graphs auto → on (steps of up to {recorded}x{recorded} px, a pool of ~{pool / GIB:.1f} GiB)"


def decide(
    model: nn.Module,
    cfg: TrainConfig,
    device: torch.device,
    notes: tuple[str, ...] = (),
    blocks_write_norm_inputs: bool = False,
    parallel: bool = False,
    memory=None,
) -> Levers:
    """compile_blocks and checkpoint_budget for this run, with "auto" resolved; `notes` from earlier
    decisions (fp8_compute, the memory plan) lead the log line. `blocks_write_norm_inputs`: the arch's fact
    (trainer/archs). `memory`: the run's memory_plan.MemoryPlan, whose free memory the auto levers share."""
    after = memory.after if memory is not None else None
    streaming = bool(memory is not None and memory.stream)
    notes = [note for note in notes if note]
    why_not = "" if can_compile(device) else f" ({device.type}{' without Triton' if device.type == 'cuda' else ''})"
    if not why_not and blocks_write_norm_inputs and cfg.mixed_precision != "bf16":
        # (the failed attempt would cost a first step's compile: 12 s for Klein 4B in fp32 on an H100)
        why_not = (
            " (this model's blocks write into what their norms keep for backward: compiled, they trace only "
            "under mixed_precision bf16 on a CUDA GPU)"
        )
    if not why_not and device.type == "cuda" and cfg.adapter != full.FULL and FULL_COMPILED_HERE:
        why_not = (
            " (a full fine-tune compiled its blocks in this process, and compiled blocks after it failed on CUDA: "
            "restart ComfyUI, or run the full fine-tune headless, for compiled speed)"
        )
    compile = cfg.compile_blocks is True or (cfg.compile_blocks == AUTO and not why_not)
    if compile and device.type == "cuda" and cfg.adapter == full.FULL:
        FULL_COMPILED_HERE.append(str(device))
    if cfg.compile_blocks == AUTO:
        notes.append(f"compile_blocks auto → {'on' if compile else 'off'}" + ("" if compile else why_not))
    budget, offload = cfg.checkpoint_budget, memory is not None and memory.offload
    if budget == AUTO:
        if offload:
            budget, why = 0.0, "0 (offload_activations: each block recomputed whole from its input)"
        elif compile and cfg.gradient_checkpointing and device.type == "cuda":
            budget, why = auto_budget(model, cfg, device, after)
        else:
            budget, why = 0.0, "0 (needs compiled blocks with checkpointing on a GPU)"
        notes.append(f"checkpoint_budget auto → {why}")
    graphs = bool(cfg.cuda_graphs) and compile and device.type == "cuda" and not offload
    if cfg.cuda_graphs and not graphs:
        notes.append("cuda_graphs → off (needs compiled blocks on a CUDA GPU, kept inputs on it)")
    recorded, why = step_graphs(model, cfg, device, float(budget), graphs, parallel, after, streaming or offload)
    notes.append(why)
    return Levers(
        compile=compile,
        budget=float(budget),
        note="; ".join(n for n in notes if n),
        cuda_graphs=graphs,
        step_graphs=recorded and step_graphs_module.ENABLED,
    )


def quantized_base(model: nn.Module, cfg: TrainConfig, device: torch.device, blocks: list[nn.Module], kernel=()):
    """The frozen base's quantized forwards: int8 where base_quantize says so, else fp8_compute's (fp8_base)."""
    base, note = int8_base(cfg, device, blocks)
    return (base, note) if base is not None else fp8_base(model, cfg, device, blocks, kernel)
