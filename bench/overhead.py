"""Kiln's per-step overhead on CPU: the real training loop against a plain hand-written PyTorch loop.

All variants train a LoRA on the demo's tiny Flux2-shaped DiT (`build_tiny_flux(seed)`, fp32) with
the demo's batch shapes: 12 cached items in two buckets (8 latents [16,16,16] and 4 [16,12,16], the
demo's 128×128 and 128×96 images), [8,32] text contexts, batch 2, rank 16 on the demo arch's default
targets, AdamW (foreach), the same number of steps.

- kiln:   `trainer.run.loop.train`, torch backend, the demo's config (`demo_config`, as `demo --steps N`
          makes it): gradient checkpointing, EMA, clipping at 1.0, cosine warm-up, a checkpoint
          every 50 steps.
- plain:  a hand-written loop: LoRA A, B (fp32) as a minimal inline side branch on the same Linears;
          per step stack the batch, draw sigmas, noise and caption dropout from one numpy generator
          (the draws Kiln makes, so the same cost), forward, MSE to ε − x0, backward, AdamW step,
          zero_grad. It replays the batch order Kiln's sampler gives (drawn before timing), so both
          see the same shapes in the same order.
- plain_same_work: the plain loop plus what the demo config adds, written the plain way:
          torch.utils.checkpoint around each block, clip_grad_norm_, an EMA lerp.
- lean:   Kiln with those extras off (no recompute, no EMA, max_grad_norm 0, checkpoint only at the end).

`ratio` = kiln / plain (the figure asked for); `same_work_ratio` = kiln / plain_same_work and
`lean_ratio` = lean / plain isolate what the loop and backend cost by themselves: watch those two
for overhead regressions, since `ratio` is dominated by the recompute the demo config asks for.

A step's time is the interval between consecutive step ends (Kiln: its `on_step` calls, so all the
loop does per step counts); the first `warmup` steps are dropped and the median taken per run; a
figure is the median over `rounds` runs. By default (`--mode paired`) the loops run interleaved
step by step: after each Kiln step, inside its `on_step`, each plain loop takes one step (timed
apart), so all see the same load from other processes. `--mode separate` runs whole runs one after
another instead, the order rotated per round. On a busy machine use `--threads 1 --clock cpu`
(process CPU time: the work itself, nearly blind to other processes). Nothing here is a test:
speed lives in bench/, never in tests/.

Run: python bench/overhead.py [--steps 80 --warmup 10 --rounds 3] [--threads 1 --clock cpu] [--no-save]
     python bench/overhead.py --profile {cprofile,torch} [--steps 40]
Prints one JSON record and appends it to bench/results_cpu.json (a JSON list).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.archs import get_arch  # noqa: E402
from trainer.data import InMemoryData  # noqa: E402
from trainer.data.sampler import BucketSampler  # noqa: E402
from trainer.demo.run import CONTEXT_DIM, CONTEXT_TOKENS, LATENT_CHANNELS, demo_config  # noqa: E402
from trainer.demo.tiny_dit import build_tiny_flux  # noqa: E402
from trainer.run.loop import train  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results_cpu.json"

# The clock steps are timed with: wall time, or this process's CPU time (with one torch thread that is
# the work itself, nearly blind to other processes on a shared machine).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]

# What a plain loop lacks, switched off in Kiln for the "lean" variant.
LEAN = dict(gradient_checkpointing=False, ema=False, max_grad_norm=0.0, checkpoint_every=0)


def bench_data(seed: int = 0) -> InMemoryData:
    """The demo's layout: 8 latents of a 128×128 image, 4 of a 128×96 one, [8,32] contexts."""
    rng = np.random.default_rng(seed)
    shapes = [(16, 16) if i % 3 else (12, 16) for i in range(12)]  # (H, W) latent cells, as make_images
    latents = [rng.standard_normal((LATENT_CHANNELS, *hw)).astype(np.float32) for hw in shapes]
    contexts = [rng.standard_normal((CONTEXT_TOKENS, CONTEXT_DIM)).astype(np.float32) for _ in shapes]
    return InMemoryData.from_arrays(
        latents,
        contexts,
        [f"shape_{i:02d}.png" for i in range(len(shapes))],
        np.zeros((CONTEXT_TOKENS, CONTEXT_DIM), np.float32),
    )


def bench_config(steps: int, lean: bool = False, **overrides):
    """The demo's config (as `demo --steps N` makes it: warm-up a tenth of the run)."""
    settings = dict(steps=steps, warmup_steps=max(1, steps // 10))
    if lean:
        settings.update(LEAN)
    return demo_config(**{**settings, **overrides})


def _intervals(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:])]


# --- Kiln ---------------------------------------------------------------------------------
def run_kiln(steps: int, lean: bool = False, run_dir: Path | None = None, **overrides):
    """trainer.run.loop.train on a fresh demo model; (seconds per step for steps 2..N, RunResult)."""
    cfg = bench_config(steps, lean, **overrides)
    stamps: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        result = train(
            cfg,
            build_tiny_flux(cfg.seed),
            bench_data(),
            run_dir=run_dir or Path(tmp) / "run",
            on_step=lambda report: stamps.append(clock()),
        )
    return _intervals(stamps), result


# --- the plain loop -----------------------------------------------------------------------
def add_plain_lora(model: nn.Module, targets, rank: int, alpha: float, seed: int = 0) -> dict[str, tuple]:
    """y = base(x) + (α/r)·B(A(x)) on every Linear matching a target (exact name or dotted suffix)."""
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    scale = alpha / rank
    lora = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not any(name == t or name.endswith("." + t) for t in targets):
            continue
        bound = 1.0 / math.sqrt(module.in_features)
        A = nn.Parameter(torch.empty(rank, module.in_features).uniform_(-bound, bound, generator=generator))
        B = nn.Parameter(torch.zeros(module.out_features, rank))

        def forward(x, base=module.forward, A=A, B=B):
            return base(x) + F.linear(F.linear(x, A), B) * scale

        module.forward = forward
        lora[name] = (A, B)
    return lora


class PlainLoop:
    """The hand-written loop, one `step()` at a time (so it can run in lockstep with Kiln's).

    same_work=True adds what the demo config makes Kiln do beyond a minimal loop, written the
    plain way: torch.utils.checkpoint around every block, global-norm clipping at max_grad_norm
    and an EMA of the LoRA weights (one foreach lerp).
    """

    def __init__(self, steps: int, seed: int | None = None, same_work: bool = False):
        cfg = bench_config(steps)
        seed = cfg.seed if seed is None else seed
        self.data, self.caption_dropout = bench_data(), cfg.caption_dropout
        sampler = BucketSampler(self.data.buckets, cfg.batch_size, seed)
        self.order = [sampler.next() for _ in range(steps)]  # the batch order Kiln draws
        self.model = build_tiny_flux(seed)
        arch = get_arch(cfg.arch)
        self.lora = add_plain_lora(self.model, arch.default_targets, cfg.rank, cfg.alpha, seed)
        self.params = [p for pair in self.lora.values() for p in pair]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=cfg.learning_rate,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            foreach=True,
        )
        self.same_work, self.max_grad_norm, self.ema_decay = same_work, cfg.max_grad_norm, cfg.ema_decay
        if same_work:
            for block in (b for name in arch.block_lists for b in getattr(self.model, name)):
                block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
            self.shadow = [p.detach().clone() for p in self.params]
        self.rng = np.random.default_rng(seed)
        self.done, self.losses = 0, []

    def step(self) -> None:
        data, rng, indices = self.data, self.rng, self.order[self.done]
        latents = np.stack([data.latent(i) for i in indices])
        sigmas = rng.random(len(indices)).astype(np.float32)  # uniform σ, as the demo arch
        noise = rng.standard_normal(latents.shape, dtype=np.float32)
        drop = rng.random(len(indices)) < self.caption_dropout
        context = np.stack([data.empty_context() if d else data.context(i) for i, d in zip(indices, drop)])
        x0, eps, sigma = torch.from_numpy(latents), torch.from_numpy(noise), torch.from_numpy(sigmas)
        s = sigma.view(-1, 1, 1, 1)
        prediction = self.model((1 - s) * x0 + s * eps, sigma, torch.from_numpy(context))
        loss = (prediction - (eps - x0)).square().mean()
        loss.backward()
        if self.same_work:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.same_work:
            with torch.no_grad():
                torch._foreach_lerp_(self.shadow, self.params, 1.0 - self.ema_decay)
        self.losses.append(loss.detach())
        self.done += 1


def run_plain(steps: int, seed: int | None = None, same_work: bool = False):
    """The hand-written loop alone; (seconds per step for steps 2..N, losses, {path: (A, B)})."""
    plain = PlainLoop(steps, seed, same_work)
    stamps = []
    for _ in range(steps):
        plain.step()
        stamps.append(clock())
    return _intervals(stamps), [float(v) for v in plain.losses], plain.lora


def run_paired(steps: int, lean: bool = False, same_work: tuple[bool, ...] = (False,), **overrides):
    """Kiln in lockstep with plain loops: after each Kiln step (in its on_step) each plain loop takes
    one step, so all see the same load from whatever else runs on the machine. Returns
    (Kiln seconds per step, [seconds per step of each plain loop]), steps 2..N of each."""
    cfg = bench_config(steps, lean, **overrides)
    plains = [PlainLoop(steps, same_work=flag) for flag in same_work]
    kiln_times, plain_times, resumed = [], [[] for _ in plains], [None]

    def on_step(report) -> None:
        now = clock()
        if resumed[0] is not None:
            kiln_times.append(now - resumed[0])  # from the end of the last plain step to this step's end
        for plain, times in zip(plains, plain_times):
            started = clock()
            plain.step()
            if plain.done > 1:
                times.append(clock() - started)
        resumed[0] = clock()

    with tempfile.TemporaryDirectory() as tmp:
        train(cfg, build_tiny_flux(cfg.seed), bench_data(), run_dir=Path(tmp) / "run", on_step=on_step)
    return kiln_times, plain_times


# --- measuring ----------------------------------------------------------------------------
def median_after_warmup(times: list[float], warmup: int) -> float:
    kept = times[max(0, warmup - 1) :]  # times[0] is step 2
    return statistics.median(kept)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def commit() -> str:
    try:
        return _git("rev-parse", "--short=12", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def modified_trainer_files() -> list[str]:
    """Files under trainer/ that differ from the commit (the record then does not describe the commit alone)."""
    try:
        return [line[3:] for line in _git("status", "--porcelain", "--", "trainer").splitlines()]
    except (OSError, subprocess.CalledProcessError):
        return []


def loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def measure(steps: int, warmup: int, rounds: int, mode: str = "paired", clock_name: str = "wall") -> dict:
    """Median s/step of each run after warm-up; each figure is the median over its runs.

    paired:   per round, Kiln (demo config) in lockstep with a plain and a same-work plain loop,
              then lean Kiln in lockstep with a plain loop.
    separate: per round, whole runs of each variant one after another, the order rotated.
    """
    global clock
    clock = CLOCKS[clock_name]
    runs: dict[str, list[float]] = {"kiln": [], "lean": [], "plain": [], "plain_same_work": []}
    load_before = loadavg()
    run_paired(min(steps, 12), same_work=(False, True))  # warm the process (imports, allocator, kernels)
    for r in range(rounds):
        if mode == "paired":
            kiln, (plain, same) = run_paired(steps, same_work=(False, True))
            lean, (plain_lean,) = run_paired(steps, lean=True)
            for name, times in (
                ("kiln", kiln),
                ("plain", plain),
                ("plain_same_work", same),
                ("lean", lean),
                ("plain", plain_lean),
            ):
                runs[name].append(median_after_warmup(times, warmup))
        else:
            runners = {
                "kiln": lambda: run_kiln(steps)[0],
                "lean": lambda: run_kiln(steps, lean=True)[0],
                "plain": lambda: run_plain(steps)[0],
                "plain_same_work": lambda: run_plain(steps, same_work=True)[0],
            }
            names = list(runners)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].append(median_after_warmup(runners[name](), warmup))
    kiln, lean, plain, same = (statistics.median(runs[n]) for n in ("kiln", "lean", "plain", "plain_same_work"))
    cfg = bench_config(steps)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "trainer_modified": modified_trainer_files(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "loadavg_before_after": [load_before, loadavg()],
        "model": f"build_tiny_flux({cfg.seed}): hidden 96, 2+2 blocks, fp32",
        "batch": cfg.batch_size,
        "rank": cfg.rank,
        "latents": "[16,16,16] x8 + [16,12,16] x4, context [8,32]",
        "kiln_config": "demo_config: checkpointing on, EMA on, clip 1.0, cosine warm-up, checkpoint every 50",
        "mode": mode,
        "clock": clock_name,
        "steps": steps,
        "warmup": warmup,
        "rounds": rounds,
        "kiln_s_per_step": round(kiln, 6),
        "plain_s_per_step": round(plain, 6),
        "ratio": round(kiln / plain, 4),
        "plain_same_work_s_per_step": round(same, 6),
        "same_work_ratio": round(kiln / same, 4),
        "kiln_lean_s_per_step": round(lean, 6),
        "lean_ratio": round(lean / plain, 4),
        "lean": "kiln with " + ", ".join(f"{k}={v}" for k, v in LEAN.items()),
        "runs_s_per_step": {n: [round(v, 6) for v in values] for n, values in runs.items()},
    }


def append(record: dict, path: Path = RESULTS) -> None:
    records = json.loads(path.read_text()) if path.exists() else []
    records.append(record)
    path.write_text(json.dumps(records, indent=1) + "\n")


def profile(steps: int, tool: str, out: Path | None) -> None:
    """Profile one run of each variant (after a warm-up run): cProfile (Python) or torch.profiler (ops)."""
    import cProfile
    import pstats

    variants = {
        "kiln": lambda: run_kiln(steps),
        "kiln_lean": lambda: run_kiln(steps, lean=True),
        "plain": lambda: run_plain(steps),
        "plain_same_work": lambda: run_plain(steps, same_work=True),
    }
    for name, fn in variants.items():
        fn()
        print(f"===== {name}: {steps} steps, {tool}")
        if tool == "torch":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                fn()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            if out is not None:
                prof.export_chrome_trace(str(out / f"{name}.trace.json"))
        else:
            prof = cProfile.Profile()
            prof.enable()
            fn()
            prof.disable()
            stats = pstats.Stats(prof)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(40)
            if out is not None:
                stats.dump_stats(str(out / f"{name}.prof"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=80, help="steps per run (default 80)")
    parser.add_argument("--warmup", type=int, default=10, help="steps dropped at the start of each run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of each variant")
    parser.add_argument(
        "--mode",
        choices=["paired", "separate"],
        default="paired",
        help="paired: Kiln and the plain loop in lockstep, step by step (robust to other load); "
        "separate: whole runs one after another",
    )
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall: perf_counter; cpu: process CPU time (use with --threads 1 on a busy machine)",
    )
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--no-save", action="store_true", help=f"print only; do not append to {RESULTS.name}")
    parser.add_argument(
        "--profile",
        choices=["cprofile", "torch"],
        help="instead of measuring: profile one run of each variant with this tool",
    )
    parser.add_argument("--profile-dir", type=Path, help="with --profile: also write .prof / trace files here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        profile(args.steps, args.profile, args.profile_dir)
        return 0
    if args.warmup >= args.steps - 1:
        parser.error("--warmup must leave steps to time")
    record = measure(args.steps, args.warmup, args.rounds, args.mode, args.clock)
    print(json.dumps(record, indent=1))
    if not args.no_save:
        append(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
