"""Kiln Train LoRA (several GPUs): the headless run under torchrun, started from a graph.

A child process cannot take the graph's in-memory MODEL, so this node names model files as a headless
config does; trainer/cli/launch.py writes `<run>/launch.toml` and runs `torchrun -m trainer train` on the
chosen GPUs (ComfyUI's loaders used as a library through headless.py, never ComfyUI's main). Progress
lines move the node's bar and feed the live dashboard (nodes/live.py) as an in-process Train LoRA does;
each validation sample the child writes is shown on the node and the dashboard, and the newest step's are
the IMAGE output. Stop (ComfyUI's or the dashboard's) asks every rank for a clean checkpoint, also while
paused; the dashboard's Pause writes <run>/PAUSE (Resume removes it), on which the ranks agree; re-queueing
resumes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from comfy_api.latest import io, ui
from PIL import Image

from ..trainer import config as cfg_module
from ..trainer import paths
from ..trainer.archs import ARCHS
from ..trainer.cli import launch
from ..trainer.config import layers as config_layers
from ..trainer.run import folders as run_folders
from ..trainer.run import state as state_module
from ..trainer.run.loop import Report
from ..trainer.samples.plan import SAMPLES_DIR
from . import live
from .comfy import bridge
from .widgets import CATEGORY, OPTIONS, STEPS_TOOLTIP, parse_list, preset_input, widget

WHERE = "Kiln Train LoRA (several GPUs)"
FILES = {
    "model_file": ("diffusion_models", "model_path"),
    "vae_file": ("vae", "vae_path"),
    "text_encoder_file": ("text_encoders", "text_encoder_path"),
    "training_adapter": ("loras", "training_adapter"),
}


def _file_input(name: str, folder: str, tooltip: str, optional: bool = False):
    return io.Combo.Input(
        name, options=["none", *bridge.model_names(folder)], default="none", optional=optional, tooltip=tooltip
    )


def build_config(arch: str, files: dict, values: dict, preset: str, options: dict | None) -> config_layers.Resolved:
    """preset < option nodes < this node's widgets and files; every value an option node sets wins over the preset."""
    paths_of = {}
    for name, chosen in files.items():
        folder, key = FILES[name]
        if chosen not in (None, "none"):
            paths_of[key] = bridge.model_path(folder, chosen)
        elif arch != "demo" and name != "training_adapter":
            raise ValueError(
                f"{WHERE}: arch {arch!r} trains ComfyUI's model from files; choose {name} "
                f"(a file in models/{folder}), or arch 'demo' to try it without one"
            )
    layers = [("options", options or {}), (WHERE, {**values, "arch": arch, **paths_of})]
    try:
        return config_layers.resolve(layers, preset=None if preset == "none" else preset)
    except cfg_module.ConfigError as error:
        raise ValueError(f"{WHERE}: {error}") from None


def run_folder(config: dict, processes: int) -> Path:
    """output/kiln/<run_name> (empty: the dataset folder's name, else the arch), or <run_name>-N on a clash; the
    run's identity is a hash of what is trained, on how many processes (trainer/run/folders.py)."""
    where = "Kiln Training Options: run_name"
    if config.get("run_name"):
        paths.check_name(config["run_name"], where)
    values = cfg_module.identity_values(config)
    blob = json.dumps([values, config["dataset_dir"], processes], sort_keys=True, default=str)
    name = config.get("run_name") or run_folders.default_name([Path(config["dataset_dir"]).name], config["arch"])
    return run_folders.find_or_claim(
        Path(bridge.folders()["output"]) / "kiln",
        name,
        hashlib.sha256(blob.encode()).hexdigest(),
        where,
        legacy=config.get("run_name") or config["arch"],
    )


def report_of(fields: dict) -> Report:
    """A KILN_PROGRESS line as the loop's Report (what the dashboard records); no weights: they are the child's."""
    return Report(
        step=fields["step"],
        total_steps=fields["total"],
        lr=fields["lr"],
        it_per_s=fields["it_per_s"],
        eta_s=fields["eta_s"],
        peak_memory_bytes=fields.get("peak_memory_bytes") or 0,
        loss=fields["loss"],
        loss_smooth=fields.get("loss_smooth"),
        skipped_steps=fields.get("skipped_steps", 0),
        peak_memory_per_rank=list(fields.get("peak_memory_per_gpu") or []),
    )


def read_image(path: Path):
    """A PNG the run wrote as IMAGE [1,H,W,3]."""
    with Image.open(path) as picture:
        return bridge.image_tensor(picture)


def newest_samples(run_dir: Path) -> list[Path]:
    """The validation samples of the newest sampled step (one per prompt, in prompt order), or none (a video
    model's .webp clips read as their first frame)."""
    found = sorted(p for p in (run_dir / SAMPLES_DIR).glob("step-*-p*.*") if p.suffix in (".png", ".webp"))
    newest = found[-1].name.split("-p")[0] if found else None
    return [path for path in found if path.name.split("-p")[0] == newest]


def _lora_output(config: dict, path) -> object:
    """The run's LoRA; a full fine-tune's file is a diffusion model (ComfyUI's layout), not a LoRA: a node reading
    the lora output fails saying where the model is."""
    if config.get("adapter") != "full":
        return bridge.load_lora_file(path)
    return bridge.blocked(
        f"Kiln Train LoRA (several GPUs): this run trained every weight (adapter full), so it has no LoRA; its model "
        f"is {path}: put it in models/diffusion_models and load it with Load Diffusion Model, or make a LoRA of it "
        "with Kiln Extract LoRA"
    )


def outputs_images(run_dir: Path):
    """The IMAGE output: the newest step's samples, else the run's loss curve (as Train LoRA's)."""
    files = newest_samples(run_dir) or [run_dir / "loss.png"]
    return bridge.cat_images([read_image(path) for path in files if path.is_file()])


def follow(job: launch.Launch, cfg, run_dir: Path, resume: Path | None) -> tuple[launch.Outcome, bool]:
    """The launched run until it ends: its steps on the node's bar and the dashboard, its memory plan and auto
    choices (rank 0's) on the dashboard, its samples as previews on both, Stop from either as the stop file,
    the dashboard's Pause / Resume as <run>/PAUSE (the child's KILN_PAUSED lines show it paused). An error
    here or Stop pressed stops the run cleanly first. Also whether the node's lora and run_folder are blocked
    (a dashboard Stop, not Stop & save: the run is not done)."""
    tracker = live.Tracker(cfg, run_dir, None, resume, can_save=False)
    bar = bridge.progress(cfg.steps)

    def on_progress(fields: dict) -> None:
        bar.update(fields["step"])
        tracker.on_step(report_of(fields))

    def on_sample(fields: dict) -> None:
        image = read_image(Path(fields["path"]))
        bar.update(fields["step"], preview=image)
        tracker.on_sample(fields["step"], image, fields.get("index", 0))

    try:
        outcome = job.wait(
            on_progress=on_progress,
            on_sample=on_sample,
            should_stop=lambda: bridge.interrupt_requested() or tracker.should_stop(),
            should_pause=lambda: tracker.registry.pause_wanted(tracker.run),
            on_pause=lambda fields: tracker.on_pause(fields["paused"]),
            on_plan=lambda fields: tracker.on_plan(fields["lines"]),
        )
        if outcome.stopped:
            bar.update(outcome.step)  # raises ComfyUI's interruption when its Stop asked: the run has a checkpoint
        if outcome.returncode != 0 or outcome.lora is None:
            raise RuntimeError(
                f"{WHERE}: the torchrun run in {run_dir} ended with exit code {outcome.returncode} "
                f"and no LoRA; its last output:\n{outcome.tail}\nFix what it names, then queue again "
                "(a run with a checkpoint resumes)"
            )
    except BaseException as error:
        job.stop()  # Stop pressed (Progress.update raised) or any error here: a clean checkpoint, then raise
        job.wait()
        tracker.finish(error=error)
        raise
    tracker.finish(outcome)
    return outcome, outcome.stopped and not tracker.keeps_outputs()


def train(config: dict, run_dir: Path, processes: int, gpus: str) -> tuple[Path, str, bool]:
    """The run's LoRA file, a summary and whether the outputs are blocked: trained (or resumed) under torchrun,
    or found finished."""
    found = state_module.list_checkpoints(run_dir)
    lora_file = run_dir / f"{run_dir.name}.safetensors"
    if found and found[-1][0] >= config["steps"] and lora_file.is_file():
        return lora_file, f"already trained: {found[-1][1]}; loaded its LoRA instead of training again", False
    job = launch.Launch(
        config,
        run_dir,
        processes=processes,
        gpus=gpus,
        comfyui_path=None if config["arch"] == "demo" else bridge.comfyui_root(),
    )
    job.start(resume=bool(found))
    outcome, blocked = follow(job, job.config, run_dir, found[-1][1] if found else None)
    if outcome.stopped:
        then = (
            "the nodes after this one were skipped (the run is not done)"
            if blocked
            else "Stop & save: its LoRA as of that step goes on"
        )
        return (
            outcome.lora,
            (
                f"stopped at step {outcome.step}/{config['steps']} from the dashboard, with a "
                f"checkpoint; {then}; queue again to resume"
            ),
            blocked,
        )
    return outcome.lora, f"trained to step {outcome.step}/{config['steps']} on {processes} process(es)", False


def launch_inputs() -> list:
    """The model files, the dataset and the widgets Train LoRA has too (the preset after alpha, as shipped)."""
    return [
        io.Combo.Input(
            "arch",
            options=list(ARCHS),
            default="demo",
            tooltip="The model family of model_file (demo: a tiny model, no files)",
        ),
        _file_input("model_file", "diffusion_models", "The diffusion model (models/diffusion_models)"),
        _file_input("vae_file", "vae", "The model's VAE (models/vae)"),
        _file_input("text_encoder_file", "text_encoders", "The model's text encoder (models/text_encoders)"),
        io.String.Input(
            "dataset_dir",
            default="",
            tooltip="A folder of images with same-name .txt captions (the child encodes it and caches latents and "
            "texts)",
        ),
        io.String.Input("resolutions", default="512", tooltip="Training resolutions, e.g. '512, 768'"),
        io.String.Input("trigger_word", default="", tooltip="Replaces {trigger} in the captions"),
        widget("steps", default=1000, tooltip_text=STEPS_TOOLTIP),
        widget("learning_rate"),
        widget("rank"),
        widget("alpha"),
        preset_input(),
        widget("seed"),
    ]


def launch_extras() -> list:
    """The processes and GPUs, then the optional inputs."""
    return [
        io.Int.Input(
            "processes",
            default=2,
            min=1,
            max=64,
            tooltip="torchrun processes, one per GPU (batch_size is per process)",
        ),
        io.String.Input(
            "gpus",
            default="",
            tooltip="GPU indices for the run, e.g. '0,1' (CUDA_VISIBLE_DEVICES); blank: the first `processes` GPUs",
        ),
        OPTIONS.Input(
            "options",
            optional=True,
            tooltip="From Kiln Training Options or a chain of the smaller option nodes; every value they set wins "
            "over the preset",
        ),
        _file_input("training_adapter", "loras", "Z-Image Turbo: the training adapter LoRA", optional=True),
        io.String.Input(
            "sample_prompts",
            default="",
            multiline=True,
            optional=True,
            tooltip="Validation prompts, one per line (ai-toolkit's flags work: 'a cat --w 768 --h 1024 --seed 7 "
            "--steps 20'); rank 0 samples them with ComfyUI's sampler into <run>/samples/. Empty: no samples",
        ),
        io.Int.Input(
            "sample_every",
            default=250,
            min=0,
            max=1_000_000,
            optional=True,
            tooltip="Steps between validation samples (and at the last step); 0: only at the end",
        ),
        # last: saved workflows' widgets_values are positional
        widget("sharding", optional=True),
    ]


class KilnTrainLoRATorchrun(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnTrainLoRATorchrun",
            display_name="Kiln Train LoRA (several GPUs)",
            category=f"{CATEGORY}/train",
            is_output_node=True,
            description="Train a LoRA from model files on several GPUs: the headless run under torchrun as a "
            "child process (one process per GPU). Stop saves a checkpoint on every rank; "
            "re-queueing resumes it. The run folder holds launch.toml, checkpoints and the LoRA.",
            inputs=[*launch_inputs(), *launch_extras()],
            outputs=[
                io.LoraModel.Output(display_name="lora", tooltip="The trained LoRA (ComfyUI's LORA_MODEL)"),
                io.String.Output(display_name="run_folder", tooltip="The run folder (Kiln Load Run reads it)"),
                io.Image.Output(
                    display_name="samples", tooltip="The newest step's validation samples, else the loss curve"
                ),
            ],
        )

    @classmethod
    def fingerprint_inputs(cls, **_inputs):
        return live.fingerprint()  # after a dashboard Stop, queueing again resumes instead of reusing the cache

    @classmethod
    def execute(
        cls,
        arch,
        model_file,
        vae_file,
        text_encoder_file,
        dataset_dir,
        resolutions,
        trigger_word,
        steps,
        learning_rate,
        rank,
        alpha,
        preset,
        seed,
        processes,
        gpus,
        options=None,
        training_adapter="none",
        sample_prompts="",
        sample_every=250,
        sharding="auto",
    ):
        if not dataset_dir.strip():
            raise ValueError(f"{WHERE}: dataset_dir is empty; name a folder of images with .txt captions")
        values = {
            "dataset_dir": dataset_dir.strip(),
            "resolutions": parse_list(resolutions, int),
            "trigger_word": trigger_word,
            "steps": steps,
            "learning_rate": learning_rate,
            "rank": rank,
            "alpha": alpha,
            "seed": seed,
            "sharding": sharding,
        }
        prompts = [line.strip() for line in (sample_prompts or "").splitlines() if line.strip()]
        if prompts:  # output settings: not part of the run folder's hash
            values.update(sample_prompts=prompts, sample_every=sample_every)
        files = {
            "model_file": model_file,
            "vae_file": vae_file,
            "text_encoder_file": text_encoder_file,
            "training_adapter": training_adapter,
        }
        resolved = build_config(arch, files, values, preset, options)
        config = resolved.config.to_dict()
        run_dir = run_folder(config, processes)
        lora_file, summary, blocked = train(config, run_dir, processes, gpus)
        # As Train LoRA's: after a dashboard Stop nothing downstream saves (or loads) the unfinished run.
        lora, folder = (
            (bridge.blocked(), bridge.blocked()) if blocked else (_lora_output(config, lora_file), str(run_dir))
        )
        return io.NodeOutput(
            lora,
            folder,
            outputs_images(run_dir),
            ui=ui.PreviewText(f"{summary}\nrun folder: {run_dir}\n{resolved.report()}"),
        )


NODES = [KilnTrainLoRATorchrun]
