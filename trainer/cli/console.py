"""The console front end of a run: a progress bar, Ctrl-C as a clean stop, and the files a finished
run leaves (LoRA, loss curve) with a summary. Used by `python -m trainer` and headless.py."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from ..run.callbacks import Callbacks

# With KILN_PROGRESS_JSON=1 rank 0 also prints one machine-readable line per step, one per validation sample
# written, one when the ranks pause and when they go on, and one at the end (`KILN_PROGRESS {json}`,
# `KILN_SAMPLE {json}`, `KILN_PAUSED {json}`, `KILN_DONE {json}`), read by trainer/cli/launch.py instead of
# scraping tqdm.
PROGRESS_ENV, PROGRESS_TAG, DONE_TAG = "KILN_PROGRESS_JSON", "KILN_PROGRESS", "KILN_DONE"
SAMPLE_TAG = "KILN_SAMPLE"
PAUSED_TAG = "KILN_PAUSED"  # {"paused": bool, "step": n}: every rank waits (or goes on) after step n
PLAN_TAG = "KILN_PLAN"  # {"lines": [...]}: before the first step, the memory plan and what each auto setting chose
# A file of this name in the run folder asks the run to stop after a step with a checkpoint (trainer/cli/launch.py
# writes it; `touch <run>/stop.request` does the same by hand). The run removes it when it has stopped.
STOP_FILE = "stop.request"


def emit(tag: str, fields: dict) -> None:
    """One machine-readable line on stdout (when KILN_PROGRESS_JSON=1), flushed at once."""
    if os.environ.get(PROGRESS_ENV) == "1":
        print(f"{tag} {json.dumps(fields)}", flush=True)


class StopOnSignal:
    """First Ctrl-C: finish the step, save a resumable checkpoint, stop. Second: abort at once.

    Under torchrun one Ctrl-C reaches a rank twice: from the terminal, and forwarded by torchrun, which
    then waits for its ranks before killing them; a second one within `echo_s` counts as that echo."""

    def __init__(self, echo_s: float = 0.0, speak: bool = True):
        self.requested, self.echo_s, self.speak, self.first = False, echo_s, speak, 0.0
        self.previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.requested and time.monotonic() - self.first > self.echo_s:
            raise KeyboardInterrupt
        if self.requested:
            return
        self.requested, self.first = True, time.monotonic()
        if self.speak:
            print(
                "\nstopping after this step; a resumable checkpoint will be saved (Ctrl-C again to abort)",
                file=sys.stderr,
            )

    def __call__(self) -> bool:
        return self.requested

    def close(self):
        signal.signal(signal.SIGINT, self.previous)


class StopFile:
    """True once `<run>/stop.request` exists (checked at each step boundary: one stat). Under torchrun every
    rank looks; the loop's vote (distributed.StopVote) makes them stop after the same step."""

    def __init__(self, run_dir: Path, speak: bool = True):
        self.path, self.speak, self.seen = Path(run_dir) / STOP_FILE, speak, False

    def __call__(self) -> bool:
        if not self.seen and self.path.exists():
            self.seen = True
            if self.speak:
                print(
                    f"\nstop requested ({self.path}): stopping after a step with a resumable checkpoint",
                    file=sys.stderr,
                )
        return self.seen

    def consume(self) -> None:
        """Remove the request once the run has ended (rank 0, after the checkpoint every rank waited for), so
        that resuming the run does not stop it again."""
        self.path.unlink(missing_ok=True)


class Console(Callbacks):
    """The console's front end of a run: a tqdm bar (and KILN_PROGRESS lines), Ctrl-C or <run>/stop.request
    as a clean stop, <run>/PAUSE as a pause; validation is `validation`'s (headless.py's samples), if any.
    Under torchrun every rank has one; rank 0 alone (`speak`) shows and says anything."""

    def __init__(
        self,
        cfg,
        run_dir: Path,
        start: int,
        world: int,
        speak: bool,
        stop_after: int | None = None,
        validation: Callbacks | None = None,
        should_pause=None,
    ):
        from tqdm import tqdm

        from ..run.pause import file_flag

        self.run_dir, self.speak, self.stop_after = Path(run_dir), speak, stop_after
        self.bar = tqdm(total=cfg.steps, initial=start, unit="step", dynamic_ncols=True, disable=not speak)
        self.signal = StopOnSignal(echo_s=2.0 if world > 1 else 0.0, speak=speak)
        self.stop_file = StopFile(run_dir, speak)
        self.paused_flag = should_pause or file_flag(run_dir)
        self.validation = validation or Callbacks()
        self.validate_every, self.validate_first = self.validation.validate_every, self.validation.validate_first

    def on_start(self, plan: list[str]) -> None:
        """The memory plan and the auto choices (sharding, streaming, compile) on stderr, above the bar: the
        headless run has no log handler, so without this a user never learns what auto chose."""
        if self.speak:
            for line in plan:
                self.bar.write(f"[Kiln] {line}", file=sys.stderr)
            emit(PLAN_TAG, {"lines": plan})

    def on_step(self, report) -> None:
        bar = self.bar
        bar.update(report.step - bar.n)
        if report.loss is not None:
            bar.set_postfix(loss=f"{report.loss:.4f}", smooth=f"{report.loss_smooth:.4f}", lr=f"{report.lr:.2e}")
        if self.speak:
            emit(
                PROGRESS_TAG,
                {
                    "step": report.step,
                    "total": report.total_steps,
                    "loss": report.loss,
                    "loss_smooth": report.loss_smooth,
                    "lr": report.lr,
                    "it_per_s": report.it_per_s,
                    "eta_s": report.eta_s,
                    "peak_memory_bytes": report.peak_memory_bytes,
                    "skipped_steps": report.skipped_steps,
                    **({"peak_memory_per_gpu": report.peak_memory_per_rank} if report.peak_memory_per_rank else {}),
                },
            )

    def validate(self, step: int, lora):
        return self.validation.validate(step, lora)

    def should_stop(self) -> bool:
        return self.signal() or self.stop_file() or bool(self.stop_after and self.bar.n >= self.stop_after)

    def should_pause(self) -> bool:
        return self.paused_flag()

    def on_pause(self, paused: bool) -> None:
        """Says when every rank has paused and when they go on (rank 0 alone), as text and a KILN_PAUSED line."""
        from ..run.pause import PAUSE_FILE

        if not self.speak:
            return
        print(
            f"\npaused after step {self.bar.n}: delete {self.run_dir / PAUSE_FILE} to resume (Ctrl-C stops)"
            if paused
            else "pause over",
            file=sys.stderr,
            flush=True,
        )
        emit(PAUSED_TAG, {"paused": paused, "step": self.bar.n})

    def close(self) -> None:
        self.signal.close()
        self.bar.close()


def start_step(run_dir: Path, resume) -> int:
    """The step a run starts at: its newest checkpoint's with `resume` (when it has one), else 0."""
    from ..run.state import list_checkpoints

    found = list_checkpoints(run_dir) if resume else []
    return found[-1][0] if found else 0


def run_loop(
    cfg,
    model,
    data,
    *,
    run_dir: Path,
    resume,
    stop_after: int | None = None,
    forward=None,
    validation: Callbacks | None = None,
    should_pause=None,
):
    """loop.train with the Console front end; `resume` true continues the run's newest checkpoint. The demo,
    `train` and headless.py (through nodes/comfy, with its validation samples as `validation`) run this."""
    from ..run import distributed
    from ..run.loop import train

    group = distributed.start(cfg.device, cfg.backend)  # idempotent: under torchrun, rank 0 speaks for the run
    main = group.is_main
    if main:  # from the first step, `touch <run>/PAUSE` and `<run>/stop.request` have a folder to go in
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    start = start_step(run_dir, resume)
    for problem in getattr(data, "skipped", []) if main else []:
        print(f"skipped {problem.line()}", file=sys.stderr)
    console = Console(cfg, run_dir, start, group.world, main, stop_after, validation, should_pause)
    try:
        result = train(
            cfg, model, data, run_dir=run_dir, resume=run_dir if start else None, forward=forward, callbacks=console
        )
        if main:
            console.stop_file.consume()
        return result
    finally:
        console.close()


def finish(cfg, result, run_dir: Path, name: str) -> None:
    """The run's LoRA (EMA weights when on) and loss curve written beside its checkpoints, and a summary;
    under torchrun by rank 0 alone (every rank holds the same LoRA)."""
    from ..archs import get_arch
    from ..run import distributed

    if not distributed.current().is_main:
        return
    from ..lora.files import lora_metadata, save_lora
    from ..run.plot import save_loss_curve
    from ..samples.plan import SAMPLES_DIR

    lora = result.ema_lora if result.ema_lora is not None else result.lora
    lora_path, metadata = run_dir / f"{name}.safetensors", lora_metadata(cfg, get_arch(cfg.arch), result.step)
    if result.model is not None:  # adapter full: a diffusion-model file (Load Diffusion Model), not a LoRA
        from ..lora.model_file import save_diffusion_model

        save_diffusion_model(lora_path, result.model, dtype=cfg.save_dtype, metadata=metadata)
    else:
        save_lora(
            lora_path, lora, arch=get_arch(cfg.arch), fmt=cfg.lora_format, dtype=cfg.save_dtype, metadata=metadata
        )
    curve = save_loss_curve(run_dir / "loss.png", result.history.loss, result.history.lr, title=f"{name}: loss")
    losses = [v for v in result.history.loss if v == v and abs(v) != float("inf")]
    print(
        f"{'stopped' if result.stopped else 'finished'} at step {result.step}/{cfg.steps}; "
        f"trainable parameters {result.trainable_parameters:,}"
    )
    for entry in result.history.skipped:
        print(f"skipped step {entry['step']} (NaN/inf loss or gradient): {', '.join(entry['items'])}")
    if losses:
        head, tail = losses[: max(1, len(losses) // 10)], losses[-max(1, len(losses) // 10) :]
        print(f"loss: first 10% mean {sum(head) / len(head):.4f} -> last 10% mean {sum(tail) / len(tail):.4f}")
    kind = "diffusion model" if result.model is not None else "LoRA"
    print(f"{kind} ({'EMA' if cfg.ema else 'raw'} weights): {lora_path}")
    print(f"loss curve: {curve}")
    if result.best is not None:
        early = "stopped early (early_stop_patience); " if result.early_stopped else ""
        print(
            f"held-out loss: {early}best {result.best.loss:.4f} at step {result.best.step}, its LoRA: "
            f"{result.best_lora}"
        )
    samples = sorted((run_dir / SAMPLES_DIR).glob("step-*.png"))
    if samples:
        print(f"samples ({len(samples)}, newest {samples[-1].name}): {run_dir / SAMPLES_DIR}")
    from ..run.state import list_checkpoints

    newest = result.checkpoint or next((path for _, path in list_checkpoints(run_dir)[-1:]), None)
    print(f"checkpoint (resume with --resume): {newest}")
    emit(
        DONE_TAG,
        {
            "lora": str(lora_path),
            "checkpoint": str(newest) if newest else None,
            "step": result.step,
            "total": cfg.steps,
            "stopped": bool(result.stopped),
            "best_lora": str(result.best_lora) if result.best_lora else None,
        },
    )
