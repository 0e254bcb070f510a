"""The live dashboard's server side: a registry of training runs and the read-only HTTP answers about them.

Stdlib only (no ComfyUI, no torch), so its tests run anywhere; nodes/live.py feeds it from a running
Train LoRA node, and `add_routes` puts it on ComfyUI's server:

  GET  /kiln/runs              the runs this server has seen, newest first (summaries)
  GET  /kiln/runs/{id}         one run: figures, loss and learning-rate history, samples, buckets
  POST /kiln/runs/{id}/stop    ask the run to stop at the next step: it saves a resumable checkpoint, and the
                               nodes after Train LoRA are skipped (the run is not done: nothing saves it)
  POST /kiln/runs/{id}/stop_save  stop as /stop does, and let Train LoRA's outputs flow (Save LoRA writes the
                               LoRA as of that step)
  POST /kiln/runs/{id}/save    ask the run to write a LoRA of its current weights at the next step
  POST /kiln/runs/{id}/pause   ask the run to wait after the current step (memory kept; Stop still works;
                               a torchrun child run: its node writes <run>/PAUSE, every rank agrees)
  POST /kiln/runs/{id}/resume  let a paused run go on

Answers hold names and ids only, never file-system paths: a run's folder name, a LoRA's name under
models/loras, and samples as ComfyUI /view arguments (filename, subfolder, type).
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from dataclasses import dataclass, field

KEEP_RUNS = 16  # finished runs remembered for a reloaded page; running ones are never dropped
KEEP_SAMPLES = 12  # newest validation samples kept per run
MAX_POINTS = 1500  # history points in one answer; longer runs are thinned evenly
RUNNING, FINISHED, STOPPED, INTERRUPTED, FAILED = "running", "finished", "stopped", "interrupted", "error"


def _number(value) -> float | None:
    """A JSON-safe float: None for missing, NaN and inf (JSON has no NaN)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def thin(count: int, limit: int = MAX_POINTS) -> list[int]:
    """Indices of at most `limit` evenly spaced points of `count`, always keeping the first and the last."""
    if count <= limit:
        return list(range(count))
    stride = (count - 1) / (limit - 1)
    return sorted({round(i * stride) for i in range(limit)})


@dataclass
class Run:
    """One Train LoRA execution as the dashboard sees it. Updated from the training thread, read by
    the server's thread: every change and every answer happens under the registry's lock."""

    id: str
    name: str  # the run folder's name, e.g. "portrait" or "portrait-2"
    total: int
    folder: str = ""  # the run folder's path: its key (never in an answer)
    start_step: int = 0  # > 0 when the newest execution resumed from a checkpoint
    node: str | None = None  # the Train LoRA node's id in the queued prompt
    prompt_id: str | None = None  # the newest execution's prompt
    prompt_ids: list[str] = field(default_factory=list)  # every execution's prompt, oldest first
    arch: str = ""
    buckets: dict[str, int] = field(default_factory=dict)  # "WxH" → training entries
    status: str = RUNNING
    message: str = ""
    started: float = field(default_factory=time.time)  # when its newest execution began
    updated: float = field(default_factory=time.time)
    # +1 at every change: a page drops a summary older than one it applied (an action's HTTP answer can
    # arrive after the kiln.run event of what the training thread did next, e.g. Save now's save).
    rev: int = 0
    step: int = 0
    figures: dict = field(default_factory=dict)  # the newest step's lr, it/s, ETA, memory, loss
    steps: list[int] = field(default_factory=list)  # steps with a loss reading
    loss: list[float | None] = field(default_factory=list)
    lr_steps: list[int] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)  # {"step", "image": {filename, subfolder, type}}
    saved: list[dict] = field(default_factory=list)  # {"step", "name"} LoRAs written by Save now
    stop_requested: bool = False
    stop_saves: bool = False  # Stop & save: the outputs flow (a plain Stop blocks them)
    save_requested: bool = False
    can_save: bool = True  # False for a several-GPU run (its weights are in the child)
    pause_requested: bool = False
    paused: bool = False  # the loop waits now (every rank, for a torchrun run)
    holdout_steps: list[int] = field(default_factory=list)  # steps with a held-out loss (trainer/run/holdout.py)
    holdout: list[float | None] = field(default_factory=list)
    grid: dict | None = None  # the newest sample grid {"step", "image"}
    plan: list[str] = field(default_factory=list)  # the memory plan and auto choices, before the first step

    def summary(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "node": self.node,
            "prompt_id": self.prompt_id,
            "prompt_ids": list(self.prompt_ids),
            "arch": self.arch,
            "status": self.status,
            "message": self.message,
            "step": self.step,
            "total": self.total,
            "start_step": self.start_step,
            "started": self.started,
            "updated": self.updated,
            "rev": self.rev,
            "stop_requested": self.stop_requested,
            "stop_saves": self.stop_saves,
            "save_requested": self.save_requested,
            "can_save": self.can_save,
            "pause_requested": self.pause_requested,
            "paused": self.paused,
            "plan": list(self.plan),
        }

    def detail(self, max_points: int = MAX_POINTS) -> dict:
        keep = thin(len(self.steps), max_points)
        keep_lr = thin(len(self.lr_steps), max_points)
        return {
            **self.summary(),
            "figures": dict(self.figures),
            "buckets": dict(self.buckets),
            "history": {
                "step": [self.steps[i] for i in keep],
                "loss": [self.loss[i] for i in keep],
                "lr_step": [self.lr_steps[i] for i in keep_lr],
                "lr": [self.lr[i] for i in keep_lr],
                "holdout_step": list(self.holdout_steps),
                "holdout": list(self.holdout),
            },
            "samples": list(self.samples),
            "saved": list(self.saved),
            "grid": self.grid,
        }


def progress_payload(run: Run, report) -> dict:
    """The kiln.progress event for one step: the old fields (step, total, loss, ...) plus the run's id,
    node and status, so a page can tell runs apart and ask GET /kiln/runs/{id} for what it missed."""
    figures = {
        "lr": _number(report.lr),
        "loss": _number(report.loss),
        "loss_smooth": _number(report.loss_smooth),
        "it_per_s": _number(report.it_per_s),
        "eta_s": _number(report.eta_s),
        "peak_memory_bytes": int(report.peak_memory_bytes or 0),
        "holdout_loss": _number(getattr(report, "holdout_loss", None)),
        # several GPUs (the torchrun node): each GPU's peak, in rank order; [] for one process
        "peak_memory_per_gpu": [int(b) for b in getattr(report, "peak_memory_per_rank", None) or []],
    }
    return {
        "run_id": run.id,
        "run": run.name,
        "node": run.node,
        "prompt_id": run.prompt_id,
        "step": report.step,
        "total": report.total_steps,
        "started": run.started,
        "status": run.status,
        **figures,
    }


class Registry:
    """The runs of this ComfyUI process, by id. Thread-safe; forgets the oldest finished runs."""

    def __init__(self, keep: int = KEEP_RUNS):
        self.keep = keep
        self.lock = threading.Lock()
        self.runs: dict[str, Run] = {}
        self.stops_by_node: dict[str, int] = {}

    def start(self, name: str, total: int, folder: str = "", **details) -> Run:
        """A new entry, or the entry of the same run folder continued (a stopped or failed run queued again):
        one run with its history joined, its status the newest execution's."""
        with self.lock:
            run = self._continued(folder, name, total, details)
            if run is None:
                run = Run(id=uuid.uuid4().hex[:12], name=name, total=total, folder=folder, **details)
                run.step = run.start_step
            if run.prompt_id is not None and run.prompt_id not in run.prompt_ids:
                run.prompt_ids.append(run.prompt_id)
            self.runs[run.id] = run
            finished = [r for r in self.runs.values() if r.status != RUNNING]
            for old in sorted(finished, key=lambda r: r.updated)[: max(0, len(self.runs) - self.keep)]:
                del self.runs[old.id]
        return run

    def _continued(self, folder: str, name: str, total: int, details: dict) -> Run | None:
        """The entry of this run folder, not running now, reset for a new execution; None if none (under the lock)."""
        run = next((r for r in self.runs.values() if folder and r.folder == folder and r.status != RUNNING), None)
        if run is None:
            return None
        for key, value in {**details, "name": name, "total": total}.items():
            setattr(run, key, value)
        run.status, run.message, run.started, run.step = RUNNING, "", time.time(), run.start_step
        run.stop_requested = run.save_requested = run.pause_requested = run.paused = False
        run.samples = [s for s in run.samples if s["step"] <= run.start_step]  # later ones are trained again
        _touch(run)  # its revision goes on: a page keeps applying its summaries
        return run

    def preload(self, run: Run, loss: list, lr: list, holdout: list | None = None) -> None:
        """A resumed run's history before its first new step (one loss and one lr per step from 1; the
        held-out [step, loss] pairs)."""
        with self.lock:
            run.steps, run.loss = list(range(1, len(loss) + 1)), [_number(v) for v in loss]
            run.lr_steps, run.lr = list(range(1, len(lr) + 1)), [float(v) for v in lr]
            run.holdout_steps, run.holdout = [int(s) for s, _ in holdout or []], [_number(v) for _, v in holdout or []]

    def record(self, run: Run, report) -> dict:
        """Add one step's report to the run; returns the kiln.progress payload."""
        with self.lock:
            run.step, run.total = report.step, report.total_steps
            _touch(run)
            run.lr_steps.append(report.step)
            run.lr.append(float(report.lr))
            if report.loss is not None:
                run.steps.append(report.step)
                run.loss.append(_number(report.loss))
            payload = progress_payload(run, report)
            run.figures = {
                k: payload[k]
                for k in ("lr", "loss", "loss_smooth", "it_per_s", "eta_s", "peak_memory_bytes", "peak_memory_per_gpu")
            }
            if report.loss is None:  # a step without a loss reading keeps the last one shown
                run.figures.update(loss=_number(run.loss[-1]) if run.loss else None)
            if payload["holdout_loss"] is not None:
                run.holdout_steps.append(report.step)
                run.holdout.append(payload["holdout_loss"])
            run.figures["holdout_loss"] = run.holdout[-1] if run.holdout else None
            return payload

    def add_sample(self, run: Run, step: int, image: dict) -> dict:
        """A validation sample (ComfyUI /view arguments); returns the kiln.sample payload."""
        with self.lock:
            run.samples = [*run.samples, {"step": step, "image": dict(image)}][-KEEP_SAMPLES:]
            _touch(run)
            return {"run_id": run.id, "run": run.name, "node": run.node, "step": step, "image": dict(image)}

    def set_grid(self, run: Run, step: int, image: dict) -> dict:
        """The newest sample grid (ComfyUI /view arguments); returns the kiln.grid payload."""
        with self.lock:
            run.grid = {"step": step, "image": dict(image)}
            _touch(run)
            return {"run_id": run.id, "run": run.name, "node": run.node, "step": step, "image": dict(image)}

    def add_saved(self, run: Run, step: int, name: str) -> dict:
        with self.lock:
            run.saved.append({"step": step, "name": name})
            run.save_requested = False
            _touch(run)
            return run.summary() | {"saved": list(run.saved)}

    def finish(self, run: Run, status: str, message: str = "") -> dict:
        with self.lock:
            run.status, run.message = status, message
            _touch(run)
            run.save_requested = run.pause_requested = run.paused = False
            if status == STOPPED and run.node is not None:
                self.stops_by_node[run.node] = self.stops_by_node.get(run.node, 0) + 1
            return run.summary()

    def take_save(self, run: Run) -> bool:
        """True once per Save now request (the training thread then writes the LoRA)."""
        with self.lock:
            wanted, run.save_requested = run.save_requested, False
            if wanted:
                _touch(run)
            return wanted

    def stop_wanted(self, run: Run) -> bool:
        with self.lock:
            return run.stop_requested

    def stop_saves(self, run: Run) -> bool:
        """Whether the dashboard's stop was Stop & save (Train LoRA's outputs flow) rather than Stop."""
        with self.lock:
            return run.stop_saves

    def pause_wanted(self, run: Run) -> bool:
        with self.lock:
            return run.pause_requested

    def set_paused(self, run: Run, paused: bool) -> dict:
        """The loop began (or ended) a wait; returns the kiln.run payload."""
        with self.lock:
            run.paused = bool(paused)
            _touch(run)
            return run.summary()

    def set_plan(self, run: Run, lines: list[str]) -> dict:
        """The run's memory plan (TorchBackend.plan), before its first step; returns the kiln.run payload."""
        with self.lock:
            run.plan = [str(line) for line in lines]
            _touch(run)
            return run.summary()

    def stops(self, node: str | None) -> int:
        """How many runs of this node the dashboard stopped: Train LoRA's fingerprint, so that queueing
        the same graph again runs the node (and resumes the run) instead of reusing its cached output."""
        with self.lock:
            return self.stops_by_node.get(str(node), 0)

    # ---------------------------------------------------------------- the HTTP answers

    def answer(self, method: str, run_id: str | None = None, action: str | None = None) -> tuple[int, dict]:
        """(HTTP status, JSON body) for the routes above; the aiohttp handlers only translate."""
        with self.lock:
            if run_id is None:
                runs = sorted(self.runs.values(), key=lambda r: r.started, reverse=True)
                return 200, {"runs": [r.summary() for r in runs]}
            run = self.runs.get(run_id)
            if run is None:
                return 404, {"error": f"no Kiln run {run_id!r} on this server (it may have restarted)"}
            if action is None:
                return 200, run.detail()
            if method != "POST" or action not in ACTIONS:
                return 405, {
                    "error": f"{method} /kiln/runs/{{id}}/{action} is not a Kiln action (POST {', '.join(ACTIONS)})"
                }
            if run.status != RUNNING:
                return 409, {
                    "error": f"run {run.name} is {run.status}; queue the workflow again to continue it",
                    "run": run.summary(),
                }
            if action == "save" and not run.can_save:
                return 409, {
                    "error": f"run {run.name} trains in a torchrun child process, whose weights this "
                    "server does not hold, so it cannot save it now: use its checkpoints' "
                    "LoRAs (checkpoint_loras), or Stop, which saves its LoRA",
                    "run": run.summary(),
                }
            ACTIONS[action](run)
            _touch(run)
            return 202, {"run": run.summary()}


def _touch(run: Run) -> None:
    """A change to the run (under the registry's lock): its time and revision."""
    run.updated, run.rev = time.time(), run.rev + 1


def _set(flag: str, value: bool, **others: bool):
    return lambda run: [setattr(run, name, v) for name, v in {flag: value, **others}.items()]


# POST /kiln/runs/{id}/<action>: the flags each sets; the training thread reads them between steps. The
# stop pressed last says what happens downstream.
ACTIONS = {
    "stop": _set("stop_requested", True, stop_saves=False),
    "stop_save": _set("stop_requested", True, stop_saves=True),
    "save": _set("save_requested", True),
    "pause": _set("pause_requested", True),
    "resume": _set("pause_requested", False),
}

REGISTRY = Registry()


def add_routes(routes, registry: Registry = REGISTRY) -> None:
    """Register the four routes on ComfyUI's route table (PromptServer.instance.routes; ComfyUI also
    serves each under /api)."""
    from aiohttp import web

    def reply(status_and_body) -> web.Response:
        status, body = status_and_body
        return web.json_response(body, status=status)

    @routes.get("/kiln/runs")
    async def list_runs(request):
        return reply(registry.answer("GET"))

    @routes.get("/kiln/runs/{run_id}")
    async def one_run(request):
        return reply(registry.answer("GET", request.match_info["run_id"]))

    @routes.post("/kiln/runs/{run_id}/{action}")
    async def act(request):
        return reply(registry.answer("POST", request.match_info["run_id"], request.match_info["action"]))
