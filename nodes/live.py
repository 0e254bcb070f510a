"""A running Train LoRA node on the live dashboard (web/kiln_dashboard.js): the ComfyUI side of dashboard.py.

Per step it records the report in the run registry and sends `kiln.progress`; per validation sample it
writes a JPEG into ComfyUI's temp folder (served by /view) and sends `kiln.sample`, and the run folder's
sample grid (trainer/samples/grid.py) as `kiln.grid`; on start, on Save now and at the end it sends
`kiln.run` (the run's summary). The dashboard's Stop, Stop & save, Save now, Pause and Resume buttons only
set flags in the registry: the training loop reads Stop through `should_stop` (it saves a resumable checkpoint
and returns; `keeps_outputs` then tells Train LoRA whether to pass its outputs on) and Pause through
`should_pause` (it waits between steps, the node still running, memory kept); `on_step` writes a Save now LoRA
from the step's best weights, and so does `should_pause` while the loop waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from ..trainer.archs import get_arch
from ..trainer.lora import files as lora_format
from ..trainer.lora.files import lora_metadata
from ..trainer.lora.model_file import save_diffusion_model
from ..trainer.run import folders as run_folders
from ..trainer.run import state
from ..trainer.samples import clips
from ..trainer.samples.grid import SampleGrid
from . import dashboard
from .comfy import bridge

SAMPLE_PX = 512  # longest side of a sample as the dashboard shows it
SAMPLES_SUBFOLDER = "kiln"  # under ComfyUI's temp folder (emptied when ComfyUI starts)
SAVED_SUBFOLDER = "kiln"  # Save now LoRAs go to models/loras/kiln/


def fingerprint() -> int:
    """Train LoRA's fingerprint_inputs: changes when the dashboard stopped this node's run, so queueing
    the graph again runs the node (resuming the run) instead of reusing its cached outputs."""
    return dashboard.REGISTRY.stops(bridge.executing_node()[0])


def prior_history(checkpoint) -> tuple[list, list, list]:
    """(loss, lr, held-out [step, loss]) before a resumed run's first step, from the checkpoint's run.json."""
    if checkpoint is None:
        return [], [], []
    try:
        history = state.read_history(checkpoint)
        return history.loss, history.lr, history.holdout
    except (OSError, ValueError, KeyError, TypeError):
        return [], [], []  # a run folder or an unreadable file: the curve starts at the resumed step


class Tracker:
    """One Train LoRA execution on the dashboard."""

    def __init__(
        self,
        cfg,
        run_dir: Path,
        data,
        resume=None,
        registry: dashboard.Registry = dashboard.REGISTRY,
        can_save: bool = True,
        prompts: Sequence[str] = (),
    ):
        """data None: a run in a child process (Train LoRA (several GPUs)), whose buckets this side does not
        know and whose weights it does not hold (can_save False: Save now is refused; Pause works through
        <run>/PAUSE). prompts: the grid's column headers, one per validation sample of a step."""
        node, prompt_id = bridge.executing_node()
        loss, lr, holdout = prior_history(resume)
        self.cfg, self.registry = cfg, registry
        self.run_key = run_folders.run_key(run_dir)  # its kiln.run in the LoRA files it saves, as Save LoRA's
        self.latest = None  # (step, weights()) of the newest step: what a Save now while paused writes
        # A child run (data None) writes its own samples and grid into the run folder: this side only shows them.
        self.grid = SampleGrid(run_dir, list(prompts)).load_existing() if data is not None else None
        buckets = {key: len(items) for key, items in data.buckets.items()} if data is not None else {}
        # The run folder is the run: a resumed execution of it continues the same dashboard entry.
        self.run = registry.start(
            Path(run_dir).name,
            cfg.steps,
            folder=str(Path(run_dir).resolve()),
            start_step=len(lr),
            node=node,
            prompt_id=prompt_id,
            arch=cfg.arch,
            buckets=buckets,
            can_save=can_save,
        )
        registry.preload(self.run, loss, lr, holdout)
        bridge.send_event("kiln.run", self.run.summary())

    def on_plan(self, lines: list[str]) -> None:
        """Before the first step: the backend's memory plan and auto choices, shown under the run."""
        bridge.send_event("kiln.run", self.registry.set_plan(self.run, lines))

    def on_step(self, report) -> None:
        bridge.send_event("kiln.progress", self.registry.record(self.run, report))
        cfg, step = self.cfg, report.step
        at_checkpoint = (  # not for a full fine-tune: its checkpoint holds the model; a file of it each is large
            cfg.checkpoint_loras
            and cfg.adapter != "full"
            and (step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0))
        )
        if report.weights is None:  # no weights on this side (a torchrun child's relay): a request stays pending
            return
        self.latest = (step, report.weights)
        if self.registry.take_save(self.run) or at_checkpoint:
            self.save_latest()

    def save_latest(self) -> None:
        step, weights = self.latest
        name = (self.save_model if self.cfg.adapter == "full" else self.save_lora)(step, weights())
        bridge.send_event("kiln.run", self.registry.add_saved(self.run, step, name))

    def should_stop(self) -> bool:
        return self.registry.stop_wanted(self.run)

    def keeps_outputs(self) -> bool:
        """After a dashboard stop: True for Stop & save (Train LoRA's outputs flow on), False for Stop."""
        return self.registry.stop_saves(self.run)

    def should_pause(self) -> bool:
        """The dashboard's Pause; ComfyUI's own stop button ends a pause by raising (a checkpoint is saved).
        The paused loop polls here, so a Save now pressed meanwhile is written at once (the loop's weights
        stand still) instead of after Resume."""
        paused = self.registry.pause_wanted(self.run)
        if paused:
            bridge.raise_if_interrupted()
            if self.latest is not None and self.registry.take_save(self.run):
                self.save_latest()
        return paused

    def on_pause(self, paused: bool) -> None:
        """The loop (every rank of a torchrun child) began or ended a wait: the dashboard shows it paused."""
        bridge.send_event("kiln.run", self.registry.set_paused(self.run, paused))

    def on_sample(self, step: int, images, index: int = 0) -> None:
        """The first image of a validation batch (IMAGE [B,H,W,3] in [0,1]) of prompt `index` as a JPEG in
        temp/kiln/; a video model's clip (IMAGE [T,H,W,3]) as an animated WebP there (the dashboard's <img>
        plays it)."""
        frames = images.reshape(-1, *images.shape[-3:]).float().clamp(0, 1)
        pixels = frames[0].mul(255).round().byte().cpu().numpy()
        folder = Path(bridge.folders()["temp"]) / SAMPLES_SUBFOLDER
        folder.mkdir(parents=True, exist_ok=True)
        stem = f"{self.run.id}-step{step:06d}-p{index}"
        if clips.is_clip(frames):
            (folder / f"{stem}.webp").write_bytes(clips.webp_bytes(frames.cpu().numpy(), max_px=SAMPLE_PX))
            filename = f"{stem}.webp"
        else:
            picture = Image.fromarray(np.ascontiguousarray(pixels))
            picture.thumbnail((SAMPLE_PX, SAMPLE_PX))
            filename = f"{stem}.jpg"
            picture.save(folder / filename, quality=90)
        image = {"filename": filename, "subfolder": SAMPLES_SUBFOLDER, "type": "temp"}
        bridge.send_event("kiln.sample", self.registry.add_sample(self.run, step, image))
        if self.grid is not None and index < len(self.grid.prompts):
            self.add_to_grid(step, index, frames.cpu().numpy() if clips.is_clip(frames) else pixels / 255.0)

    def add_to_grid(self, step: int, index: int, image: np.ndarray) -> None:
        """The sample ([H,W,3] in 0..1; a clip [T,H,W,3]) into <run>/samples/ and its grid; once a step's last
        prompt is in, the grid as a JPEG in temp/kiln/ too, for the dashboard."""
        self.grid.save_sample(step, index, image)
        self.grid.add(step, index, image)
        if index < len(self.grid.prompts) - 1:
            return
        filename = f"{self.run.id}-grid-step{step:06d}.jpg"
        self.grid.write().save(Path(bridge.folders()["temp"]) / SAMPLES_SUBFOLDER / filename, quality=90)
        grid = {"filename": filename, "subfolder": SAMPLES_SUBFOLDER, "type": "temp"}
        bridge.send_event("kiln.grid", self.registry.set_grid(self.run, step, grid))

    def save_lora(self, step: int, weights) -> str:
        """Save now, or a checkpoint's LoRA (checkpoint_loras): the LoRA as of this step (the EMA weights when
        EMA is on) into models/loras/kiln/ (atomic write); its LoraLoader name."""
        name = f"{SAVED_SUBFOLDER}/{self.run.name}-step{step:06d}.safetensors"
        cfg = self.cfg
        lora_format.save_lora(
            Path(bridge.folders()["loras"]) / name,
            weights,
            arch=cfg.arch,
            fmt=cfg.lora_format,
            dtype=cfg.save_dtype,
            metadata={**lora_metadata(cfg, get_arch(cfg.arch), step), run_folders.RUN_KEY: self.run_key},
        )
        bridge.refresh_loras()
        print(f"[Kiln] saved {name} (step {step})")
        return name

    def save_model(self, step: int, tensors) -> str:
        """Save now of a full fine-tune: the diffusion model as of this step (EMA weights when on) in ComfyUI's
        layout into models/diffusion_models/kiln/ (atomic write), where Load Diffusion Model lists it; its name."""
        name = f"{SAVED_SUBFOLDER}/{self.run.name}-step{step:06d}.safetensors"
        metadata = {**lora_metadata(self.cfg, get_arch(self.cfg.arch), step), run_folders.RUN_KEY: self.run_key}
        path = Path(bridge.folders()["diffusion_models"]) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        save_diffusion_model(path, tensors, dtype=self.cfg.save_dtype, metadata=metadata)
        bridge.refresh_models("diffusion_models")
        print(f"[Kiln] saved {name} (step {step})")
        return name

    def finish(self, result=None, error: BaseException | None = None) -> None:
        if error is not None:
            status = dashboard.INTERRUPTED if isinstance(error, bridge.Interrupted) else dashboard.FAILED
            message = "stopped by ComfyUI's stop button" if status == dashboard.INTERRUPTED else str(error)[:300]
        elif result.stopped:
            then = (
                "its LoRA goes on to the nodes after Train LoRA"
                if self.keeps_outputs()
                else "the nodes after Train LoRA were skipped"
            )
            status, message = dashboard.STOPPED, f"stopped at step {result.step} from the dashboard; {then}"
        else:
            status, message = dashboard.FINISHED, f"trained to step {result.step}"
        bridge.send_event("kiln.run", self.registry.finish(self.run, status, message))


def add_routes() -> None:
    """Put /kiln/runs on ComfyUI's server (once); nothing when no server runs (tests, headless)."""
    bridge.add_routes("dashboard", dashboard.add_routes)
