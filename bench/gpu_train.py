"""GPU training benchmark (issue 6, items 1-3): Kiln's Train LoRA step against ComfyUI's native
TrainLoraNode, on full-size Z-Image / Flux2 Klein built with random weights by ComfyUI's own classes.

    COMFYUI_PATH=/path/to/ComfyUI python bench/gpu_train.py [--arch zimage,klein4b] [--res 1024] ...
    COMFYUI_PATH=/path/to/ComfyUI python bench/gpu_train.py --rows zimage:1024:1:on:default --out $OUT/r.json
    COMFYUI_PATH=/path/to/ComfyUI python bench/gpu_train.py --tiny   # tiny dims, 3 steps (CPU: fp32, ~35 s)
    COMFYUI_PATH=/path/to/ComfyUI python bench/gpu_train.py --adapter lora,lokr,loha,dora --no-native  # per kind

One process; per row it prints a summary line (stderr) and a JSON record (stdout) and appends the
record to `--out` (default bench/results.json, a JSON list, created if absent; written after every
row, so a run cut short keeps its rows). A record holds: date, commit (+ '-dirty' when the timed
code differs from it), device, torch, python, comfyui, arch, variant, resolution, batch, rank,
targets, checkpointing, compile, dtype, image/text tokens, params, the kiln_* and native_* figures
(s_per_step = median, p95, mean, steps timed, first/last loss, finiteness, forward rows, load or
setup seconds, peak_alloc_gb / peak_reserved_gb and alloc_at_start_gb), matmul_tflops,
model_tflop_per_step, mfu, native_mfu, speedup_vs_native (native s/step over Kiln's), lora_params.

Models. No weight files: the architecture's state-dict shapes come from a meta-device build of
ComfyUI's own class (comfy.ldm.flux.model.Flux / comfy.ldm.lumina.model.NextDiT) with the config
that ComfyUI's detection derives from a real file; the model config is then what
comfy.model_detection detects from those shapes (Z-Image below dim 3840 is not detected by ComfyUI,
so --tiny Z-Image uses supported_models.ZImage(unet_config), as tests/helpers/tiny_comfy.py does).
`model_config.get_model(device=...)` allocates the weights directly on the target device in bf16
(comfy.ops skips torch's init), then each parameter is filled in place on that device: matrices
N(0, 1/fan_in), norm scales N(1, 0.1^2), biases and pad tokens N(0, 0.02^2). The model is wrapped
in a plain comfy.model_patcher.ModelPatcher (a MODEL as a node receives it; not ComfyUI's dynamic-
VRAM patcher, which bridge.trainable() would swap for exactly this kind of patcher anyway). Its
offload device is the load device, so the harness's unloading between trainers (release(): the next
trainer's peak then counts only what it holds) never moves 12-18 GB to the CPU and back; untimed.

Inputs (synthetic "cached" latents and text embeddings, N(0,1) float32, seeded, one per image):
    Flux2     latent [B,128,H/16,W/16], context [B,512,context_dim] (Klein pads text to 512 tokens)
    Z-Image   latent [B,16,H/8,W/8],   context [B,L,2560], L = --zimage-tokens (default 256: a long
              caption; ComfyUI pads both image and caption tokens to a multiple of 32; 512 is the
              estimator's upper bound). Every image has its own caption embedding, all of length L.

Kiln (what is timed). The Train LoRA node's own path: bridge.trainable(model) ->
bridge.training_session(model, "auto") -> trainer.run.loop.train(cfg, module, data,
forward=bridge.make_forward(model, arch)) with the data as MappedLatents(InMemoryData, latents_in),
exactly as nodes/run.py builds it. Config: rank 32, alpha 32, the arch's default targets (or
`all` = every Linear, 're:.*'), AdamW (fused on CUDA), bf16 autocast with fp32 LoRA weights,
gradient checkpointing as the row says, lr 1e-4 constant, clipping 1.0, log_every 10 (a loss read
every 10 steps), caption dropout 0 (native has none), EMA off, no checkpoints until the end.
One step = the time between two consecutive on_step callbacks of the loop (each doing what the
node's does: a ProgressBar update, which checks the stop button, and the kiln.progress event, a
no-op without a server): lr, batch assembly (numpy stacking, noise/sigma draws, latent format),
pinned host->device copies, forward through ComfyUI's conds preparation and the model, loss,
backward, clipping, AdamW, EMA hook, report. Not timed: the session's load (`kiln_load_s`), LoRA
injection and optimizer setup, the final checkpoint written after the last step.

Native (what is timed). comfy_extras.nodes_train.TrainLoraNode.execute itself, called as ComfyUI
calls it (every input a list), on the same ModelPatcher with the same latents (one LATENT of B
images) and the same per-image embeddings (one CONDITIONING of B entries): batch_size B, rank 32,
AdamW (its own torch.optim.AdamW), MSE, training_dtype bf16, lora_dtype --native-lora-dtype
(default bf16, the node's default), algorithm LoRA, no offloading, no bucket mode, no bypass,
gradient_checkpointing as the row says with checkpoint_depth --native-ckpt-depth (default 2: every
block and embedder, as Kiln checkpoints each block; the node's own default 1 checkpoints the whole
diffusion model as ONE unit, so its backward recomputes everything at once and holds all
activations: no memory saved at the peak). It trains a LoRA on every Linear (the weight rebuilt as
W + up.down/rank on every use, alpha 1) and a full diff on every 1-D weight (norm scales) and bias.
One step = one iteration of TrainSampler.sample's loop: noise (CPU) and sigma draws, cond
selection, the guider's model call (ComfyUI's cond batching), loss, backward, loss.item(), grad
dtype cast, optimizer.step, zero_grad; measured at the node's per-iteration ProgressBar.update
(nodes_train.ProgressBar is swapped for a timing subclass during the call). Not timed: setup
(adapters, loading: `native_setup_s`) and teardown. Note: native hands every CONDITIONING entry
the whole batch (calc_cond_batch), so at batch B its model runs B*B rows per step
(`native_forward_rows` records what it ran); Kiln runs B.

Timing. Steps 1..--warmup are discarded; steps warmup+1..--steps are timed one by one. --timing events
(default): a CUDA event per boundary, read once at the end; no sync is added, so the host runs ahead
into the next step as it does in a user's run (Kiln's loop reads the loss every log_every steps), and
a step's time is the GPU timeline between two boundaries, any wait for the host included. --timing
sync: torch.cuda.synchronize() then perf_counter at each boundary; every step then also pays the
host's work before its first kernel (batch building, launches), which a real run overlaps with the
step before (Klein 4B at 1024 px: 0.186-0.189 s sync against 0.173-0.174 s events, RESULTS.md).
The native node reads its loss every step (a sync of its own) and the diffusers peer is timed the
same way as Kiln. Reported: median (`*_s_per_step`), p95, mean.
Memory: torch.cuda.max_memory_allocated / max_memory_reserved per trainer, reset (after
empty_cache) before each; in GiB (2^30 bytes). Includes the resident bf16 weights.
--card-gb G caps the process's allocator (set_per_process_memory_fraction) at G GiB less the CUDA
context, as on a card that size; Kiln's auto levers plan within the cap (levers.free_bytes).
Matmul rate: `--matmul-n`^3 matmuls in the run's dtype (8192 bf16 on CUDA) on the same device in the
same run: CUDA events around 50 back-to-back products after a warm-up, best of 3; TFLOPS = 2 n^3 / time.

Model FLOPs per step (the numerator of MFU; B = batch, per Linear its own token count T, i.e.
image tokens, text tokens, both, or 1 for modulation/timestep layers):
    linear      forward 2*in*out*T; backward 2*in*out*T (activation gradient only: base frozen; full: 4*in*out*T)
    LoRA        forward 2*r*(in+out)*T; backward 4*r*(in+out)*T (activation + weight gradients)
    attention   forward 4*L^2*D per attention layer (QK^T and AV; L its sequence, D = heads*128);
                backward 8*L^2*D
    recompute   with checkpointing, + the forward of everything inside the checkpointed blocks
    total       B * (forward + backward + recompute);   MFU = total / step time / matmul rate
Native's MFU uses the same model FLOPs with LoRA on every Linear (its weight rebuild is overhead).

Rows: the cartesian product of --arch x --res x --batch x --ckpt x --targets, or an explicit
--rows list "arch:res:batch:ckpt:targets,..." (e.g. "zimage:1024:1:on:default,zimage:512:4:on:all").
With none of these given: per arch 1024/b1, 512/b1, 512/b4 on default targets and 1024/b1 on all
linears, checkpointing on. --profile N adds N steps per Kiln run under torch.profiler after the
timed ones (bench/step_profile.py; `kiln_profile` in the record). --no-native skips the native side; --merge FILE... appends the records
of other result files (e.g. fetched from a GPU box) to --out and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import itertools
import json
import logging
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for _folder in (ROOT, ROOT / "tests", ROOT / "bench"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import gpu_ranks  # noqa: E402
import torch  # noqa: E402
from step_profile import StepProfiler  # noqa: E402

from trainer.archs import flux2, get_arch, qwen_image, wan, zimage  # noqa: E402
from trainer.archs.layout import ModelDims  # noqa: E402
from trainer.estimate.common import VARIANTS  # noqa: E402

GIB = 2**30
ARCH_VARIANTS = {
    "zimage": "zimage",
    "klein4b": "flux2-klein-4b",
    "klein9b": "flux2-klein-9b",
    "dev": "flux2-dev",
    "qwen": "qwen-image",
    "wan14b": "wan2.1-t2v-14b",
    "wan5b": "wan2.2-ti2v-5b",
    "wan1b": "wan2.1-t2v-1.3b",
}
# --tiny: the same classes at test size (head dim 128 as in the real models; Flux2 1+1 blocks because its
# 512 text tokens make every block costly on a CPU).
TINY = {
    "zimage": zimage.model_dims("zimage-tiny", hidden=256, layers=2, refiners=2, context_dim=64, context_tokens=32),
    "klein4b": flux2.model_dims(
        "flux2-klein-tiny", "flux2_klein", hidden=256, double_blocks=1, single_blocks=1, context_dim=192
    ),
}
TINY["klein9b"] = TINY["klein4b"]
TINY["qwen"] = qwen_image.model_dims("qwen-image-tiny", hidden=256, blocks=2, context_dim=64, context_tokens=32)
TINY["wan14b"] = TINY["wan1b"] = wan.model_dims("wan-tiny", "wan21_t2v", 256, 2, 256)
TINY["wan5b"] = wan.model_dims("wan-5b-tiny", "wan22_ti2v_5b", 256, 2, 256)
FLUX2_TEXT_TOKENS = 512
QWEN_TEXT_TOKENS = 256  # a long caption, as Z-Image's default (ComfyUI runs Qwen-Image's caption unpadded)
TIMED_CODE = ("trainer", "nodes", "headless.py", "__init__.py", "bench/gpu_train.py", "bench/gpu_ranks.py")


# ---------------------------------------------------------------- setup


def prepare_comfy(device: str):
    """ComfyUI on sys.path, on the GPU unless device is cpu (tests/helpers/comfy_env.py; read once)."""
    from helpers import comfy_env

    path = comfy_env.comfy_path()
    if path is None:
        raise SystemExit("set COMFYUI_PATH to a ComfyUI 0.17+ checkout (ComfyUI is used as a library, never copied)")
    os.environ["KILN_COMFY_GPU"] = "0" if device == "cpu" else "1"
    comfy_env.prepare(path)
    return comfy_env


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Step boundaries: perf_counter after a synchronize ('sync'), or CUDA events read at the end."""

    def __init__(self, device: torch.device, mode: str):
        self.device, self.events = device, mode == "events" and device.type == "cuda"
        self.marks: list = []
        self.first_mark: float | None = None  # perf_counter at the end of step 1 (after a sync)

    def mark(self) -> None:
        if self.first_mark is None:
            sync(self.device)
            self.first_mark = time.perf_counter()
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            sync(self.device)
            self.marks.append(time.perf_counter())

    def durations(self) -> list[float]:
        """Seconds per step: durations()[k] is step k+1 (the first mark is the end of step 1)."""
        if self.events:
            sync(self.device)
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


def timed_stats(durations: list[float], warmup: int) -> dict:
    """Median / p95 / mean of steps warmup+1.. (durations[0] is step 2: step 1 has no start mark)."""
    kept = durations[max(0, warmup - 1) :]
    if not kept:
        return {"median": None, "p95": None, "mean": None, "n": 0}
    ordered = sorted(kept)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    return {"median": statistics.median(kept), "p95": p95, "mean": statistics.fmean(kept), "n": len(kept)}


def release(device: torch.device) -> None:
    """Harness hygiene between trainers (never timed): ComfyUI forgets every loaded patcher (the native
    node's clone with its adapters included; weights stay put, the offload device is the GPU), then
    garbage and cached blocks go, so the next trainer's peak counts only what it holds."""
    import comfy.model_management as mm

    mm.unload_all_models()
    mm.cleanup_models_gc()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def peak_memory(device: torch.device, out: dict, prefix: str):
    """Peak allocated / reserved GiB of the block (None off CUDA), reset after empty_cache; also what was
    allocated when it began (the resident weights)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        out[f"{prefix}alloc_at_start_gb"] = round(torch.cuda.memory_allocated(device) / GIB, 3)
    try:
        yield
    finally:
        if device.type == "cuda":
            out[f"{prefix}peak_alloc_gb"] = round(torch.cuda.max_memory_allocated(device) / GIB, 3)
            out[f"{prefix}peak_reserved_gb"] = round(torch.cuda.max_memory_reserved(device) / GIB, 3)
        else:
            out[f"{prefix}peak_alloc_gb"] = out[f"{prefix}peak_reserved_gb"] = None


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, iters: int = 50) -> float:
    """Measured dense matmul rate (TFLOPS) of n x n x n products in `dtype` on `device`."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    for _ in range(5):
        c = a @ b
    sync(device)
    best = math.inf
    for _ in range(3):  # best of 3 runs of `iters` back-to-back products
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                c = a @ b
            end.record()
            sync(device)
            seconds = start.elapsed_time(end) / 1e3
        else:
            started = time.perf_counter()
            for _ in range(iters):
                c = a @ b
            seconds = time.perf_counter() - started
        best = min(best, seconds)
    del c
    return 2 * n**3 * iters / best / 1e12


def git_commit() -> str:
    """HEAD, + '-dirty' when the code that runs here differs from it (TIMED_CODE: changed or untracked);
    KILN_COMMIT where the copy has no .git (a device box)."""
    if os.environ.get("KILN_COMMIT"):
        return os.environ["KILN_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *TIMED_CODE], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


# ---------------------------------------------------------------- the model


def family_of(dims: ModelDims) -> str:
    """The arch family ("flux2", "zimage") of the model these dims describe: which ComfyUI class builds it."""
    return get_arch(dims.arch).family


def unet_config(dims: ModelDims) -> dict:
    """The unet_config ComfyUI 0.17's detection derives from a real file of these dims
    (comfy/model_detection.py: the flux2 branch, and the lumina2 dim-3840 branch for Z-Image)."""
    heads = dims.hidden // 128
    if family_of(dims) == "flux2":
        return dict(
            image_model="flux2",
            axes_dim=[32, 32, 32, 32],
            num_heads=heads,
            mlp_ratio=3.0,
            theta=2000,
            out_channels=128,
            global_modulation=True,
            mlp_silu_act=True,
            qkv_bias=False,
            ops_bias=False,
            default_ref_method="index",
            ref_index_scale=10.0,
            txt_ids_dims=[3],
            patch_size=1,
            in_channels=128,
            hidden_size=dims.hidden,
            context_in_dim=dims.context_dim,
            vec_in_dim=None,
            depth=dims.double_blocks,
            depth_single_blocks=dims.single_blocks,
            guidance_embed=dims.guidance_embed,
            yak_mlp=False,
            txt_norm=False,
        )
    return dict(
        image_model="lumina2",
        patch_size=2,
        in_channels=16,
        dim=dims.hidden,
        cap_feat_dim=dims.context_dim,
        n_layers=dims.single_blocks,
        n_refiner_layers=dims.refiner_blocks,
        qk_norm=True,
        n_heads=heads,
        n_kv_heads=heads,
        axes_dims=[32, 48, 48],
        axes_lens=[1536, 512, 512],
        rope_theta=256.0,
        ffn_dim_multiplier=8.0 / 3.0,
        z_image_modulation=True,
        time_scale=1000.0,
        pad_tokens_multiple=32,
    )


def qwen_config(dims: ModelDims) -> dict:
    """The unet_config ComfyUI's detection derives from a Qwen-Image file of these dims (the qwen_image branch:
    in_channels from img_in, transformer_blocks counted) with the class's own defaults for the rest."""
    return dict(
        image_model="qwen_image",
        in_channels=64,
        out_channels=16,
        num_layers=dims.double_blocks,
        attention_head_dim=128,
        num_attention_heads=dims.heads,
        joint_attention_dim=dims.context_dim,
    )


def wan_config(dims: ModelDims) -> dict:
    """The unet_config ComfyUI's detection derives from a Wan file (model_detection.py's wan2.1 branch: dim, ffn_dim,
    blocks, in/out channels read off the file; text-to-video: no img_emb). Wan 2.2 TI2V 5B: 48 channels."""
    channels = get_arch(dims.arch).latent_channels
    return dict(
        image_model="wan2.1",
        model_type="t2v",
        dim=dims.hidden,
        out_dim=channels,
        in_dim=channels,
        num_heads=dims.hidden // 128,
        ffn_dim=dims.mlp_hidden,
        num_layers=dims.single_blocks,
        patch_size=(1, 2, 2),
        freq_dim=256,
        window_size=(-1, -1),
        qk_norm=True,
        cross_attn_norm=True,
        eps=1e-6,
    )


# family → (ComfyUI module and class of the diffusion model, comfy.supported_models class: None = the arch's)
MODEL_CLASSES = {
    "flux2": ("comfy.ldm.flux.model", "Flux", "Flux2"),
    "zimage": ("comfy.ldm.lumina.model", "NextDiT", "ZImage"),
    "qwen_image": ("comfy.ldm.qwen_image.model", "QwenImageTransformer2DModel", "QwenImage"),
    "wan": ("comfy.ldm.wan.model", "WanModel", None),
}
CONFIGS = {"qwen_image": qwen_config, "wan": wan_config}  # the rest: unet_config


def _model_class(family: str):
    import importlib

    module, name, _ = MODEL_CLASSES[family]
    return getattr(importlib.import_module(module), name)


def model_config_for(dims: ModelDims):
    """(ComfyUI model config, how it was obtained): detected from the shapes like a real file, else by hand."""
    import comfy.model_detection
    import comfy.ops
    import comfy.supported_models

    family = family_of(dims)
    config = CONFIGS.get(family, unet_config)(dims)
    cls = _model_class(family)
    with torch.device("meta"):
        shapes = cls(**config, operations=comfy.ops.disable_weight_init).state_dict()
    wanted = getattr(comfy.supported_models, MODEL_CLASSES[family][2] or get_arch(dims.arch).comfy.config_class)
    detected = comfy.model_detection.model_config_from_unet(shapes, "")
    if type(detected) is wanted and _same_shapes(cls, detected.unet_config, shapes):
        return detected, "comfy.model_detection (shapes of a meta-device build)"
    return wanted(dict(config)), f"supported_models.{wanted.__name__}(unet_config) (ComfyUI detects no {dims.variant})"


@torch.no_grad()
def fill_random_(module: torch.nn.Module, seed: int) -> None:
    """In place: matrices N(0, 1/fan_in), norm scales N(1, 0.01), the rest N(0, 4e-4). Drawn on the GPU when
    there is one, also for a model built in host memory (copied down: drawing 20-32B values on the host's
    CPU took minutes), so a host-built model has the very weights of the GPU-built one."""
    generator = draw = None
    for name, param in sorted(module.named_parameters()):
        if generator is None:
            cuda = torch.cuda.is_available()
            draw = torch.device("cuda", torch.cuda.current_device()) if cuda else param.device
            generator = torch.Generator(device=draw).manual_seed(seed)
        # Drawn in bf16 for fp8 storage (no normal_ for float8): an fp8 model is the bf16 one rounded.
        same = param.dtype.itemsize > 1 and param.device == draw
        target = param if same else torch.empty_like(param, dtype=_drawn_dtype(param), device=draw)
        if param.ndim >= 2 and not name.endswith("pad_token"):
            target.normal_(0.0, 1.0 / math.sqrt(math.prod(param.shape[1:])), generator=generator)
        elif "norm" in name or name.endswith(".scale"):
            target.normal_(1.0, 0.1, generator=generator)
        else:
            target.normal_(0.0, 0.02, generator=generator)
        if target is not param:
            param.copy_(target)


def _drawn_dtype(param: torch.Tensor) -> torch.dtype:
    return param.dtype if param.dtype.itemsize > 1 else torch.bfloat16


def build_model(
    dims: ModelDims, device: torch.device, dtype: torch.dtype, seed: int = 0, base: str = "bf16", host: bool = False
):
    """A ComfyUI MODEL (ModelPatcher) of this architecture with random weights on `device`. base "fp8":
    stored as Load Diffusion Model's weight_dtype fp8_e4m3fn stores it (manual cast to `dtype` on each
    use; without comfy_kitchen no fp8 matmul), the same random values rounded to fp8."""
    started = time.perf_counter()
    patcher, source = _build_patcher(dims, device, dtype, seed, base, host)
    dm = patcher.model.diffusion_model
    params = sum(p.numel() for p in dm.parameters())
    # A quantized weight (comfy-kitchen QuantizedTensor) reports its logical dtype; its bytes are in _qdata.
    stored = [getattr(p, "_qdata", p) for p in dm.parameters()]
    weight_gb = sum(t.numel() * t.element_size() for t in stored) / GIB
    return patcher, {
        "model_config": source,
        "params": params,
        "weights_gb": round(weight_gb, 3),
        "build_s": round(time.perf_counter() - started, 2),
    }


REBUILT: list = []  # callbacks told of every diffusion model _build_patcher makes for a deep clone


def _build_patcher(dims: ModelDims, device: torch.device, dtype: torch.dtype, seed: int, base: str, host: bool = False):
    """(ModelPatcher, how its config was obtained). Like ComfyUI's own loaders it registers how to build
    it again (`cached_patcher_init`): from ComfyUI 0.25 on, `clone(force_deepcopy=True)` rebuilds the model
    through it, and the native Train LoRA node deep-clones its input that way (0.33). The rebuilt copy has
    the same seeded weights; REBUILT's callbacks see it (the native row counts its forward rows there)."""
    import comfy.model_patcher

    model_config, source = model_config_for(dims)
    if base == "fp8":
        model_config.set_inference_dtype(torch.float8_e4m3fn, dtype)
    else:
        model_config.set_inference_dtype(dtype, None)
    # host: built in host memory and loaded onto the GPU by the session, as ComfyUI's loaders leave a model
    where = torch.device("cpu") if host else device
    model = model_config.get_model({}, "", device=where)
    model.to(where)  # anything a class created off-device (no-op for Flux2 / NextDiT)
    fill_random_(model.diffusion_model, seed)
    if base == "fp8q":
        model = _quantized_copy(model, dims, dtype)
    sync(device)
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=where)
    if hasattr(patcher, "cached_patcher_init"):
        patcher.cached_patcher_init = (functools.partial(_rebuild, host=host), (dims, device, dtype, seed, base))
    return patcher, source


def _quantized_copy(model, dims: ModelDims, dtype: torch.dtype):
    """base "fp8q": the model as ComfyUI loads its own quantized checkpoints (Comfy-Org's fp8 files): every
    block Linear's weight float8_e4m3fn with a per-tensor `weight_scale` and a `comfy_quant` format tag, so
    ComfyUI builds them as its mixed-precision Linear (comfy-kitchen QuantizedTensor weights; fp8 matmuls
    where the GPU has them, and from 0.19 an FP8 backward when training_fp8_bwd is set). Same random
    values, quantized; embedders, modulation and the final layer stay in `dtype`."""
    import json

    import comfy.model_management as mm

    blocks = tuple(
        f"{name}."
        for name in (
            "double_blocks",
            "single_blocks",
            "layers",
            "noise_refiner",
            "context_refiner",
            "transformer_blocks",
        )
    )
    tag = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
    sd = {}
    for key, value in model.diffusion_model.state_dict().items():
        if key.startswith(blocks) and key.endswith(".weight") and value.ndim == 2:
            layer = key.removesuffix(".weight")
            scale = value.float().abs().amax() / torch.finfo(torch.float8_e4m3fn).max
            sd[key] = (value.float() / scale).to(torch.float8_e4m3fn)
            sd[f"{layer}.weight_scale"], sd[f"{layer}.comfy_quant"] = scale.reshape(()), tag.clone()
        else:
            sd[key] = value
    device = next(model.diffusion_model.parameters()).device
    del model
    mm.soft_empty_cache()
    model_config, _ = model_config_for(dims)
    model_config.quant_config = {"mixed_ops": True}  # what comfy.utils.detect_layer_quantization answers
    model_config.set_inference_dtype(dtype, dtype)  # the compute dtype the quantized layers cast to
    quantized = model_config.get_model(sd, "", device=device)
    quantized.load_model_weights(sd, "")
    quantized.to(device)
    return quantized


def _rebuild(dims, device, dtype, seed, base, disable_dynamic=False, host=False):
    patcher, _ = _build_patcher(dims, device, dtype, seed, base, host)
    for callback in REBUILT:
        callback(patcher.model.diffusion_model)
    return patcher


# ---------------------------------------------------------------- FLOPs


def _same_shapes(cls, config: dict, shapes: dict) -> bool:
    """Whether the detected config builds these very shapes (Qwen-Image's detection reads only in_channels and
    the block count: a tiny one is detected as the full-width class defaults)."""
    import comfy.ops

    with torch.device("meta"):
        built = cls(**config, operations=comfy.ops.disable_weight_init).state_dict()
    return {k: v.shape for k, v in built.items()} == {k: v.shape for k, v in shapes.items()}


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def token_counts(
    dims: ModelDims, resolution: int, text_tokens: int, size: tuple[int, int] | None = None, frames: int = 1
) -> tuple[int, int]:
    """(image tokens, text tokens) per sample, as the model runs them (Z-Image pads both to 32); `size` (height,
    width) for a frame other than resolution², `frames` a clip's (4k+1: k+1 latent frames)."""
    arch = get_arch(dims.arch)
    height, width = size or (resolution, resolution)
    per = arch.latent_downscale * arch.patch
    latent_frames = 1 + (frames - 1) // arch.frames_per_latent
    multiple = arch.layout.token_multiple
    return _pad(latent_frames * (height // per) * (width // per), multiple), _pad(text_tokens, multiple)


def _linear_tokens(family: str, name: str, img: int, txt: int) -> int:
    parts = name.split(".")
    if family == "wan" and _wan_tokens(name, img, txt) is not None:
        return _wan_tokens(name, img, txt)
    if family == "qwen_image":
        if parts[0] == "transformer_blocks":
            if parts[2] in ("img_mod", "txt_mod"):
                return 1
            text = parts[2].startswith("txt_") or parts[3] in ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
            return txt if text else img
        table = {"img_in": img, "proj_out": img, "txt_in": txt}
        if name in table:
            return table[name]
        if parts[0] in ("time_text_embed", "norm_out"):
            return 1
    elif family == "flux2":
        if parts[0] == "double_blocks":
            return img if parts[2].startswith("img_") else txt
        if parts[0] == "single_blocks":
            return img + txt
        table = {"img_in": img, "final_layer.linear": img, "txt_in": txt}
        if name in table:
            return table[name]
        if parts[0] in ("time_in", "guidance_in", "vector_in") or "modulation" in name:
            return 1
    else:
        if "adaLN_modulation" in name or parts[0] == "t_embedder":
            return 1
        if parts[0] == "noise_refiner" or name in ("x_embedder", "final_layer.linear"):
            return img
        if parts[0] in ("context_refiner", "cap_embedder"):
            return txt
        if parts[0] == "layers":
            return img + txt
    raise ValueError(f"no token count for Linear {name!r}: extend _linear_tokens")


def _wan_tokens(name: str, img: int, txt: int) -> int | None:
    """Wan: a block's attention and MLP run the video's tokens, its cross-attention keys/values the caption's."""
    parts = name.split(".")
    if parts[0] == "blocks":
        return txt if parts[2] == "cross_attn" and parts[3] in ("k", "v") else img
    return {"text_embedding": txt, "time_embedding": 1, "time_projection": 1, "head": img}.get(parts[0])


def _attention_layers(dims: ModelDims, img: int, txt: int) -> list[tuple[str, int, int, int]]:
    """(block list, block index, query length, key length) per attention layer."""
    if family_of(dims) == "wan":  # self-attention over the video, cross-attention to the caption
        return [("blocks", i, img, keys) for i in range(dims.single_blocks) for keys in (img, txt)]
    both = img + txt
    if family_of(dims) == "qwen_image":
        groups = [("transformer_blocks", dims.double_blocks, both)]
    elif family_of(dims) == "flux2":
        groups = [("double_blocks", dims.double_blocks, both), ("single_blocks", dims.single_blocks, both)]
    else:
        groups = [
            ("noise_refiner", dims.refiner_blocks, img),
            ("context_refiner", dims.refiner_blocks, txt),
            ("layers", dims.single_blocks, both),
        ]
    return [(name, i, length, length) for name, count, length in groups for i in range(count)]


def recomputed_blocks(
    dm: torch.nn.Module, block_lists: tuple[str, ...], checkpointing: bool, skip: int = 0
) -> set[str]:
    """'<list>.<index>' of the blocks whose forward runs again in backward (the backends' own plan)."""
    from trainer.backends.base import checkpointed

    names = [f"{name}.{index}" for name in block_lists for index in range(len(getattr(dm, name)))]
    return {name for name, again in zip(names, checkpointed(len(names), checkpointing, skip)) if again}


def model_flops(
    dm: torch.nn.Module,
    dims: ModelDims,
    *,
    img: int,
    txt: int,
    batch: int,
    rank: int,
    lora_paths: list[str],
    block_lists: tuple[str, ...],
    checkpointing: bool,
    skip: int = 0,
    attention_saved: bool = False,
    budgeted: bool = False,
    full: bool = False,
) -> dict:
    """Model FLOPs of one training step (module docstring), from the built model's own Linear shapes.
    Recompute counts the blocks that are checkpointed (all but `skip`), without attention when its
    outputs are kept (selective checkpointing); with a checkpoint_budget (`budgeted`) the compiler
    chooses what to recompute, and none is counted (MFU then a lower bound)."""
    lora = set(lora_paths)
    again = set() if budgeted else recomputed_blocks(dm, block_lists, checkpointing, skip)
    fwd = bwd = recompute = 0
    # The Linears Kiln's LoRA sees (ComfyUI's quantized mixed-precision Linear included: no nn.Linear)
    from trainer.backends.torch_backend.lora import linear_layers

    for name, module in linear_layers(dm).items():
        tokens = _linear_tokens(family_of(dims), name, img, txt)
        base = 2 * module.in_features * module.out_features * tokens
        low_rank = 2 * rank * (module.in_features + module.out_features) * tokens if name in lora else 0
        fwd += base + low_rank
        bwd += base * (2 if full else 1) + 2 * low_rank  # adapter full: the weight's gradient too
        if ".".join(name.split(".")[:2]) in again:
            recompute += base + low_rank
    attention = 0
    for block_list, index, queries, keys in _attention_layers(dims, img, txt):
        flops = 4 * queries * keys * dims.hidden
        attention += flops
        fwd += flops
        bwd += 2 * flops
        if f"{block_list}.{index}" in again and not attention_saved:
            recompute += flops
    return {"total": batch * (fwd + bwd + recompute), "forward": batch * fwd, "attention_forward": batch * attention}


# ---------------------------------------------------------------- inputs


@dataclass
class Inputs:
    latents: list[np.ndarray]  # raw VAE latents [C,h,w] float32, one per image
    contexts: list[np.ndarray]  # text embeddings [T,D] float32, one per image
    img_tokens: int
    txt_tokens: int


def make_inputs(
    dims: ModelDims,
    resolution: int,
    batch: int,
    text_tokens: int,
    seed: int = 0,
    size: tuple[int, int] | None = None,
    frames: int = 1,
) -> Inputs:
    """Latents [C, h, w] per image, [C, t, h, w] per clip for a video model (t = 1 for an image); `size` (height,
    width) for a frame other than resolution²."""
    arch = get_arch(dims.arch)
    down = arch.latent_downscale
    height, width = size or (resolution, resolution)
    if height % (down * arch.patch) or width % (down * arch.patch):
        raise ValueError(f"{height}x{width} is not a multiple of {down * arch.patch} px for {dims.variant}")
    rng = np.random.default_rng([seed, resolution, batch] + ([height, width, frames] if size or frames > 1 else []))
    shape = (arch.latent_channels, height // down, width // down)
    if arch.frames_per_latent > 1:
        shape = (shape[0], 1 + (frames - 1) // arch.frames_per_latent, *shape[1:])
    latents = [rng.standard_normal(shape).astype(np.float32) for _ in range(batch)]
    contexts = [rng.standard_normal((text_tokens, dims.context_dim)).astype(np.float32) for _ in range(batch)]
    img, txt = token_counts(dims, resolution, text_tokens, size, frames)
    return Inputs(latents, contexts, img, txt)


class RowCounter:
    """Rows (batch entries) the diffusion model runs per forward call, via forward pre-hooks (on the
    model given, and on any other watched later: the copy a deep clone rebuilds)."""

    def __init__(self, module: torch.nn.Module):
        self.rows: list[int] = []
        self.handles: list = []
        self.watch(module)

    def watch(self, module: torch.nn.Module) -> None:
        self.handles.append(module.register_forward_pre_hook(lambda _m, args: self.rows.append(int(args[0].shape[0]))))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# ---------------------------------------------------------------- Kiln


class LeverNotes(logging.Handler):
    """Collects the "[Kiln] ..." lines of the `kiln` logger during a row: the levers the backend chose."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.logger = logging.getLogger("kiln")
        self.level_before = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)

    def emit(self, record):
        self.lines.append(record.getMessage())

    def remove(self):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)

    def levers(self, cfg) -> dict:
        """kiln_compiled, kiln_budget: the config's values, or what "auto" became (from the log line)."""
        text = " ".join(self.lines)
        compiled = cfg.compile_blocks if cfg.compile_blocks != "auto" else "compile_blocks auto → on" in text
        found = re.search(r"checkpoint_budget auto → ([0-9.]+)", text)
        budget = cfg.checkpoint_budget if cfg.checkpoint_budget != "auto" else float(found.group(1)) if found else 0.0
        if "compile failed" in text:
            compiled, budget = False, 0.0
        fp8 = cfg.fp8_compute if cfg.fp8_compute != "auto" else "fp8_compute auto → on" in text
        return {
            "kiln_compiled": bool(compiled),
            "kiln_budget": float(budget),
            "kiln_fp8_compute": bool(fp8),
            # an fp8-stored base's backward in fp8 through a transposed copy (levers.fp8_stored_backward)
            "kiln_fp8_stored_backward": "its backward in fp8 too" in text,
            "kiln_cuda_graphs": bool(cfg.cuda_graphs) and bool(compiled),
            # step graphs: what auto (or the setting) chose, and whether a recording failed mid-run
            "kiln_step_graphs": ("step_graphs auto → on" in text or cfg.step_graphs is True)
            and "could not be recorded" not in text,
            "kiln_levers_note": text,
        }


class BenchCompanions:
    """Bench only: what issue 21's techniques read from a dataset, for synthetic inputs. Row settings
    `bench_dop=on` (DOP's class-word captions: each caption reversed, the same length; preservation_weight 1),
    `bench_mask=on` (a mask over the left half of each latent), `bench_controls=N` (N reference latents per
    image, each the image's own latent: edit training's extra tokens); `bench_images=N` (run_row: N images,
    e.g. for a held-out split)."""

    def __init__(self, data, inputs: Inputs, dop: bool, mask: bool, controls: int):
        self.data, self.inputs, self.dop, self.with_mask, self.count = data, inputs, dop, mask, controls

    @classmethod
    def wrap(cls, data, inputs: Inputs, settings: dict):
        dop, mask = settings.pop("bench_dop", False), settings.pop("bench_mask", False)
        controls = int(settings.pop("bench_controls", 0))
        if dop:
            settings.update(preservation_weight=1.0, preservation_class="person", trigger_word="ohwx")
        return cls(data, inputs, bool(dop), bool(mask), controls) if dop or mask or controls else data

    def __getattr__(self, name):
        return getattr(self.data, name)

    def preservation_context(self, index: int, variant: int = 0):
        return self.inputs.contexts[index][::-1].copy() if self.dop else None

    def mask(self, index: int):
        if not self.with_mask:
            return None
        height, width = self.inputs.latents[index].shape[-2:]
        weights = np.zeros((1, height, width), np.float32)
        weights[..., : width // 2] = 1.0
        return weights

    def controls(self, index: int) -> list:
        return [self.inputs.latents[index].copy() for _ in range(self.count)]


def run_kiln(
    pack,
    patcher,
    dims: ModelDims,
    inputs: Inputs,
    *,
    batch: int,
    targets: str,
    checkpointing: bool,
    resolution: int = 1024,
    steps: int,
    warmup: int,
    timing: str,
    device: torch.device,
    dtype: str,
    settings: dict | None = None,
    profile_steps: int = 0,
    quantized_matmul: bool = False,
) -> dict:
    bridge, config, loop, data_module = pack["bridge"], pack["config"], pack["loop"], pack["data"]
    out: dict = {}
    model = bridge.trainable(patcher)
    arch_name = dims.arch
    detected = bridge.detect_arch(model)
    if detected != arch_name:
        raise RuntimeError(f"bridge.detect_arch says {detected!r} for the {dims.variant} model, expected {arch_name!r}")
    data = data_module.MappedLatents(
        data_module.InMemoryData.from_arrays(
            inputs.latents,
            inputs.contexts,
            [f"img{i}.png" for i in range(len(inputs.latents))],
            np.zeros_like(inputs.contexts[0]),
        ),
        lambda raw: bridge.item_latent_in(model, raw),
    )
    settings = dict(settings or {})
    data = BenchCompanions.wrap(data, inputs, settings)
    cfg = config.from_dict(
        {
            **dict(
                arch=arch_name,
                device="auto",
                mixed_precision="bf16" if dtype == "bf16" else "no",
                rank=32,
                alpha=32.0,
                targets=["re:.*"] if targets == "all" else [],
                optimizer="adamw",
                learning_rate=1e-4,
                steps=steps + profile_steps,
                batch_size=batch,
                gradient_checkpointing=checkpointing,
                caption_dropout=0.0,
                resolutions=[resolution],  # what the row trains at (checkpoint_budget auto reads it, as from a dataset)
                checkpoint_every=0,
                keep_checkpoints=1,
                log_every=10,
                ema=False,
                seed=0,
            ),
            **settings,  # a row's settings win over the bench's defaults (optimizer=adamw8bit_torchao)
        }
    )
    clock = StepClock(device, timing)
    # Profiled steps come after the timed ones (the profiler's own host cost stays out of the timing).
    profiler = StepProfiler(first=steps + 1, count=profile_steps, rank=32, device=device)
    entered = time.perf_counter()
    with (
        peak_memory(device, out, ""),
        tempfile.TemporaryDirectory(prefix="kiln_bench_") as run_dir,
        torch.inference_mode(),
        bridge.training_session(
            model, "auto", quantized_matmul=quantized_matmul, step_room=bridge.step_room(cfg, model)
        ) as (module, _device),
    ):
        # inference mode as inside a ComfyUI prompt; the session turns it off
        out["kiln_load_s"] = round(time.perf_counter() - entered, 2)  # the session's full load (untimed setup)
        stray = [n for n, m in module.named_modules() if getattr(m, "weight_function", None)]
        if stray:  # e.g. native's adapters left on the modules: the timing would not be Kiln's
            raise RuntimeError(
                f"{len(stray)} modules carry ComfyUI weight functions in Kiln's session, e.g. {stray[:3]}"
            )
        counter = RowCounter(module)
        streamed = StreamedBytes(pack["streaming"])
        bar, started = bridge.progress(cfg.steps), time.time()

        def on_step(report) -> None:  # what nodes/run.py's on_step does, then the step boundary
            bar.update(report.step)
            bridge.send_event(
                "kiln.progress",
                {
                    "step": report.step,
                    "total": report.total_steps,
                    "lr": report.lr,
                    "loss": report.loss,
                    "loss_smooth": report.loss_smooth,
                    "it_per_s": report.it_per_s,
                    "eta_s": report.eta_s,
                    "peak_memory_bytes": report.peak_memory_bytes,
                    "run": "bench",
                    "started": started,
                },
            )
            clock.mark()
            streamed.mark()
            profiler.on_step(report.step)

        notes = LeverNotes()  # what compile_blocks / checkpoint_budget "auto" decided (the backend's log line)
        skips_before = _cudagraph_skips()
        try:
            before = time.perf_counter()
            result = loop.train(
                cfg, module, data, run_dir=run_dir, forward=bridge.make_forward(model, arch_name), on_step=on_step
            )
        finally:
            counter.remove()
            streamed.remove()
            notes.remove()
            print("".join(f"[bench] kiln: {line}\n" for line in notes.lines), end="", flush=True)  # a failed row's too
    out.update(notes.levers(cfg))
    # compiled graphs inductor ran without CUDA graphs although asked (cuda_graphs): each skip costs the speed
    out["kiln_cudagraph_skips"] = _cudagraph_skips() - skips_before
    stats = timed_stats(clock.durations()[: steps - 1], warmup)
    losses = [float(v) for v in result.history.loss][:steps]
    # Step 1 from the train() call (LoRA injection, and compiling when compile_blocks is on), then the
    # untimed warm-up steps (recompiles land there): what a user waits before the timed pace.
    out.update(
        kiln_first_step_s=round(clock.first_mark - before, 2) if clock.first_mark else None,
        kiln_warmup_s=round(sum(clock.durations()[: max(0, warmup - 1)]), 2),
    )
    out.update(
        kiln_s_per_step=stats["median"],
        kiln_p95=stats["p95"],
        kiln_mean=stats["mean"],
        kiln_steps_timed=stats["n"],
        kiln_loss_first=losses[0] if losses else None,
        kiln_loss_last=losses[-1] if losses else None,
        kiln_loss_finite=bool(losses) and all(math.isfinite(v) for v in losses),
        # the curve in means of 10 steps: rows with the same seed draw the same noise and timesteps, so
        # two settings' curves compare step for step (fp8_compute against bf16)
        kiln_loss_curve=[
            round(sum(losses[i : i + 10]) / len(losses[i : i + 10]), 5) for i in range(0, len(losses), 10)
        ],
        lora_params=result.trainable_parameters,
        lora_modules=len(result.lora),
        kiln_forward_rows=sum(counter.rows) / max(1, result.step),
        h2d_gb_per_step=streamed.per_step_gib(warmup),
    )
    out["_lora_paths"] = list(result.lora)
    if profiler.result:
        out["kiln_profile"] = profiler.result
    return out


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"].get("cudagraph_skips", 0))


# ---------------------------------------------------------------- native


@contextlib.contextmanager
def comfy_fp8_backward(on: bool):
    """ComfyUI's training_fp8_bwd (0.19+) set for the block, restored after; yields [calls] counting the
    forwards of its quantized training function (comfy.ops.QuantLinearFunc), or None where it has none."""
    import comfy.model_management as mm
    import comfy.ops

    function = getattr(comfy.ops, "QuantLinearFunc", None)
    if on and not hasattr(mm, "training_fp8_bwd"):
        raise RuntimeError("fp8_bwd=on needs ComfyUI 0.19 or newer (comfy.model_management.training_fp8_bwd)")
    if function is None:
        yield None
        return
    calls, forward, previous = [0], function.forward, getattr(mm, "training_fp8_bwd", False)

    def counted(ctx, *args):
        calls[0] += 1
        return forward(ctx, *args)

    function.forward, mm.training_fp8_bwd = staticmethod(counted), on
    try:
        yield calls
    finally:
        function.forward, mm.training_fp8_bwd = staticmethod(forward), previous


@contextlib.contextmanager
def native_steps(on_start, on_step):
    """ComfyUI's TrainSampler makes a ProgressBar right before its loop and updates it at the end of every
    step: for the block, `on_start()` runs at the first and `on_step()` at each update (its console bar off)."""
    import comfy.utils
    from comfy_extras import nodes_train

    class StepBar(nodes_train.ProgressBar):
        def __init__(self, total, node_id=None):
            on_start()
            super().__init__(total, node_id)

        def update(self, value):
            on_step()
            super().update(value)

    previous_bar, previous_enabled = nodes_train.ProgressBar, comfy.utils.PROGRESS_BAR_ENABLED
    nodes_train.ProgressBar, comfy.utils.PROGRESS_BAR_ENABLED = StepBar, False
    try:
        yield
    finally:
        nodes_train.ProgressBar, comfy.utils.PROGRESS_BAR_ENABLED = previous_bar, previous_enabled


def run_native(
    patcher,
    inputs: Inputs,
    *,
    batch: int,
    checkpointing: bool,
    steps: int,
    warmup: int,
    timing: str,
    device: torch.device,
    dtype: str,
    lora_dtype: str,
    checkpoint_depth: int = 2,
    quantized_backward: bool = False,
) -> dict:
    import comfy.model_management
    from comfy_extras import nodes_train

    out: dict = {}
    clock = StepClock(device, timing)

    latent = {"samples": torch.from_numpy(np.stack(inputs.latents))}
    conditioning = [[torch.from_numpy(c)[None], {"pooled_output": None}] for c in inputs.contexts]
    arguments = dict(
        model=patcher,
        latents=latent,
        positive=conditioning,
        batch_size=batch,
        steps=steps,
        grad_accumulation_steps=1,
        learning_rate=1e-4,
        rank=32,
        optimizer="AdamW",
        loss_function="MSE",
        seed=0,
        training_dtype=dtype,
        lora_dtype=lora_dtype,
        algorithm="LoRA",
        gradient_checkpointing=checkpointing,
        checkpoint_depth=checkpoint_depth,
        offloading=False,
        existing_lora="[None]",
        bucket_mode=False,
        bypass_mode=False,
    )
    # The node's inputs differ by version: 0.19 added quantized_backward (FP8 backward for fp8/nvfp4 bases;
    # the row's fp8_bwd). Every input its schema lists must be given.
    wanted = {item.id for item in nodes_train.TrainLoraNode.define_schema().inputs}
    if "quantized_backward" in wanted:
        arguments["quantized_backward"] = quantized_backward
    elif quantized_backward:
        raise RuntimeError("this ComfyUI's TrainLoraNode has no quantized_backward input (0.19+)")
    missing = sorted(wanted - set(arguments))
    if missing:
        raise RuntimeError(f"this ComfyUI's TrainLoraNode has inputs the bench does not set: {missing}")
    arguments = {k: v for k, v in arguments.items() if k in wanted}
    out["native_quantized_backward"] = arguments.get("quantized_backward")
    # From 0.25 the node deep-clones its model (rebuilt through cached_patcher_init) and trains the copy.
    counter = RowCounter(patcher.model.diffusion_model)
    REBUILT.append(counter.watch)
    rebuilt_before = len(counter.handles)
    previous_fp8_bwd = getattr(comfy.model_management, "training_fp8_bwd", None)  # the node sets it and leaves it
    entered = time.perf_counter()

    def loop_starts():
        out["native_setup_s"] = round(time.perf_counter() - entered, 2)  # adapters, loads (untimed)

    try:
        with (
            native_steps(loop_starts, clock.mark),
            peak_memory(device, out, "native_"),
            torch.inference_mode(),
            warnings.catch_warnings(),
        ):
            # inference mode as inside a ComfyUI prompt; its fp32 autocast on a CPU (--tiny) only warns
            warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
            result = nodes_train.TrainLoraNode.execute(**{k: [v] for k, v in arguments.items()})
        lora_sd, loss_map = result.result[0], result.result[1]
        stats = timed_stats(clock.durations(), warmup)
        losses = [float(v) for v in loss_map["loss"]]
        out.update(
            native_s_per_step=stats["median"],
            native_p95=stats["p95"],
            native_mean=stats["mean"],
            native_steps_timed=stats["n"],
            native_loss_first=losses[0] if losses else None,
            native_loss_last=losses[-1] if losses else None,
            native_loss_finite=bool(losses) and all(math.isfinite(v) for v in losses),
            native_trainable_params=sum(t.numel() for t in lora_sd.values()),
            native_forward_rows=sum(counter.rows) / steps,
            native_error=None,
            native_deep_copy=len(counter.handles) > rebuilt_before,
        )
    except Exception as error:  # noqa: BLE001 — recorded (e.g. its Flux2 backward without checkpointing)
        out.update(native_s_per_step=None, native_p95=None, native_error=f"{type(error).__name__}: {error}"[:500])
        print(f"[bench] native trainer failed: {out['native_error']}", file=sys.stderr)
    finally:
        counter.remove()
        REBUILT.remove(counter.watch)
        if previous_fp8_bwd is not None:
            comfy.model_management.training_fp8_bwd = previous_fp8_bwd
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------- rows and records


@dataclass(frozen=True)
class Row:
    arch: str
    resolution: int
    batch: int
    checkpointing: bool
    targets: str  # "default" | "all"
    settings: dict = field(default_factory=dict)  # Kiln config overrides (levers), e.g. compile_blocks


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("on", "1", "true", "yes"):
        return True
    if value in ("off", "0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on/off, got {text!r}")


def _settings(text: str) -> dict:
    """'compile_blocks=on+skip_checkpoint_blocks=10+saved_attention=off' → typed overrides. Config keys go
    to Kiln's TrainConfig; bench only: saved_attention=off drops selective checkpointing's kept attention,
    base=fp8 stores the frozen model in fp8 (ComfyUI's weight_dtype fp8_e4m3fn), base=fp8q quantizes it as
    ComfyUI's own fp8 checkpoints are (comfy_quant: fp8 matmuls), fp8_bwd=on sets ComfyUI's
    training_fp8_bwd (≥0.19: FP8 backward through quantized layers; native's quantized_backward input) for
    both trainers, fp8_matmul=on keeps ComfyUI's fp8 matmuls in Kiln's training (by default Kiln dequantizes
    a quantized base's weights: nodes/comfy/), native=off skips the native trainer for the row, host=on builds
    the model in host memory (ComfyUI's offload device) for the session to load, as ComfyUI's loaders do."""
    out: dict = {}
    for item in filter(None, text.split("+")):
        key, _, value = item.partition("=")
        if key == "base":  # bench only: bf16 or fp8 storage of the frozen base
            out[key] = value
            continue
        if key in ("native", "fp8_bwd", "fp8_matmul", "bench_dop", "bench_mask", "host"):  # bench only (see above)
            out[key] = _bool(value)
            continue
        if key == "size":  # bench only: a frame of height x width other than resolution² (e.g. 480x832)
            out[key] = tuple(int(v) for v in value.split("x"))
            continue
        for kind in (int, float, _bool, str):  # e.g. 7, 0.4, on, cudnn
            try:
                out[key] = kind(value)
                break
            except (ValueError, argparse.ArgumentTypeError):
                continue
    return out


def _list(text: str, kind=str) -> list:
    return [kind(part.strip()) for part in text.split(",") if part.strip()]


def plan_rows(args) -> list[Row]:
    """The rows to time; --adapter repeats each for every adapter kind (trainer/lora/adapters.py)."""
    kinds = _list(args.adapter)
    return [
        Row(
            r.arch,
            r.resolution,
            r.batch,
            r.checkpointing,
            r.targets,
            {**r.settings, **({"adapter": kind} if kind != "lora" else {})},
        )
        for r in _rows(args)
        for kind in kinds
    ]


def _rows(args) -> list[Row]:
    archs = _list(args.arch)
    for arch in archs:
        if arch not in ARCH_VARIANTS:
            raise SystemExit(f"--arch: unknown {arch!r}; choose from {list(ARCH_VARIANTS)}")
    if args.rows:
        rows = []
        for spec in _list(args.rows):
            parts = spec.split(":")
            if len(parts) not in (5, 6) or parts[0] not in ARCH_VARIANTS or parts[4] not in ("default", "all"):
                raise SystemExit(
                    f"--rows: {spec!r} is not arch:res:batch:on|off:default|all[:key=value+...] "
                    f"(arch in {list(ARCH_VARIANTS)})"
                )
            settings = _settings(parts[5]) if len(parts) == 6 else {}
            rows.append(Row(parts[0], int(parts[1]), int(parts[2]), _bool(parts[3]), parts[4], settings))
        return rows
    resolutions = _list(args.res, int) if args.res else None
    batches = _list(args.batch, int) if args.batch else None
    ckpts = [_bool(v) for v in _list(args.ckpt)]
    targets = _list(args.targets) if args.targets else None
    if resolutions is None and batches is None and targets is None:  # the issue's set
        default_res = args.tiny_res if args.tiny else None
        shapes = [(1024, 1, "default"), (512, 1, "default"), (512, 4, "default"), (1024, 1, "all")]
        if default_res:
            shapes = [(default_res, 1, "default")]
        return [Row(a, r, b, c, t) for a in archs for (r, b, t) in shapes for c in ckpts]
    resolutions = resolutions or ([args.tiny_res] if args.tiny else [1024])
    return [
        Row(a, r, b, c, t)
        for a, r, b, c, t in itertools.product(archs, resolutions, batches or [1], ckpts, targets or ["default"])
    ]


def append_records(path: Path, records: list[dict]) -> None:
    """Append to a JSON list file (created if absent), written to a temp file and renamed."""
    existing = json.loads(path.read_text(encoding="utf-8")) if path.is_file() and path.stat().st_size else []
    if not isinstance(existing, list):
        raise SystemExit(f"{path} does not hold a JSON list")
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(existing + records, indent=1) + "\n", encoding="utf-8")
    os.replace(temp, path)


def _round(value, digits=4):
    return round(value, digits) if isinstance(value, float) else value


def command_line() -> argparse.ArgumentParser:
    """The command line (this module's docstring says what the rows and options mean)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", default="zimage,klein4b", help=f"comma list of {list(ARCH_VARIANTS)}")
    parser.add_argument("--res", help="comma list of square resolutions in px (default: the issue's set)")
    parser.add_argument("--batch", help="comma list of batch sizes")
    parser.add_argument("--ckpt", default="on", help="gradient checkpointing: on, off or on,off")
    parser.add_argument("--targets", help="default (the arch's), all (every Linear) or default,all")
    parser.add_argument("--rows", help="explicit rows arch:res:batch:on|off:default|all, comma separated")
    parser.add_argument(
        "--adapter",
        default="lora",
        help="comma list of adapter kinds to time each row with: lora, "
        "lokr, loha, dora (e.g. lora,lokr,loha,dora; with --no-native: ComfyUI's native trainer "
        "trains LoRA only). LoKr's factor: a row setting, e.g. --rows ...:lokr_factor=16",
    )
    parser.add_argument("--steps", type=int, help="steps per trainer (default 60; --tiny 3)")
    parser.add_argument("--warmup", type=int, help="untimed first steps (default 10; --tiny 1)")
    parser.add_argument("--native-steps", type=int, help="steps for the native trainer (default: --steps)")
    parser.add_argument("--no-native", action="store_true", help="time Kiln only")
    parser.add_argument(
        "--peer",
        default="",
        help="diffusers' transformer + PEFT LoRA in each row (bench/peer.py): "
        "eager, compiled (compile_repeated_blocks) or eager,compiled; needs diffusers and peft",
    )
    parser.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        help="weights and autocast (default bf16; --tiny on a CPU fp32: CPU bf16 matmuls crawl)",
    )
    parser.add_argument(
        "--native-lora-dtype",
        choices=["bf16", "fp32"],
        help="the native node's lora_dtype (default: its own default bf16; fp32 with --dtype fp32)",
    )
    parser.add_argument(
        "--native-ckpt-depth",
        type=int,
        default=2,
        help="the native node's checkpoint_depth (2: per block, like Kiln; the node's default is 1)",
    )
    parser.add_argument("--zimage-tokens", type=int, help="Z-Image caption tokens per image (default 256; --tiny 32)")
    parser.add_argument(
        "--timing",
        default="events",
        choices=["events", "sync"],
        help="step boundaries by CUDA events (no sync added; the default) or after a synchronize",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="profile N steps after the timed ones (bench/step_profile.py; CUDA only)",
    )
    parser.add_argument(
        "--no-checkpoint",
        action="store_true",
        help="write no checkpoint, not even the final one (never timed; a full fine-tune's holds the weights and "
        "the optimizer's moments: Z-Image with AdamW ~62 GB, more than the GPU machine's free disk)",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--matmul-n", type=int, help="matmul size for the rate (default 8192 on CUDA, 512 on CPU)")
    parser.add_argument("--tiny", action="store_true", help="tiny dims (hidden 256), same code path; CPU is fine")
    parser.add_argument("--tiny-res", type=int, default=128, help=argparse.SUPPRESS)
    parser.add_argument(
        "--card-gb",
        type=float,
        metavar="G",
        help="act as a G GiB card: this process's torch allocator capped (set_per_process_memory_"
        "fraction) at G GiB less what the GPU held before torch allocated anything (its CUDA "
        "context), which Kiln's auto levers plan within",
    )
    parser.add_argument(
        "--uncapped",
        action="store_true",
        help="with --card-gb: each row also runs without the cap first, on the same model in the same process "
        "(uncapped_s_per_step, uncapped_loss_curve, uncapped_peak_reserved_gb; within_target: the issue's test)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help="an A/B switch of the pack set before the rows run, e.g. trainer.backends.torch_backend."
        "checkpointing.MARK_TOKEN_DIMS=0 (read as the switch's own type: bool 1/0, true/false, "
        "on/off; int, float, str; recorded as `lever`)",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results.json"), help="JSON list to append to")
    parser.add_argument("--merge", nargs="+", metavar="FILE", help="append these files' records to --out and exit")
    gpu_ranks.add_arguments(parser, _bool)
    return parser


def main(argv=None) -> int:
    parser = command_line()
    args = parser.parse_args(argv)
    ranks = gpu_ranks.check_arguments(parser, args)
    if args.uncapped and not args.card_gb:
        parser.error("--uncapped runs each row without the cap too: it needs --card-gb")

    out_path = Path(args.out)
    if args.merge:
        records = [r for f in args.merge for r in json.loads(Path(f).read_text(encoding="utf-8"))]
        append_records(out_path, records)
        print(f"appended {len(records)} records to {out_path}")
        return 0

    steps = args.steps or (3 if args.tiny else 60)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 10)
    native_steps = args.native_steps or steps
    if not 1 <= warmup < min(steps, native_steps):
        raise SystemExit(f"--warmup must be in 1..steps-1 (step 1 has no start mark), got {warmup} of {steps}")
    zimage_tokens = args.zimage_tokens or (32 if args.tiny else 256)
    device_kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device_kind == "cpu" and not args.tiny:
        raise SystemExit("full-size rows need a CUDA GPU; use --tiny on a CPU")
    rows = plan_rows(args)

    gpu_ranks.pick_device(device_kind)  # under torchrun, each rank its GPU before ComfyUI picks one
    prepare = prepare_comfy(device_kind)
    import comfy.ldm.modules.attention as comfy_attention
    import comfy.model_management as mm

    pack = import_pack(prepare, device_kind if ranks > 1 else None)
    if args.no_checkpoint:
        pack["loop"].save_run = functools.partial(skip_checkpoint, pack["loop"].state)
    archs_module = prepare.import_pack("trainer.archs")
    device = mm.get_torch_device()
    dtype_name = args.dtype or ("fp32" if args.tiny and device.type == "cpu" else "bf16")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    native_lora_dtype = args.native_lora_dtype or dtype_name
    try:
        from comfyui_version import __version__ as comfy_version
    except ImportError:
        comfy_version = "unknown"
    on_gpu = device.type == "cuda"
    levers_set = set_switches(prepare, args.set)
    h2d_gbps = pinned_copy_gibps(device) if on_gpu else None  # before the cap: its buffer is not the run's
    card = cap_memory(device, args.card_gb) if args.card_gb else {}
    compile_workers = count_compile_workers()
    rate = matmul_tflops(device, dtype, args.matmul_n or (8192 if on_gpu else 512), iters=50 if on_gpu else 10)
    common = {
        "commit": git_commit(),
        "device": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "comfyui": comfy_version,
        "matmul_tflops": float(f"{rate:.4g}"),
        "attention": getattr(comfy_attention.optimized_attention, "__name__", "?"),
        "rank": 32,
        "dtype": dtype_name,
        "timing": args.timing,
        "steps": steps,
        "warmup": warmup,
        "native_steps": None if args.no_native else native_steps,
        "tiny": args.tiny,
        "h2d_gbps": h2d_gbps,
        **({"checkpoints": "none (--no-checkpoint)"} if args.no_checkpoint else {}),
        **card,
        **({"lever": ",".join(levers_set)} if levers_set else {}),
    }
    print(
        f"[bench] {common['device']}, torch {common['torch']}, ComfyUI {comfy_version}, "
        f"{dtype_name} matmul {rate:.4g} TFLOPS; {len(rows)} row(s)",
        flush=True,
    )

    arch_names = {dims.arch for dims in (*TINY.values(), *(VARIANTS[name] for name in ARCH_VARIANTS.values()))}
    block_lists = {name: archs_module.get_arch(name).block_lists for name in arch_names}
    opts = argparse.Namespace(
        pack=pack,
        block_lists=block_lists,
        steps=steps,
        warmup=warmup,
        native_steps=native_steps,
        timing=args.timing,
        device=device,
        dtype=dtype_name,
        native_lora_dtype=native_lora_dtype,
        no_native=args.no_native or ranks > 1,  # native is a one-process trainer
        **gpu_ranks.options(args),
        native_ckpt_depth=args.native_ckpt_depth,
        profile=args.profile,
        rate=rate,
        common=common,
        zimage_tokens=zimage_tokens,
        peer=[{"eager": False, "compiled": True}[m] for m in _list(args.peer)],
    )
    models: dict[str, tuple] = {}
    for row in rows:
        dims = TINY[row.arch] if args.tiny else VARIANTS[ARCH_VARIANTS[row.arch]]
        base = row.settings.get("base", "bf16")  # bench only: fp8 = ComfyUI's fp8_e4m3fn weight dtype
        host = bool(row.settings.get("host", False))
        key = f"{row.arch}:{base}:{host}"
        if key not in models:
            models.clear()  # one full-size model on the GPU at a time
            release(device)
            models[key] = build_model(dims, device, dtype, base=base, host=host)
            print(f"[bench] built {dims.variant} ({base}): {models[key][1]}", flush=True)
        record = (
            gpu_ranks.run_row(row, dims, models, key, opts, run_row)
            if ranks > 1
            else run_capped(row, dims, models[key], opts, args.card_gb if args.uncapped else None)
        )
        if record is None:  # under torchrun rank 0 writes the record
            continue
        record.update(compile_counts(compile_workers))
        append_records(out_path, [record])
        print(summary(record), file=sys.stderr, flush=True)
        print(json.dumps(record), flush=True)
    return 0


def skip_checkpoint(state, step: int, *, run, log):
    """The loop's save_run under --no-checkpoint (`state`: the loop's trainer.run.state): the step's figures
    flushed, nothing written; the step's folder named as save_run names it."""
    log.flush()
    return state.step_dir(run.run_dir, step)


def import_pack(prepare, group_device: str | None = None) -> dict:
    """The pack's modules the harness drives, imported as ComfyUI imports the pack; with `group_device`
    (torchrun) this rank joins the job's process group (NCCL on cuda, gloo on cpu)."""
    pack = {
        name: prepare.import_pack(module)
        for name, module in {
            "bridge": "nodes.comfy.bridge",
            "config": "trainer.config",
            "loop": "trainer.run.loop",
            "data": "trainer.data",
            "checkpointing": "trainer.backends.torch_backend.checkpointing",
            "attention": "trainer.backends.torch_backend.attention",
            "streaming": "trainer.backends.torch_backend.streaming",
            "distributed": "trainer.run.distributed",
        }.items()
    }
    if group_device is not None:
        pack["distributed"].start(group_device)
    return pack


def compile_counts(compile_workers: list[int] | None) -> dict:
    """The compile figures of the row just run; the worker counts start again from zero."""
    counts = {}
    if compile_workers is not None:  # Triton kernels inductor asked for before / after its workers answered
        counts["triton_kernels_in_process"], counts["triton_kernels_to_workers"] = compile_workers
        compile_workers[:] = [0, 0]
    return {**counts, "compile_phases_s": compile_phases()}


def set_switches(prepare, assignments: list[str]) -> list[str]:
    """`module.NAME=VALUE` A/B switches of the pack (bench/RESULTS.md's levers), set before any row runs."""
    done = []
    for assignment in assignments:
        target, _, text = assignment.partition("=")
        module_name, _, name = target.rpartition(".")
        module = prepare.import_pack(module_name)
        if not hasattr(module, name):
            raise SystemExit(f"--set {assignment}: {module_name} has no {name}")
        setattr(module, name, _as_type_of(getattr(module, name), text, assignment))
        done.append(f"{target.rpartition('.')[0].rpartition('.')[2]}.{name}={text}")
    return done


def _as_type_of(current, text: str, assignment: str):
    """`text` as a value of the switch's own type (a bool from 1/0, true/false, on/off), else refused."""
    if isinstance(current, bool):
        words = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}
        if text.lower() not in words:
            raise SystemExit(f"--set {assignment}: a bool switch takes 1/0, true/false or on/off")
        return words[text.lower()]
    if not isinstance(current, (int, float, str)):
        raise SystemExit(f"--set {assignment}: a {type(current).__name__} switch is not settable from the command line")
    try:
        return type(current)(text)
    except ValueError:
        raise SystemExit(f"--set {assignment}: not a {type(current).__name__}") from None


def cap_memory(device: torch.device, card_gb: float) -> dict:
    """This process's allocator capped so that it and the CUDA context fit `card_gb` GiB, as on a card that
    size (the context is what the GPU held before torch allocated anything)."""
    if device.type != "cuda":
        raise SystemExit("--card-gb needs a CUDA GPU")
    probe = torch.ones(256, 256, device=device, dtype=torch.bfloat16)
    (probe @ probe).sum().item()  # cuBLAS loaded: its handles and kernels count as context on a real card too
    del probe
    free, total = torch.cuda.mem_get_info(device)
    context = total - free - torch.cuda.memory_reserved(device)
    cap = card_gb * GIB - context
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    print(
        f"[bench] acting as a {card_gb:g} GiB card: allocator capped at {cap / GIB:.2f} GiB "
        f"(context {context / GIB:.2f} GiB)",
        flush=True,
    )
    return {"card_gb": card_gb, "memory_cap_gb": round(cap / GIB, 3)}


def run_capped(row: Row, dims: ModelDims, model: tuple, opts, uncapped_card_gb: float | None) -> dict:
    """The row's record; with `uncapped_card_gb` the same row runs first without the cap (its compiled blocks then
    cached for the capped run) and the record gains the uncapped figures and the issue's verdict."""
    if uncapped_card_gb is None:
        return run_row(row, dims, *model, opts)
    torch.cuda.set_per_process_memory_fraction(1.0, opts.device)
    free = run_row(row, dims, *model, opts)
    cap_memory(opts.device, uncapped_card_gb)
    record = run_row(row, dims, *model, opts)
    record.update({f"uncapped_{k.removeprefix('kiln_')}": free.get(k) for k in UNCAPPED_KEYS})
    return {**record, **against_uncapped(record)}


UNCAPPED_KEYS = ("kiln_s_per_step", "kiln_loss_curve", "peak_reserved_gb", "kiln_error")


def against_uncapped(record: dict) -> dict:
    """The issue's test of a capped row: the step within 1.15x the larger of the uncapped step and the time its
    copies take at the measured pinned rate, the peak inside the card, the loss the uncapped run's."""
    capped, free = record.get("kiln_s_per_step"), record.get("uncapped_s_per_step")
    if not capped or not free:
        return {"within_target": False}
    streaming = record["h2d_gb_per_step"] / record["h2d_gbps"] if record.get("h2d_gbps") else 0.0
    target = 1.15 * max(free, streaming)
    pairs = list(zip(record["kiln_loss_curve"], record["uncapped_loss_curve"] or []))
    loss_diff = max((abs(a - b) / abs(b) for a, b in pairs if b), default=None)
    inside = record["peak_reserved_gb"] <= record["memory_cap_gb"]
    return {
        "streaming_s_per_step": round(streaming, 4),
        "target_s_per_step": round(target, 4),
        "loss_rel_diff_vs_uncapped": None if loss_diff is None else round(loss_diff, 5),
        "within_target": capped <= target and inside,
    }


def pinned_copy_gibps(device: torch.device, gib: float = 1.0, reps: int = 5) -> float | None:
    """The host→GPU rate of a pinned copy in this run (GiB/s, best of `reps` copies of `gib` GiB): the most a
    block stream can move per second on this machine."""
    if device.type != "cuda":
        return None
    host = torch.empty(int(gib * GIB), dtype=torch.uint8, pin_memory=True)
    target = torch.empty_like(host, device=device)
    best = math.inf
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del host, target
    return round(gib / best, 2)


class StreamedBytes:
    """The bytes Kiln's block stream copies host→GPU during a run (BlockStreamer._load wrapped), read at each
    step boundary."""

    def __init__(self, streaming):
        self.module, self.original, self.total, self.at_steps = streaming, streaming.BlockStreamer._load, 0, []
        counter = self

        def _load(streamer, position, after):
            if streamer.holds[position % len(streamer.ring)] != position:  # a copy will be made
                counter.total += sum(h.numel() * h.element_size() for h in streamer.streamed[position].host)
            return counter.original(streamer, position, after)

        streaming.BlockStreamer._load = _load

    def mark(self) -> None:
        self.at_steps.append(self.total)

    def per_step_gib(self, warmup: int) -> float:
        """The median bytes of the timed steps (a step's copies: forward, recompute and backward)."""
        diffs = [b - a for a, b in zip(self.at_steps, self.at_steps[1:])][max(0, warmup - 1) :]
        return round(statistics.median(diffs) / GIB, 3) if diffs else 0.0

    def remove(self) -> None:
        self.module.BlockStreamer._load = self.original


def count_compile_workers() -> list[int] | None:
    """[kernels inductor built in this process, kernels it sent to its workers]: counted at each Triton
    kernel request (cache hits included) by whether the worker pool had answered yet."""
    try:
        from torch._inductor.async_compile import AsyncCompile
    except ImportError:
        return None
    counts, triton = [0, 0], AsyncCompile.triton

    def counted(self, *args, **kwargs):
        counts[1 if AsyncCompile.use_process_pool() else 0] += 1
        return triton(self, *args, **kwargs)

    AsyncCompile.triton = counted
    return counts


def compile_phases(top: int = 14) -> dict[str, float]:
    """Where this row's compile went: dynamo's timers (`torch._dynamo.utils.compile_times`: dynamo's trace,
    AOTAutograd, inductor's lowering and code generation, the wait for Triton kernels, ...), seconds summed
    over the row's compiles, the `top` largest; nested timers overlap. Cleared for the next row."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    totals = sorted(
        ((name, sum(values)) for name, values in compilation_time_metrics.items()), key=lambda item: -item[1]
    )
    compilation_time_metrics.clear()
    return {name: round(seconds, 2) for name, seconds in totals[:top] if seconds >= 0.01}


def summary(r: dict) -> str:
    def num(value, fmt):
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    native = (
        f"native {num(r.get('native_s_per_step'), '.3f')} s/step (native/kiln {num(r.get('speedup_vs_native'), '.2f')})"
        if r.get("native_s_per_step")
        else f"native: {r.get('native_error')}"
    )
    return (
        f"[bench] {r['arch']} {r['resolution']}px b{r['batch']} ckpt {'on' if r['checkpointing'] else 'off'} "
        f"{r['targets']} {r.get('kiln_settings') or ''}: kiln {num(r['kiln_s_per_step'], '.3f')} s/step (p95 {num(r['kiln_p95'], '.3f')}), "
        f"MFU {num(r['mfu'], '.1%')}, peak {num(r.get('peak_alloc_gb'), '.2f')}/"
        f"{num(r.get('peak_reserved_gb'), '.2f')} GiB alloc/reserved"
        + (f" (kiln: {r['kiln_error']})" if r.get("kiln_error") else "")
        + f"; {native}"
    )


def run_row(row: Row, dims: ModelDims, patcher, build_info: dict, opts) -> dict:
    """Kiln then native on one model and one set of inputs → the record."""
    text_tokens = {"zimage": opts.zimage_tokens, "qwen_image": QWEN_TEXT_TOKENS}.get(family_of(dims), FLUX2_TEXT_TOKENS)
    text_tokens = dims.context_tokens if family_of(dims) == "wan" else text_tokens  # umT5 pads to 512
    # bench_images=N: N images instead of one per batch row (a held-out split needs images to hold out)
    count = max(row.batch, int(row.settings.get("bench_images", 0)))
    # frames (Kiln's dataset setting, also given to the run) and size: a clip's latents [C, t, h, w]
    size, frames = row.settings.get("size"), int(row.settings.get("frames", 1))
    inputs = make_inputs(dims, row.resolution, count, text_tokens, size=size, frames=frames)
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **opts.common,
        "arch": row.arch,
        "variant": dims.variant,
        "resolution": row.resolution,
        **({"size": list(size)} if size else {}),
        **({"frames": frames} if frames > 1 else {}),
        "batch": row.batch,
        "targets": row.targets,
        "checkpointing": row.checkpointing,
        "image_tokens": inputs.img_tokens,
        "text_tokens": inputs.txt_tokens,
        "params": build_info["params"],
        "weights_gb": build_info["weights_gb"],
        "model_config": build_info["model_config"],
    }
    device, rate = opts.device, opts.rate * 1e12
    started = time.perf_counter()
    settings = dict(row.settings)
    settings.pop("bench_images", None)
    settings.pop("size", None)
    saved_attention = settings.pop("saved_attention", True)
    with_native = settings.pop("native", True) and not opts.no_native
    record["base_dtype"] = settings.pop("base", "bf16")
    record["built_on_host"] = settings.pop("host", False)
    fp8_bwd = settings.pop("fp8_bwd", False)
    record["fp8_bwd"] = fp8_bwd
    record["fp8_matmul"] = quantized_matmul = settings.pop("fp8_matmul", False)
    ckpt_module = opts.pack["checkpointing"]
    saved_ops = ckpt_module.SAVED_OPS[:]
    record.update(kiln_settings=row.settings)
    record["attention_kernel"] = opts.pack["attention"].resolve(settings.get("attention", "auto"), device)
    try:
        if not saved_attention:
            ckpt_module.SAVED_OPS.clear()
        with comfy_fp8_backward(fp8_bwd) as quant_calls:
            kiln = run_kiln(
                opts.pack,
                patcher,
                dims,
                inputs,
                batch=row.batch,
                targets=row.targets,
                resolution=row.resolution,
                checkpointing=row.checkpointing,
                steps=opts.steps,
                warmup=opts.warmup,
                timing=opts.timing,
                device=device,
                dtype=opts.dtype,
                settings=settings,
                profile_steps=opts.profile,
                quantized_matmul=quantized_matmul,
            )
        kiln["kiln_error"] = None
        # Layers that ran ComfyUI's quantized training function (fp8 forward, FP8 or dequantized backward)
        kiln["kiln_quant_linear_calls"] = quant_calls[0] // max(1, opts.steps + opts.profile) if quant_calls else None
    except Exception as error:  # noqa: BLE001 — recorded (an OOM says what does not fit), the run goes on
        if os.environ.get("KILN_BENCH_TRACE"):
            import traceback

            traceback.print_exc()
        kiln = {
            "kiln_s_per_step": None,
            "kiln_p95": None,
            "_lora_paths": [],
            "kiln_error": f"{type(error).__name__}: {error}"[:500],
        }
        print(f"[bench] Kiln failed: {kiln['kiln_error']}", file=sys.stderr)
        cuda = device.type == "cuda"  # the peak of the failed attempt (its stats were reset when it began)
        kiln["peak_alloc_gb"] = round(torch.cuda.max_memory_allocated(device) / GIB, 3) if cuda else None
        kiln["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved(device) / GIB, 3) if cuda else None
    finally:
        ckpt_module.SAVED_OPS[:] = saved_ops
    release(device)
    lora_paths = kiln.pop("_lora_paths")
    record.update(kiln, kiln_wall_s=round(time.perf_counter() - started, 2))
    # What ran: compile_blocks / checkpoint_budget as set, or as "auto" decided (None when Kiln failed).
    compiled, budget = record.get("kiln_compiled", False), record.get("kiln_budget", 0.0)
    record.update(
        compile=compiled, saved_attention=saved_attention and row.checkpointing and bool(saved_ops) and compiled
    )  # eager blocks recompute attention
    dm, block_lists = patcher.model.diffusion_model, opts.block_lists[dims.arch]
    flops = model_flops(
        dm,
        dims,
        img=inputs.img_tokens,
        txt=inputs.txt_tokens,
        batch=row.batch,
        rank=32,
        lora_paths=lora_paths,
        block_lists=block_lists,
        checkpointing=row.checkpointing,
        skip=settings.get("skip_checkpoint_blocks", 0),
        attention_saved=record["saved_attention"],
        budgeted=budget > 0,
        full=settings.get("adapter") == "full",
    )
    record["mfu_counts_recompute"] = not budget > 0
    kiln_s = record["kiln_s_per_step"]
    record["model_tflop_per_step"] = round(flops["total"] / 1e12, 4)
    record["mfu"] = round(flops["total"] / kiln_s / rate, 4) if kiln_s else None
    if not with_native:
        record.update(native_s_per_step=None, native_p95=None, native_error="not run (--no-native or native=off)")
    else:
        started = time.perf_counter()
        record.update(
            run_native(
                patcher,
                inputs,
                batch=row.batch,
                checkpointing=row.checkpointing,
                steps=opts.native_steps,
                warmup=opts.warmup,
                timing=opts.timing,
                device=device,
                dtype=opts.dtype,
                lora_dtype=opts.native_lora_dtype,
                checkpoint_depth=opts.native_ckpt_depth,
                quantized_backward=fp8_bwd,
            )
        )
        release(device)
        record.update(
            native_wall_s=round(time.perf_counter() - started, 2),
            native_lora_dtype=opts.native_lora_dtype,
            native_checkpoint_depth=opts.native_ckpt_depth if row.checkpointing else None,
        )
        native_s = record.get("native_s_per_step")
        every_linear = [n for n, m in dm.named_modules() if isinstance(m, torch.nn.Linear)]
        native_flops = model_flops(
            dm,
            dims,
            img=inputs.img_tokens,
            txt=inputs.txt_tokens,
            batch=row.batch,
            rank=32,
            lora_paths=every_linear,
            block_lists=block_lists,
            checkpointing=row.checkpointing,
        )["total"]
        record["native_mfu"] = round(native_flops / native_s / rate, 4) if native_s else None
        record["speedup_vs_native"] = round(native_s / kiln_s, 3) if native_s and kiln_s else None
    for compiled in opts.peer:  # diffusers' own transformer + PEFT LoRA (bench/peer.py), eager and/or compiled
        from peer import run_peer

        prefix = "peer_compiled_" if compiled else "peer_"
        started = time.perf_counter()
        try:
            record.update(
                run_peer(
                    dims,
                    inputs.latents,
                    inputs.contexts,
                    steps=opts.steps,
                    warmup=opts.warmup,
                    device=device,
                    compiled=compiled,
                    checkpointing=row.checkpointing,
                    clock=StepClock(device, opts.timing),
                )
            )
            peer_s = record[f"{prefix}s_per_step"]
            record[f"speedup_vs_{prefix.rstrip('_')}"] = round(peer_s / kiln_s, 3) if peer_s and kiln_s else None
        except Exception as error:  # noqa: BLE001 — recorded, the run goes on
            record[f"{prefix}error"] = f"{type(error).__name__}: {error}"[:500]
            print(f"[bench] peer failed: {record[f'{prefix}error']}", file=sys.stderr)
        release(device)
        record[f"{prefix}wall_s"] = round(time.perf_counter() - started, 2)
        print(
            f"[bench]   peer{' compiled' if compiled else ''}: {record.get(f'{prefix}s_per_step')} s/step, "
            f"peak {record.get(f'{prefix}peak_alloc_gb')} GiB, loss {record.get(f'{prefix}loss_first')} → "
            f"{record.get(f'{prefix}loss_last')}",
            file=sys.stderr,
            flush=True,
        )
    return {k: _round(v) for k, v in record.items()}


if __name__ == "__main__":
    sys.exit(main())
