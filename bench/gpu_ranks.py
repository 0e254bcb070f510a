"""bench/gpu_train.py under torchrun (issue 46, item 1): the full-size several-GPU bench.

    torchrun --standalone --nproc_per_node N bench/gpu_train.py --rows zimage:1024:1:on:default --no-native ...

Every rank builds the same random-weight model (gpu_train.build_model, the same seed on each) and trains it
through Kiln's own distributed path (trainer.run.distributed: DDP over the LoRA, each rank its share of every
global batch; the base replicated or sharded as the row's `sharding=` setting says, default auto). A row's
batch is the batch per GPU (b); the global batch is b·N, and every pass trains on the same b·N images.

Passes of one row, in one job (the model built once per process):
  1. alone (`--baseline alone`, the default): rank 0 trains by itself at batch b while the other ranks wait at
     a host barrier: one GPU's images/s, measured on the same build, GPU and clocks as the N-rank pass, so the
     efficiency is not a comparison across jobs. `--baseline FILE` takes that figure from a one-process record
     of the same arch, resolution, batch and settings in FILE instead (for a model whose one-card pass is the
     host-streaming row, which takes its own job); `--baseline none` skips it.
  2. curve (`--curve on`, the default): rank 0 alone at the global batch b·N: the loss curve one process
     with the same global batch trains (the same draws: the seeded sampler deals the same global batches), and
     its relative difference from the N-rank curve. Off for a model that does not fit one card.
  3. the N ranks together: s/step and the record (rank 0 writes it).
Record fields beyond a one-process record's: world_size, sharding (replicate | shard: what the base was),
global_batch, images_per_s, one_gpu_images_per_s, scaling_efficiency (images/s on N over N x one GPU's),
baseline, peak_alloc_gb_per_gpu and peak_reserved_gb_per_gpu (every rank's, gathered), one_process_loss_curve
and loss_rel_diff_vs_one_process, host_noise_ms_share / _global (rank 0's host drawing its share's noise, and the
whole global batch's as every rank does: where a shortfall from N x one GPU may go). Native, peer and --uncapped are one-process comparisons: not run here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

ALONE_KEYS = ("kiln_s_per_step", "kiln_loss_curve", "peak_alloc_gb", "peak_reserved_gb", "kiln_error")


def world() -> int:
    """torchrun's process count (1 without torchrun: gpu_train.py's one-process bench, unchanged)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def add_arguments(parser, on_off) -> None:
    """gpu_train.py's options for a torchrun job (ignored by one process)."""
    parser.add_argument(
        "--baseline",
        default="alone",
        help="under torchrun: one GPU's images/s from rank 0 alone first (alone), from a one-process record in "
        "FILE, or none (bench/gpu_ranks.py)",
    )
    parser.add_argument(
        "--curve", type=on_off, default=True, help="under torchrun: rank 0 alone at the global batch too (on/off)"
    )


def check_arguments(parser, args) -> int:
    """torchrun's process count, after refusing the one-process comparisons under torchrun."""
    if world() > 1 and (args.uncapped or args.peer or args.merge):
        parser.error("under torchrun the bench times Kiln's N ranks: --uncapped, --peer and --merge run in one process")
    return world()


def options(args) -> dict:
    return {"baseline": args.baseline, "curve": args.curve}


def pick_device(device_kind: str) -> None:
    """Each rank its own GPU (LOCAL_RANK), before ComfyUI's model management picks one."""
    if device_kind == "cuda":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


@contextlib.contextmanager
def alone(distributed):
    """This rank trains as one process (Kiln's distributed helpers see no group) while the group stays up."""
    saved = distributed.current, distributed._torchrun_world
    distributed.current, distributed._torchrun_world = (lambda: distributed.SINGLE), (lambda: 1)
    try:
        yield
    finally:
        distributed.current, distributed._torchrun_world = saved


def images_per_s(batch: int, s_per_step: float | None) -> float | None:
    return batch / s_per_step if s_per_step else None


def efficiency(together: float | None, one_gpu: float | None, ranks: int) -> float | None:
    """images/s on `ranks` GPUs over `ranks` x one GPU's images/s (1.0: perfect scaling)."""
    return together / (ranks * one_gpu) if together and one_gpu else None


def curve_difference(curve: list | None, reference: list | None) -> float | None:
    """The largest relative difference between two loss curves, point by point (None without both)."""
    pairs = [(a, b) for a, b in zip(curve or [], reference or []) if a is not None and b]
    return max((abs(a - b) / abs(b) for a, b in pairs), default=None)


def gathered(distributed, record: dict, keys=("peak_alloc_gb", "peak_reserved_gb")) -> dict:
    """Every rank's `keys` figures (None as NaN on the wire), in rank order: {key_per_gpu: [...]}."""
    mine = {key: np.asarray([np.nan if record.get(key) is None else record[key]], np.float64) for key in keys}
    ranks = distributed.gather_arrays(mine)
    return {f"{key}_per_gpu": [None if np.isnan(r[key][0]) else float(r[key][0]) for r in ranks] for key in keys}


def baseline_from(path: Path, row, resolution_batch: tuple[int, int]) -> dict | None:
    """The newest one-process record in `path` of this row (arch, resolution, batch, targets, settings)."""
    resolution, batch = resolution_batch
    for record in reversed(json.loads(Path(path).read_text(encoding="utf-8"))):
        same = (record.get("arch"), record.get("resolution"), record.get("batch"), record.get("targets"))
        if (
            same == (row.arch, resolution, batch, row.targets)
            and record.get("world_size", 1) == 1
            and one_process(record.get("kiln_settings") or {}) == one_process(row.settings)
            and record.get("kiln_s_per_step")
        ):
            return record
    return None


def one_process(settings: dict) -> dict:
    """A row's settings as a one-process pass runs them: no sharding (one process has none to choose)."""
    return {k: v for k, v in settings.items() if k not in ("bench_images", "sharding")}


def sharded(patcher) -> str:
    """What the base was in the N-rank pass: shard where its blocks became FSDP2 units (they stay so)."""
    return "shard" if any(hasattr(m, "unshard") for m in patcher.model.diffusion_model.modules()) else "replicate"


def noise_ms(arch_name: str, resolution: int, count: int, reps: int = 10) -> float:
    """Host milliseconds to draw the noise of `count` latents (the median of `reps`): what every rank pays per
    step to draw the whole global batch's noise (trainer/run/loop.build_batch keeps one numpy stream in lockstep
    on every rank, and a normal draw cannot skip ahead), against its own share's."""
    from trainer.archs import get_arch

    arch = get_arch(arch_name)
    side = resolution // arch.latent_downscale
    rng, times = np.random.default_rng(0), []
    for _ in range(reps):
        started = time.perf_counter()
        rng.standard_normal((count, arch.latent_channels, side, side), dtype=np.float32)
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e3, 3)


def record_of(together: dict, row, ranks: int, solo: dict | None, curve: dict | None, baseline: str) -> dict:
    """The N-rank pass's record with the several-GPU figures (pure: the CPU tests build it from figures)."""
    batch = row.batch * ranks
    mine = images_per_s(batch, together.get("kiln_s_per_step"))
    one = images_per_s(row.batch, (solo or {}).get("kiln_s_per_step"))
    reference = (curve or {}).get("kiln_loss_curve")
    return {
        **together,
        "world_size": ranks,
        "global_batch": batch,
        "images_per_s": _round(mine),
        "one_gpu_images_per_s": _round(one),
        "scaling_efficiency": _round(efficiency(mine, one, ranks)),
        "baseline": baseline if one else None,
        **({f"one_gpu_{k}": solo.get(k) for k in ALONE_KEYS} if solo else {}),
        "one_process_loss_curve": reference,
        "loss_rel_diff_vs_one_process": _round(curve_difference(together.get("kiln_loss_curve"), reference), 6),
    }


def _round(value, digits: int = 4):
    return None if value is None else round(value, digits)


def run_row(row, dims, models: dict, key: str, opts, run_row_once) -> dict | None:
    """The row's passes (module doc) on models[key]; the record on rank 0, None on the others. `run_row_once`:
    gpu_train's. A sharded model leaves `models` (its blocks stay FSDP2 units: the next row builds its own)."""
    distributed, ranks, model = opts.pack["distributed"], world(), models[key]
    images = {"bench_images": row.batch * ranks}
    one_rank = dataclasses.replace(row, settings={**one_process(row.settings), **images})
    main = distributed.current().is_main
    solo = curve = None
    if opts.baseline == "alone":
        solo = _alone(distributed, main, lambda: run_row_once(one_rank, dims, *model, opts))
    elif opts.baseline != "none":
        solo = baseline_from(Path(opts.baseline), row, (row.resolution, row.batch))
    if opts.curve:
        global_row = dataclasses.replace(one_rank, batch=row.batch * ranks)
        curve = _alone(distributed, main, lambda: run_row_once(global_row, dims, *model, opts))
    group_row = dataclasses.replace(row, settings={**row.settings, **images})
    together = run_row_once(group_row, dims, *model, opts)
    figures = gathered(distributed, together)
    together.update(figures, sharding=sharded(model[0]))
    if together["sharding"] == "shard":
        models.pop(key)
    baseline = "alone" if opts.baseline == "alone" else f"file:{opts.baseline}"
    if not main:
        return None
    host = {
        f"host_noise_ms_{k}": noise_ms(dims.arch, row.resolution, n)
        for k, n in (("share", row.batch), ("global", row.batch * ranks))
    }
    return {**record_of(together, row, ranks, solo, curve, baseline), **host}


def _alone(distributed, main: bool, run):
    """`run()` on rank 0 as one process, the other ranks waiting at the host barrier; rank 0's record."""
    result = None
    if main:
        with alone(distributed):
            result = run()
    distributed.barrier()
    return result
