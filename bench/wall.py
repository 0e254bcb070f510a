#!/usr/bin/env python3
"""What a user waits for: one whole run, from the first step to the saved LoRA (issue #18 item 3).

    COMFYUI_PATH=... python bench/wall.py --arch zimage --out wall.json [--batch-by tokens] [--steps 1000]
    COMFYUI_PATH=... python bench/wall.py --arch zimage --tiny --steps 12 --every 4   # the same path on a CPU

A dataset of --images synthetic images in mixed aspect ratios (1:1, 4:3, 3:4, 3:2, 2:3, 16:9, 9:16), each
bucketed at every resolution of --res (512,768,1024: a 3:2 image is 624x416 / 928x624 / 1248x832 px, as
trainer.data.buckets cuts it), trained for --steps with Kiln's defaults through the loop the node runs
(trainer.run.loop.train in bridge.training_session, random weights as bench/gpu_train.py builds them), a
resumable checkpoint every --every steps and validation samples every --every steps and before the
first (2 prompts, ComfyUI's sampler with the family's sampling defaults at 1024x1024: Z-Image as
Turbo, 8 steps cfg 1; Klein 20 steps cfg 1), then the LoRA saved as Save LoRA saves it.

Reported: wall seconds to the saved LoRA, split into steps (steady), compile and warm-up (each bucket
shape's first steps above its steady pace), validation, saving (checkpoints and the LoRA), and the rest;
s/step and images/s per bucket (median of its steps after its first two). Each step is timed at its end
by a CUDA event (`--timing events`, the default: no sync is added, so the host runs ahead as it does in a
user's run, and a step's time is the GPU timeline between two step ends, any wait for the host included)
or after a torch.cuda.synchronize (`--timing sync`: each step then also pays the host's work before its
first kernel); validation and saving are timed apart, between syncs, and left out of the step they follow.
Not in it: encoding (the latents and text embeddings are synthetic, as if cached: a real run encodes
once per dataset and resolution, then reuses the cache) and the VAE decode of the samples (no VAE is
built: the sampler's latents stand in for the decoded image). The peers' per-bucket pace comes from
bench/gpu_train.py rows at the same resolutions (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for _folder in (ROOT, ROOT / "tests", ROOT / "bench"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import gpu_train  # noqa: E402
import torch  # noqa: E402
import wall_peers  # noqa: E402

from trainer.archs import get_arch  # noqa: E402
from trainer.data.buckets import bucket_size  # noqa: E402
from trainer.estimate.common import VARIANTS  # noqa: E402

ASPECTS = ((1, 1), (4, 3), (3, 4), (3, 2), (2, 3), (16, 9), (9, 16))
SAMPLES_LIKE = {"zimage": "zimage_turbo"}  # the bench's Z-Image samples as Turbo does (8 steps, cfg 1)
PROMPTS = 2


def synthetic_arrays(dims, resolutions: list[int], images: int, text_tokens: int, seed: int = 0):
    """(latents, contexts, names): each image (a 2048 px long side in one of ASPECTS) at each resolution, random
    latents of its bucket's size and a random caption embedding of text_tokens/4..text_tokens tokens (one per
    image). Every trainer of the bench gets these same arrays."""
    arch = get_arch(dims.arch)
    rng = np.random.default_rng(seed)
    latents, contexts, names = [], [], []
    for index in range(images):
        aw, ah = ASPECTS[index % len(ASPECTS)]
        width, height = (2048, 2048 * ah // aw) if aw >= ah else (2048 * aw // ah, 2048)
        context = rng.standard_normal((int(rng.integers(text_tokens // 4, text_tokens + 1)), dims.context_dim)).astype(
            np.float32
        )
        for resolution in resolutions:
            bw, bh = bucket_size(width, height, resolution, arch.bucket_divisor)
            down = arch.latent_downscale
            latents.append(rng.standard_normal((arch.latent_channels, bh // down, bw // down)).astype(np.float32))
            contexts.append(context)
            names.append(f"img{index:02d}_{width}x{height}@{resolution}.png")
    return latents, contexts, names


class LatentVAE:
    """Stands in for the VAE in validation: the sampler's latent is the 'image' (decode not timed)."""

    def decode(self, samples):
        return samples.movedim(1, -1)


def conditioning(dims, tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    # pooled_output: ComfyUI 0.17's Flux conds read it (None is fine for synthetic conds; 0.33 does not need it)
    return [[torch.randn(1, tokens, dims.context_dim, generator=generator), {"pooled_output": None}]]


class Phases:
    """Step ends (CUDA events, or perf_counter after a sync), and the validation and saving time that fell
    between two of them."""

    def __init__(self, device, timing: str = "events"):
        self.device, self.shapes, self.extra = device, [], [0.0]
        self.clock = gpu_train.StepClock(device, timing)  # its first mark is begin()
        self.validation = self.saving = 0.0
        self.calls = {"validation": 0, "saving": 0}  # how many times each ran
        self.shape = None
        self.started = None

    def begin(self) -> None:
        """The run's clock starts (the first step's time counts from here)."""
        self.clock.mark()
        self.started = self.clock.first_mark

    @property
    def ends(self) -> list[float]:
        """Each step's end in seconds after begin() (reading events waits for the GPU)."""
        return list(itertools.accumulate(self.clock.durations()))

    def timed(self, kind: str, fn):
        def wrapper(*args, **kwargs):
            gpu_train.sync(self.device)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                gpu_train.sync(self.device)
                seconds = time.perf_counter() - started
                setattr(self, kind, getattr(self, kind) + seconds)
                self.calls[kind] += 1
                self.extra[-1] += seconds

        return wrapper

    def step_end(self) -> None:
        self.clock.mark()
        self.shapes.append(self.shape)
        self.extra.append(0.0)
        if len(self.shapes) % 100 == 0 or len(self.shapes) <= 3:  # (a sync per 100 steps when events)
            ends = self.ends
            print(
                f"[wall] step {len(ends)} {self.shape} at {ends[-1] - ends[0]:.1f} s after step 1",
                file=sys.stderr,
                flush=True,
            )
            if os.environ.get("KILN_WALL_PROGRESS"):  # a run cut short by a time limit keeps its steps so far
                seconds, _ = per_bucket(self)
                path = Path(os.environ["KILN_WALL_PROGRESS"])
                partial = path.with_name(path.name + ".tmp")
                partial.write_text(
                    json.dumps(
                        {
                            "steps": len(seconds),
                            "step_seconds": seconds,
                            "step_shapes": self.shapes,
                            "validation_s": self.validation,
                            "saving_s": self.saving,
                        }
                    )
                )
                os.replace(partial, path)  # a kill mid-write leaves the last whole one


def per_bucket(phases: Phases) -> tuple[list[float], dict]:
    """Each step's seconds (validation and saving left out) and, per batch shape, its steady pace."""
    ends = phases.ends
    starts = [0.0, *ends[:-1]]
    seconds = [end - start - extra for start, end, extra in zip(starts, ends, phases.extra)]
    by_shape: dict[str, list[float]] = {}
    for shape, value in zip(phases.shapes, seconds):
        by_shape.setdefault(shape, []).append(value)
    table = {}
    for shape, values in by_shape.items():
        steady = statistics.median(values[2:]) if len(values) > 2 else min(values)
        batch = int(shape.split("x")[0])
        table[shape] = {
            "steps": len(values),
            "s_per_step": round(steady, 4),
            "images_per_s": round(batch / steady, 3) if steady > 0 else None,
            "warmup_s": round(sum(max(0.0, v - steady) for v in values[:2]), 2),
        }
    return seconds, table


@dataclass
class PeerContext:
    """What every trainer's run gets: the same arrays, samples and clock (bench/wall_peers.py reads it)."""

    args: argparse.Namespace
    dims: object
    device: torch.device
    dtype: torch.dtype
    phases: Phases
    latents: list
    contexts: list
    prompts: list  # CONDITIONING per prompt
    negative: list
    sample_steps: int
    sampling: object  # the family's sampling defaults (cfg, sampler, scheduler)
    run_dir: Path
    patcher: object = None


TRAINERS = ("kiln", "native", "diffusers", "diffusers-compiled")


def run(args) -> dict:
    # diffusers' peer needs no ComfyUI (and runs where ComfyUI's requirements and diffusers' disagree)
    prepare = gpu_train.prepare_comfy(args.device) if args.trainer in ("kiln", "native") else None
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    card = gpu_train.cap_memory(device, args.card_gb) if args.card_gb else {}
    dims = gpu_train.TINY[args.arch] if args.tiny else VARIANTS[gpu_train.ARCH_VARIANTS[args.arch]]
    arch_name = dims.arch
    dtype = torch.float32 if args.tiny and device.type == "cpu" else torch.bfloat16
    text_tokens = 32 if args.tiny else (256 if gpu_train.family_of(dims) == "zimage" else 128)
    resolutions = [int(r) for r in args.res.split(",")]
    latents, contexts, names = synthetic_arrays(dims, resolutions, args.images, text_tokens)
    sampling = get_arch(SAMPLES_LIKE.get(arch_name, arch_name)).sampling
    phases = Phases(device, args.timing)
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kind": "wall",
        "trainer": args.trainer,
        "commit": gpu_train.git_commit(),
        "device": gpu_train.device_name(device),
        "torch": torch.__version__,
        "arch": args.arch,
        "variant": dims.variant,
        "steps": args.steps,
        "images": args.images,
        "resolutions": resolutions,
        "entries": len(names),
        "every": args.every,
        "prompts": PROMPTS,
        "sample_steps": args.sample_steps or sampling.steps,
        "sample_size": args.sample_size,
        "timing": "events" if phases.clock.events else "sync",
        **card,
    }
    with tempfile.TemporaryDirectory(prefix="kiln_wall_") as run_dir:
        ctx = PeerContext(
            args,
            dims,
            device,
            dtype,
            phases,
            latents,
            contexts,
            prompts=[conditioning(dims, text_tokens, k) for k in range(PROMPTS)],
            negative=conditioning(dims, 8, 99),
            sample_steps=args.sample_steps or sampling.steps,
            sampling=sampling,
            run_dir=Path(run_dir),
        )
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if args.trainer == "kiln":
            own = run_kiln(prepare, ctx, names, resolutions, text_tokens)
        elif args.trainer == "native":
            ctx.patcher, _build = gpu_train.build_model(dims, device, dtype)
            own = wall_peers.run_native(ctx)
        else:
            own = wall_peers.run_diffusers(ctx, compiled=args.trainer == "diffusers-compiled")
        wall = time.perf_counter() - own.pop("wall_from", phases.started)
        peak = torch.cuda.max_memory_allocated(device) / gpu_train.GIB if device.type == "cuda" else None
        reserved = torch.cuda.max_memory_reserved(device) / gpu_train.GIB if device.type == "cuda" else None
    losses = own.pop("losses")
    record.update(own)
    seconds, table = per_bucket(phases)
    steady = sum(entry["s_per_step"] * entry["steps"] for entry in table.values())
    compile_s = sum(seconds) - steady
    finite = [v for v in losses if math.isfinite(v)]
    record.update(
        wall_s=round(wall, 1),
        steps_s=round(steady, 1),
        compile_warmup_s=round(compile_s, 1),
        validation_s=round(phases.validation, 1) if phases.calls["validation"] else None,  # native: none
        saving_s=round(phases.saving, 1),
        validation_calls=phases.calls["validation"],
        saving_calls=phases.calls["saving"],
        other_s=round(wall - sum(seconds) - phases.validation - phases.saving, 1),
        first_step_s=round(seconds[0], 2),
        compile_share=round(compile_s / wall, 3),
        compile_phases_s=gpu_train.compile_phases(),
        buckets=table,
        step_seconds=[round(v, 4) for v in seconds],
        step_shapes=phases.shapes,
        peak_alloc_gb=round(peak, 2) if peak else None,
        peak_reserved_gb=round(reserved, 2) if reserved else None,
        loss_finite=len(finite) == len(losses),
        loss_first=finite[0] if finite else None,
        loss_last_mean20=float(np.mean(finite[-20:])) if finite else None,
    )
    return record


def run_kiln(prepare, ctx: PeerContext, names, resolutions, text_tokens) -> dict:
    """Kiln's run: the loop the node runs, with its defaults (or --settings), samples and checkpoints."""
    args, dims, device, phases = ctx.args, ctx.dims, ctx.device, ctx.phases
    bridge = prepare.import_pack("nodes.comfy.bridge")
    config = prepare.import_pack("trainer.config")
    loop = prepare.import_pack("trainer.run.loop")
    data_module = prepare.import_pack("trainer.data")
    lora_format = prepare.import_pack("trainer.lora.files")
    checkpointing = prepare.import_pack("trainer.backends.torch_backend.checkpointing")
    checkpointing.COMPILE_DYNAMIC = {"true": True}.get(args.compile_dynamic, checkpointing.COMPILE_DYNAMIC)
    checkpointing.MARK_TOKEN_DIMS = {"dynamo": False, "true": False}.get(
        args.compile_dynamic, checkpointing.MARK_TOKEN_DIMS
    )
    arch_name, arch = dims.arch, get_arch(dims.arch)
    patcher, build = gpu_train.build_model(dims, device, ctx.dtype)
    empty = np.zeros((1, dims.context_dim), np.float32)
    data = data_module.MappedLatents(
        data_module.InMemoryData.from_arrays(ctx.latents, ctx.contexts, names, empty),
        lambda raw: bridge.item_latent_in(patcher, raw),
    )
    side = args.sample_size
    samples = [
        bridge.Sample(
            positive=prompt,
            negative=ctx.negative,
            vae=LatentVAE(),
            seed=42 + k,
            steps=ctx.sample_steps,
            cfg=ctx.sampling.cfg,
            sampler_name=ctx.sampling.sampler,
            scheduler=ctx.sampling.scheduler,
            width=side,
            height=side,
        )
        for k, prompt in enumerate(ctx.prompts)
    ]
    overrides = gpu_train._settings(args.settings)
    cfg = config.from_dict(
        dict(
            arch=arch_name,
            device="auto",
            mixed_precision="bf16" if ctx.dtype == torch.bfloat16 else "no",
            steps=args.steps,
            resolutions=resolutions,
            checkpoint_every=args.every,
            batch_by=args.batch_by,
            seed=0,
            **overrides,
        )
    )
    forward = bridge.make_forward(patcher, arch_name)

    # The step's batch shape, for the per-bucket table, read where the backend takes the batch: a step
    # replayed as a CUDA graph (step_graphs) does not call the forward.
    backend_class = prepare.import_pack("trainer.backends.torch_backend.backend").TorchBackend
    device_batch = backend_class._device_batch

    def shaped_batch(self, batch):
        phases.shape = "x".join(str(n) for n in (batch.latents.shape[0], *batch.latents.shape[2:]))
        return device_batch(self, batch)

    on_sample = lambda step, index, images: None  # noqa: E731
    own = {
        "batch_by": args.batch_by,
        "compile_dynamic": args.compile_dynamic,
        "mark_token_dims": checkpointing.MARK_TOKEN_DIMS,
        "params": build["params"],
        "kiln_settings": {**overrides, **({} if args.batch_by == "images" else {"batch_by": args.batch_by})},
    }
    notes = gpu_train.LeverNotes()
    save_checkpoint = loop.checkpoint_writer.save_checkpoint
    loop.checkpoint_writer.save_checkpoint = phases.timed("saving", save_checkpoint)
    backend_class._device_batch = shaped_batch
    graphs_class = prepare.import_pack("trainer.backends.torch_backend.step_graphs").StepGraphs
    record, recordings = graphs_class._record, []

    def timed_record(self, *args):  # each step graph's recording, host seconds (its shape: the step's)
        started = time.perf_counter()
        try:
            return record(self, *args)
        finally:
            recordings.append([phases.shape, round(time.perf_counter() - started, 3)])

    graphs_class._record = timed_record
    try:
        with torch.inference_mode(), bridge.training_session(patcher, "auto") as (module, _device):
            validate = phases.timed("validation", bridge.validation(cfg, patcher, samples, on_sample))
            phases.begin()
            validate(0)  # sample_first: the model before training
            phases.extra[0] = phases.validation
            result = loop.train(
                cfg,
                module,
                data,
                run_dir=str(ctx.run_dir),
                forward=forward,
                on_step=lambda report: phases.step_end(),
                validate=validate,
                validate_every=args.every,
            )
            save_lora = phases.timed("saving", lora_format.save_lora)
            save_lora(
                ctx.run_dir / "final.safetensors",
                result.lora,
                arch=arch_name,
                fmt="comfy",
                metadata=lora_format.lora_metadata(cfg, arch, result.step),
            )
    finally:
        loop.checkpoint_writer.save_checkpoint = save_checkpoint
        backend_class._device_batch = device_batch
        graphs_class._record = record
        notes.remove()
    own.update(notes.levers(cfg))
    own["losses"] = list(result.history.loss)
    own["step_graph_recordings"] = recordings  # [shape, seconds] each (step_graphs on)
    return own


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="zimage", choices=list(gpu_train.ARCH_VARIANTS))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=250, help="steps between checkpoints and between samples")
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--res", default="512,768,1024")
    parser.add_argument("--batch-by", default="images", choices=["images", "tokens"])
    parser.add_argument("--sample-size", type=int, default=1024)
    parser.add_argument("--sample-steps", type=int, default=0, help="0: the family's default")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument(
        "--timing",
        default="events",
        choices=["events", "sync"],
        help="step ends by CUDA events (no sync added: the host runs ahead as in a user's run) or after a synchronize",
    )
    parser.add_argument(
        "--compile-dynamic",
        default="default",
        choices=["default", "dynamo", "true"],
        help="default: Kiln's (checkpointing.MARK_TOKEN_DIMS: the blocks' sequence dims symbolic from "
        "the first compile); dynamo: dynamo's own policy (static at the first shape, symbolic "
        "from the second); true: every dim symbolic from the first compile",
    )
    parser.add_argument(
        "--settings",
        default="",
        help="Kiln config overrides as bench/gpu_train.py's rows take them, e.g. cuda_graphs=on+checkpoint_budget=0.5",
    )
    parser.add_argument(
        "--trainer",
        default="kiln",
        choices=TRAINERS,
        help="kiln (its defaults, or --settings); native: ComfyUI's Train LoRA node in bucket mode; "
        "diffusers / diffusers-compiled: diffusers' transformer + PEFT LoRA "
        "(bench/wall_peers.py)",
    )
    parser.add_argument(
        "--native-ckpt-depth",
        type=int,
        default=2,
        help="the native node's checkpoint_depth (2: per block, as bench/gpu_train.py's rows; 1, the "
        "node's default, checkpoints the whole model as one)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny dims on the same path (CPU is fine)")
    parser.add_argument("--card-gb", type=float, metavar="G", help="act as a G GiB card (bench/gpu_train.py's)")
    parser.add_argument("--out", required=True, help="JSON list to append the record to")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    record = run(args)
    gpu_train.append_records(Path(args.out), [record])
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
