"""One Train LoRA execution: config, run folder, resume rule, the loop, validation, outputs.

ComfyUI objects are reached only through nodes/comfy/ (its bridge), which also runs the training
sequence; this file decides what a run is. A run's identity is a hash of everything that determines its
result (config, dataset content and captions, encoders, model arch, resume source); its folder is
output/kiln/<run_name> as typed (empty: the dataset folder's name), with -2, -3, ... only when that name
holds a run of another identity, and the identity written inside it (trainer/run/folders.py). So
re-queueing the same workflow finds its own run (a folder of the old <name>-<hash> kind too):
  - newest checkpoint < steps (stopped, crashed, or ComfyUI restarted) → resume from it;
  - newest checkpoint == steps → load that result, train nothing (the UI says so);
  - no checkpoint → train from the start (or from a KILN_STATE input).
`steps` is not part of the hash: raising it on a finished run continues that run.

Under ComfyUI's own cache: while the server runs and no input changed, ComfyUI returns the node's
cached outputs without running it (the finished result, nothing retrained). A run that ComfyUI's stop
ended, ran out of memory or hit NaNs raised an error, so nothing was cached and a re-queue runs the node,
which resumes. A run the dashboard stopped returned (Stop: its model, lora and state outputs blocked, so
nothing downstream saves an unfinished LoRA; Stop & save: its LoRA as of that step), and its node's
fingerprint moved on, so a re-queue runs the node again too. After a restart the cache is empty and the rules
above apply. Dataset edits on disk reach the hash through Load Dataset's fingerprint.
tests/nodes/test_node_faults.py and test_stop_and_save.py hold each case.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..trainer import config as cfg_module
from ..trainer import paths
from ..trainer.data.dataset import Dataset
from ..trainer.errors import did_you_mean
from ..trainer.archs import get_arch
from ..trainer.lora.files import LoraWeights, lora_metadata
from ..trainer.lora.model_file import RUN_FILE, run_model_file, save_diffusion_model
from ..trainer.run import folders as run_folders
from ..trainer.run import state as state_module
from ..trainer.run.callbacks import Callbacks
from ..trainer.run.init_lora import InitLora
from ..trainer.run.loop import RunResult, train
from ..trainer.run.plot import loss_curve
from . import live
from .comfy import bridge


@dataclass(frozen=True)
class KilnState:
    """KILN_STATE: a finished or stopped run, resumable from `checkpoint`."""

    run_dir: str
    checkpoint: str  # step-NNNNNN folder
    step: int
    arch: str
    config: dict
    lora: dict[str, LoraWeights]
    ema_lora: dict[str, LoraWeights] | None
    history: state_module.History = field(default_factory=state_module.History)
    model_file: str = ""  # adapter full: the diffusion-model file in the run folder (Kiln Save Diffusion Model)

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> "KilnState":
        checkpoint = state_module.load_checkpoint(path)
        info = checkpoint.info
        has_ema = any(k.startswith("ema.") for k in checkpoint.tensors)
        return cls(
            run_dir=str(checkpoint.path.parent),
            checkpoint=str(checkpoint.path),
            step=checkpoint.step,
            arch=info["arch"],
            config=info["config"],
            lora=state_module.checkpoint_lora(checkpoint),
            ema_lora=state_module.checkpoint_lora(checkpoint, ema=True) if has_ema else None,
            history=state_module.checkpoint_history(checkpoint),
            model_file=run_model_file(checkpoint.path.parent),
        )

    def best_lora(self) -> dict[str, LoraWeights]:
        """What the run is for: the EMA weights when EMA was on, else the trained weights."""
        return self.ema_lora if self.ema_lora is not None else self.lora


def run_key(state: KilnState) -> str:
    """Which run a state belongs to, as Save LoRA records it in a file (kiln.run: trainer/run/folders.py)."""
    return run_folders.run_key(state.run_dir)


def dataset_identity(dataset: Dataset) -> str:
    parts = (
        [[i.sha256, i.repeats] for i in dataset.report.items],
        dataset.captions,
        [
            dataset.latent_identity,
            dataset.text_identity,
            sorted(dataset.failed_items),
            # A clip's entry adds its frames (the frames/fps/frame_extraction settings): an image's is as it was.
            [[e.item, e.bucket, e.resized, e.offset, *([e.frames] if e.frames else [])] for e in dataset.plan.entries],
            *([dataset.vision_identity] if dataset.vision_identity else []),  # Wan 2.1 I2V's CLIP vision
        ],
    )
    if dataset.preservation_class or dataset.regularisation is not None:  # DOP's class word, the reg set's content
        reg = dataset.regularisation
        parts = [*parts, dataset.preservation_class, dataset_identity(reg) if reg is not None else None]
    return hashlib.sha256(json.dumps(parts, default=list).encode()).hexdigest()


# Settings that are not part of a run's identity are declared so at the field (identity=False, trainer/config).
NOT_IDENTITY = cfg_module.NOT_IDENTITY  # kept one release


def run_identity(cfg: cfg_module.TrainConfig, dataset: Dataset, resume_from: str | None) -> str:
    values = cfg_module.identity_values(cfg.to_dict())
    blob = json.dumps([values, dataset_identity(dataset), resume_from], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def run_folder(cfg: cfg_module.TrainConfig, dataset: Dataset, resume_from: str | None, output_root: Path) -> Path:
    """output/kiln/<run_name>, or <run_name>-N on a clash; an empty run_name is the dataset folder's name (what
    a user tells runs apart by; the arch alone would name every run of a family alike), else the arch."""
    name = cfg.run_name or run_folders.default_name([Path(dataset.report.root).name], cfg.arch)
    identity = run_identity(cfg, dataset, resume_from)
    return run_folders.find_or_claim(
        output_root, name, identity, "Kiln Training Options: run_name", legacy=cfg.run_name or cfg.arch
    )


@dataclass
class Outcome:
    state: KilnState
    samples: list  # IMAGE tensors from validation
    message: str
    blocked: bool = False  # stopped by the dashboard's Stop: the nodes downstream must not save it


def execute(
    cfg: cfg_module.TrainConfig,
    model,
    dataset: Dataset,
    *,
    adapter=None,
    resume_state: KilnState | None = None,
    validation=None,
    output_root: Path,
    init: InitLora | None = None,
) -> Outcome:
    if cfg.run_name:  # before anything is loaded or written
        paths.check_name(cfg.run_name, "Kiln Training Options: run_name")
    resume_from = resume_state.checkpoint if resume_state is not None else None
    run_dir = run_folder(cfg, dataset, resume_from, output_root)
    found = state_module.list_checkpoints(run_dir)
    newest = found[-1] if found else None
    if newest is not None and newest[0] >= cfg.steps:
        state = KilnState.from_checkpoint(newest[1])
        return Outcome(
            state,
            [],
            f"already trained: {newest[1]} (step {newest[0]}); loaded it instead of "
            "training again. Delete that folder or change a setting to train anew.",
        )
    resume = newest[1] if newest is not None else resume_from
    lines = [f"resuming from {resume}" if resume else "training from step 0", f"run folder: {run_dir}"]
    front = TrainNode(cfg, run_dir, resume, validation, lines)
    try:
        result: RunResult = bridge.train(
            cfg,
            model,
            dataset,
            adapter=adapter,
            setup=front.setup,
            run=functools.partial(train, run_dir=run_dir, init=init),
        )
    except BaseException as error:
        if front.tracker is not None:
            front.tracker.finish(error=error)
        raise
    blocked = result.stopped and not front.tracker.keeps_outputs()
    front.tracker.finish(result)
    state = KilnState(
        run_dir=str(run_dir),
        checkpoint=str(result.checkpoint),
        step=result.step,
        arch=cfg.arch,
        config=cfg.to_dict(),
        lora=result.lora,
        ema_lora=result.ema_lora,
        history=result.history,
        model_file=full_model_file(cfg, result, run_dir),
    )
    summary = summary_line(cfg, result, blocked)
    return Outcome(state, front.samples, "\n".join(lines + [summary, f"checkpoint: {result.checkpoint}"]), blocked)


def full_model_file(cfg, result: RunResult, run_dir: Path) -> str:
    """A full fine-tune's diffusion model (EMA weights when on) written once into the run folder, so the state
    carries a path, not the model's weights; "" for an adapter run."""
    if result.model is None:
        return ""
    path = run_dir / RUN_FILE
    metadata = lora_metadata(cfg, get_arch(cfg.arch), result.step)
    save_diffusion_model(path, result.model, dtype=cfg.save_dtype, metadata=metadata)
    return str(path)


class TrainNode(Callbacks):
    """Train LoRA's front end for the loop: ComfyUI's progress bar, the live dashboard (progress, Stop, Pause,
    Save now: nodes/live.py) and the validation samples, which also become the node's IMAGE output."""

    def __init__(self, cfg: cfg_module.TrainConfig, run_dir: Path, resume, validation, lines: list[str]):
        self.cfg, self.run_dir, self.resume, self.validation, self.lines = cfg, run_dir, resume, validation, lines
        self.bar = bridge.progress(cfg.steps)
        self.samples: list = []
        self.tracker: live.Tracker | None = None
        self.sampler = None
        self.validate_every = validation.every if validation is not None else 0

    def setup(self, model, data) -> dict:
        """Once the patcher to sample on and the mapped data exist: the dashboard (events, Stop, Save now; the
        sample grid, a column per prompt of the chain) and the sampler, on `model` without the training adapter
        (as headless training samples its prompts)."""
        self.lines.extend(f"skipped {p.line()}" for p in data.skipped)
        for line in self.lines:
            print(f"[Kiln] {line}")
        prompts = self.validation.prompts if self.validation is not None else ()
        self.tracker = live.Tracker(self.cfg, self.run_dir, data, self.resume, prompts=prompts)
        if self.validation is not None:
            self.sampler = bridge.validation(self.cfg, model, self.validation.samples, self.on_sample)
        return {"resume": self.resume, "callbacks": self}

    def on_start(self, plan: list[str]) -> None:
        """The memory plan and the auto choices (the console has them from the log): the dashboard and the
        node's report."""
        self.lines.extend(plan)
        self.tracker.on_plan(plan)

    def on_step(self, report) -> None:
        self.bar.update(report.step)
        self.tracker.on_step(report)

    def on_sample(self, step: int, index: int, images) -> None:
        self.samples.append(images)
        self.bar.update(step, preview=images)
        self.tracker.on_sample(step, images, index)

    def validate(self, step: int, lora):
        return self.sampler(step, lora)

    def should_stop(self) -> bool:
        return self.tracker.should_stop()

    def should_pause(self) -> bool:
        return self.tracker.should_pause()

    def on_pause(self, paused: bool) -> None:
        self.tracker.on_pause(paused)


def summary_line(cfg: cfg_module.TrainConfig, result: RunResult, blocked: bool) -> str:
    """Train LoRA's report of a run that returned: how it ended (a dashboard stop, and what it did downstream),
    the steps skipped for NaN, the best held-out step, the loss from first to last tenth."""
    losses = [v for v in result.history.loss if np.isfinite(v)]
    summary = f"trained to step {result.step}/{cfg.steps}; {result.trainable_parameters:,} LoRA parameters"
    if result.history.skipped:
        summary += (
            f"; {len(result.history.skipped)} step(s) skipped for a NaN/inf loss (images: "
            f"{', '.join(sorted({n for e in result.history.skipped for n in e['items']}))})"
        )
    if result.stopped:
        summary = (
            f"stopped at step {result.step} from the dashboard; "
            + (
                "the nodes after Train LoRA (Save LoRA, ...) were skipped: the run is not done. Queue again to continue "
                "(Stop & save passes the LoRA on instead)"
                if blocked
                else f"Stop & save: its LoRA as of step {result.step} goes on to the nodes after Train LoRA. Queue again "
                "to continue"
            )
            + f". {summary}"
        )
    if result.best is not None:
        summary += (
            f"; held-out loss best {result.best.loss:.4f} at step {result.best.step}"
            f"{' (stopped early)' if result.early_stopped else ''}, its LoRA: {result.best_lora}"
        )
    if losses:
        tenth = max(1, len(losses) // 10)
        summary += f"; loss {np.mean(losses[:tenth]):.4f} → {np.mean(losses[-tenth:]):.4f}"
    return summary


def loss_image(state: KilnState):
    """The loss curve (raw, smoothed, learning rate) as an IMAGE tensor."""
    picture = loss_curve(state.history.loss, state.history.lr, title=f"{Path(state.run_dir).name}: loss")
    return bridge.image_tensor(picture)


def resolve_run(text: str) -> Path:
    """A run folder name under output/kiln/, or an absolute run or checkpoint folder → its newest checkpoint."""
    text = (text or "").strip()
    if not text:
        raise ValueError("Kiln Load Run: set run_folder to a folder under output/kiln/ (or an absolute path)")
    path = Path(text).expanduser()
    root = (Path(bridge.folders()["output"]) / "kiln").resolve()
    if not path.is_absolute():
        path = (root / path).resolve()
        if root not in path.parents:
            raise ValueError(f"Kiln Load Run: {text!r} leaves output/kiln/; give a name inside it or an absolute path")
    if not path.is_dir():
        hint = did_you_mean(text, [name for name, _ in state_module.list_runs(root)]) if root in path.parents else ""
        raise ValueError(f"Kiln Load Run: {path} does not exist{hint}; runs under output/kiln/: {known_runs(root)}")
    if state_module.STEP_DIR.match(path.name) and (path / "run.json").is_file():
        return path
    found = state_module.list_checkpoints(path)
    if not found:
        raise ValueError(
            f"Kiln Load Run: {path} has no complete checkpoint (step-NNNNNN with run.json) yet; "
            f"runs with one under output/kiln/: {known_runs(root)}"
        )
    return found[-1][1]


def known_runs(root: Path, most: int = 20) -> str:
    """The run folders under output/kiln/ that hold a complete checkpoint, newest first, for a message."""
    runs = [name for name, _ in state_module.list_runs(root)]
    names = ", ".join(runs[:most]) + (f", … and {len(runs) - most} more" if len(runs) > most else "")
    return names or "none yet (train one with Kiln Train LoRA)"
