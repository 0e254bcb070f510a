"""A headless run under torchrun as a child process: what ComfyUI's "Train LoRA (several GPUs)"
node starts, usable from any Python program.

The run's config is written to `<run>/launch.toml` (atomically), then `python -m torch.distributed.run --standalone
--nproc_per_node N -m trainer train <run>/launch.toml` starts in its own process group with `CUDA_VISIBLE_DEVICES`
set to the chosen GPUs, the pack root on PYTHONPATH and as cwd (so `-m trainer` is this pack's), and
`KILN_PROGRESS_JSON=1`: rank 0 prints one `KILN_PROGRESS {json}` line per step, a `KILN_SAMPLE {json}` line per
validation sample it wrote (step, prompt index, the PNG's path in `<run>/samples/`) and a `KILN_PLAN {json}` line
(the memory plan and what each auto setting chose) before the first step and one `KILN_DONE {json}` line at the end
(trainer/cli/console.py), which a reader thread parses. `stop()` writes `<run>/stop.request`: the ranks see it at a
step boundary, agree on the step (trainer/distributed.StopVote), save that step's checkpoint and exit 0, however
long the step and the save take. `pause(True)` writes `<run>/PAUSE` (and `pause(False)` removes it): the ranks agree
on the step to wait after, as on a stop, and rank 0 prints a `KILN_PAUSED {json}` line when they wait and when they
go on; a stop while paused still ends the run with a checkpoint. `stop(force=True)` is Ctrl-C (SIGINT to torchrun,
which forwards it to the ranks and kills them ~30 s later, torchrun's own window): the fallback where the file
cannot be written. Nothing here imports ComfyUI; the child never runs ComfyUI's main (for ComfyUI archs it loads
model files through headless.py, COMFYUI_PATH).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import config as config_module
from ..atomic import atomic_write_text
from ..config import files as config_file
from ..run.pause import PAUSE_FILE
from .console import (
    DONE_TAG,
    PAUSED_TAG,
    PLAN_TAG,
    PROGRESS_ENV,
    PROGRESS_TAG,
    SAMPLE_TAG,
    STOP_FILE,
)

PACK_ROOT = Path(__file__).resolve().parents[2]  # trainer/cli/launch.py → the pack root
CONFIG_NAME = "launch.toml"
STOP_WAIT_S = 120.0  # after stop(): how long the ranks may take to finish their step and save


@dataclass
class Outcome:
    """How a launched run ended: its LoRA and newest checkpoint (None when it wrote none)."""

    returncode: int
    lora: Path | None
    checkpoint: Path | None
    step: int
    stopped: bool
    tail: str  # the last lines of the run's output, for an error message


TAGS = {PROGRESS_TAG: "progress", SAMPLE_TAG: "sample", PAUSED_TAG: "paused", PLAN_TAG: "plan", DONE_TAG: "done"}


def parse_line(line: str) -> tuple[str, dict] | None:
    """("progress" | "sample" | "paused" | "plan" | "done", fields) for a machine-readable line, None for any
    other output. The tag may follow a progress bar's unterminated redraw (tqdm writes on stderr, merged into the
    same pipe)."""
    for tag, kind in TAGS.items():
        at = line.find(tag + " {")
        if at >= 0:
            try:
                return kind, json.loads(line[at + len(tag) + 1 :])
            except json.JSONDecodeError:
                return None
    return None


def gpu_list(text: str) -> list[int]:
    """'0,1' -> [0, 1]; '' -> [] (every GPU the machine shows)."""
    try:
        gpus = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(f"gpus {text!r}: write GPU indices separated by commas, e.g. '0,1'") from None
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(f"gpus {text!r}: indices must be distinct and not negative, e.g. '0,1'")
    return gpus


def command(config_path: Path, processes: int, resume: bool = False) -> list[str]:
    """torchrun (torch.distributed.run, its module) on one machine, a free port chosen by --standalone."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
        "-m",
        "trainer",
        "train",
        str(config_path),
        *(["--resume"] if resume else []),
    ]


def environment(gpus: list[int], comfyui_path: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env[PROGRESS_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(PACK_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("KILN_FAULT", None)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    if comfyui_path:
        env["COMFYUI_PATH"] = str(comfyui_path)
    return env


class Launch:
    """One torchrun run: `start()`, then `wait(on_progress, should_stop)`, or `stop()` from anywhere."""

    def __init__(
        self, config: dict, run_dir: str | Path, *, processes: int, gpus: str = "", comfyui_path: str | None = None
    ):
        if processes < 1:
            raise ValueError(f"processes {processes}: start at least one process (one per GPU)")
        self.gpus = gpu_list(gpus)
        if self.gpus and len(self.gpus) < processes:
            raise ValueError(
                f"gpus {gpus!r} names {len(self.gpus)} GPU(s) for {processes} processes: "
                "name one GPU per process, or fewer processes"
            )
        self.run_dir, self.processes, self.comfyui_path = Path(run_dir), processes, comfyui_path
        values = {**config, "output_dir": str(self.run_dir.parent), "run_name": self.run_dir.name}
        self.config = config_module.from_dict(values)  # validated here, before anything starts
        self.events: queue.Queue = queue.Queue()
        self.tail: deque[str] = deque(maxlen=60)
        self.done: dict | None = None
        self.stopping = self.closed = self.pausing = False
        self.process: subprocess.Popen | None = None

    def start(self, resume: bool = False) -> Launch:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.run_dir / CONFIG_NAME
        config_file.save(self.config, config_path)
        (self.run_dir / STOP_FILE).unlink(missing_ok=True)  # an earlier stop's request must not stop this run
        (self.run_dir / PAUSE_FILE).unlink(missing_ok=True)  # nor an earlier pause hold it
        self.process = subprocess.Popen(
            command(config_path, self.processes, resume),
            cwd=PACK_ROOT,
            env=environment(self.gpus, self.comfyui_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            start_new_session=True,
        )  # its own process group: ComfyUI's Ctrl-C is not the run's
        threading.Thread(target=self._read, name="kiln-launch-reader", daemon=True).start()
        return self

    def _read(self) -> None:
        for line in self.process.stdout:
            line = line.rstrip("\n")
            parsed = parse_line(line)
            if parsed is None:
                if line.strip():
                    self.tail.append(line)
                continue
            if parsed[0] == "done":
                self.done = parsed[1]
            self.events.put(parsed)
        self.closed = True
        self.events.put(("closed", {}))

    def stop(self, force: bool = False) -> None:
        """Ask every rank to stop after a step with a checkpoint: the stop file (no time limit), or with
        `force` (or where the file cannot be written) Ctrl-C to torchrun."""
        if self.process is None or self.process.poll() is not None or (self.stopping and not force):
            return
        self.stopping = True
        if not force:
            try:
                atomic_write_text(self.run_dir / STOP_FILE, "stop after this step with a checkpoint\n")
                return
            except OSError as error:
                self.tail.append(f"could not write {self.run_dir / STOP_FILE} ({error}); sending Ctrl-C instead")
        os.killpg(self.process.pid, signal.SIGINT)

    def pause(self, wanted: bool) -> None:
        """Ask every rank to wait after a step (the PAUSE file, written atomically), or to go on (removed)."""
        if wanted == self.pausing:
            return
        path = self.run_dir / PAUSE_FILE
        if wanted:
            atomic_write_text(path, "paused from the dashboard: delete this file to resume\n")
        else:
            path.unlink(missing_ok=True)
        self.pausing = wanted

    def wait(
        self,
        on_progress: Callable[[dict], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        poll_s: float = 0.25,
        on_sample: Callable[[dict], None] | None = None,
        should_pause: Callable[[], bool] | None = None,
        on_pause: Callable[[dict], None] | None = None,
        on_plan: Callable[[dict], None] | None = None,
    ) -> Outcome:
        """Runs `on_progress` for each step line, `on_sample` for each sample line, `on_pause` for each
        paused line and `on_plan` for the plan line, and polls `should_stop` and `should_pause` (the PAUSE file
        follows it), in the calling thread; the outcome. The PAUSE file is removed when the run has ended."""
        handlers = {"progress": on_progress, "sample": on_sample, "paused": on_pause, "plan": on_plan}
        while not (self.closed and self.events.empty()):  # a second wait() returns too
            try:
                kind, fields = self.events.get(timeout=poll_s)
            except queue.Empty:
                kind, fields = None, {}
            handler = handlers.get(kind)
            if handler is not None:
                handler(fields)
            if kind == "closed":
                break
            if should_stop is not None and not self.stopping and should_stop():
                self.stop()
            if should_pause is not None and not self.closed:
                self.pause(should_pause())
        try:
            code = self.process.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait()
        self.pause(False)  # a resumed run must not start paused
        return self.outcome(code)

    def outcome(self, code: int) -> Outcome:
        from ..run.state import list_checkpoints

        found = list_checkpoints(self.run_dir)
        newest = found[-1] if found else None
        done = self.done or {}
        lora = Path(done["lora"]) if done.get("lora") else None
        return Outcome(
            code,
            lora if lora is not None and lora.is_file() else None,
            newest[1] if newest else None,
            newest[0] if newest else 0,
            bool(done.get("stopped", self.stopping)),
            "\n".join(self.tail),
        )
