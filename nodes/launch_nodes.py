"""Kiln Train LoRA (several GPUs): the headless run under torchrun, started from a graph (#22).

A child process cannot take the graph's in-memory MODEL, so this node names model files as a headless
config does; trainer/launch.py writes `<run>/launch.toml` and runs `torchrun -m trainer train` on the
chosen GPUs (ComfyUI's loaders used as a library through headless.py, never ComfyUI's main). Progress
lines move the node's bar; Stop asks every rank for a clean checkpoint; re-queueing resumes."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from comfy_api.latest import io, ui

from ..trainer import config as cfg_module
from ..trainer import launch, paths
from ..trainer import state as state_module
from ..trainer.archs import ARCHS
from . import run
from .comfy import bridge
from .widgets import CATEGORY, OPTIONS, parse_list, widget

WHERE = "Kiln Train LoRA (several GPUs)"
FILES = {"model_file": ("diffusion_models", "model_path"), "vae_file": ("vae", "vae_path"),
         "text_encoder_file": ("text_encoders", "text_encoder_path"), "training_adapter": ("loras", "training_adapter")}


def _file_input(name: str, folder: str, tooltip: str, optional: bool = False):
    return io.Combo.Input(name, options=["none", *bridge.model_names(folder)], default="none", optional=optional,
                          tooltip=tooltip)


def build_config(arch: str, files: dict, values: dict, preset: str, options: dict | None) -> dict:
    """preset < Training Options (those off their defaults, with a preset) < this node's widgets."""
    defaults = cfg_module.TrainConfig().to_dict()
    merged = {k: v for k, v in (options or {}).items() if preset == "none" or v != defaults.get(k)}
    merged.update(values, arch=arch)
    for name, chosen in files.items():
        folder, key = FILES[name]
        if chosen not in (None, "none"):
            merged[key] = bridge.model_path(folder, chosen)
        elif arch != "demo" and name != "training_adapter":
            raise ValueError(f"{WHERE}: arch {arch!r} trains ComfyUI's model from files; choose {name} "
                             f"(a file in models/{folder}), or arch 'demo' to try it without one")
    try:
        return cfg_module.from_dict(merged, preset=None if preset == "none" else preset).to_dict()
    except cfg_module.ConfigError as error:
        raise ValueError(f"{WHERE}: {error}") from None


def run_folder(config: dict, processes: int) -> Path:
    """output/kiln/<run_name or arch>-<hash of what is trained, on how many processes>."""
    if config.get("run_name"):
        paths.check_name(config["run_name"], "Kiln Training Options: run_name")
    values = {k: v for k, v in config.items() if k not in run.NOT_IDENTITY + cfg_module.SAMPLE_FIELDS}
    blob = json.dumps([values, config["dataset_dir"], processes], sort_keys=True, default=str)
    name = f"{config.get('run_name') or config['arch']}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"
    return paths.inside(Path(bridge.folders()["output"]) / "kiln", name, "Kiln Training Options: run_name")


def train(config: dict, run_dir: Path, processes: int, gpus: str) -> tuple[Path, str]:
    """The run's LoRA file and a summary: trained (or resumed) under torchrun, or found finished."""
    found = state_module.list_checkpoints(run_dir)
    lora_file = run_dir / f"{run_dir.name}.safetensors"
    if found and found[-1][0] >= config["steps"] and lora_file.is_file():
        return lora_file, f"already trained: {found[-1][1]}; loaded its LoRA instead of training again"
    job = launch.Launch(config, run_dir, processes=processes, gpus=gpus,
                        comfyui_path=None if config["arch"] == "demo" else bridge.comfyui_root())
    bar = bridge.progress(config["steps"])
    job.start(resume=bool(found))
    try:
        outcome = job.wait(on_progress=lambda p: bar.update(p["step"]), should_stop=bridge.interrupt_requested)
    except BaseException:
        job.stop()   # Stop pressed (Progress.update raised) or any error here: a clean checkpoint, then raise
        job.wait()
        raise
    if outcome.stopped:
        bar.update(outcome.step)   # raises ComfyUI's interruption: the run stopped with a checkpoint
    if outcome.returncode != 0 or outcome.lora is None:
        raise RuntimeError(f"{WHERE}: the torchrun run in {run_dir} ended with exit code {outcome.returncode} and "
                           f"no LoRA; its last output:\n{outcome.tail}\nFix what it names, then queue again "
                           "(a run with a checkpoint resumes)")
    return outcome.lora, f"trained to step {outcome.step}/{config['steps']} on {processes} process(es)"


class KilnTrainLoRATorchrun(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnTrainLoRATorchrun", display_name="Kiln Train LoRA (several GPUs)",
            category=f"{CATEGORY}/train", is_output_node=True,
            description="Train a LoRA from model files on several GPUs: the headless run under torchrun as a "
                        "child process (one process per GPU). Stop saves a checkpoint on every rank; "
                        "re-queueing resumes it. The run folder holds launch.toml, checkpoints and the LoRA.",
            inputs=[
                io.Combo.Input("arch", options=list(ARCHS), default="demo",
                               tooltip="The model family of model_file (demo: a tiny model, no files)"),
                _file_input("model_file", "diffusion_models", "The diffusion model (models/diffusion_models)"),
                _file_input("vae_file", "vae", "The model's VAE (models/vae)"),
                _file_input("text_encoder_file", "text_encoders", "The model's text encoder (models/text_encoders)"),
                io.String.Input("dataset_dir", default="", tooltip="A folder of images with same-name .txt "
                                "captions (the child encodes it and caches latents and texts)"),
                io.String.Input("resolutions", default="512", tooltip="Training resolutions, e.g. '512, 768'"),
                io.String.Input("trigger_word", default="", tooltip="Replaces {trigger} in the captions"),
                widget("steps", default=1000, tooltip_text="Total optimizer steps (a resumed run continues to this)"),
                widget("learning_rate"),
                widget("rank"),
                widget("alpha"),
                io.Combo.Input("preset", options=["none", *cfg_module.PRESETS], default="none",
                               tooltip="Fills the settings that are neither on this node nor in Training Options"),
                widget("seed"),
                io.Int.Input("processes", default=2, min=1, max=64, tooltip="torchrun processes, one per GPU "
                             "(batch_size is per process)"),
                io.String.Input("gpus", default="", tooltip="GPU indices for the run, e.g. '0,1' "
                                "(CUDA_VISIBLE_DEVICES); blank: the first `processes` GPUs"),
                OPTIONS.Input("options", optional=True, tooltip="From Kiln Training Options"),
                _file_input("training_adapter", "loras", "Z-Image Turbo: the training adapter LoRA", optional=True),
            ],
            outputs=[
                io.LoraModel.Output(display_name="lora", tooltip="The trained LoRA (ComfyUI's LORA_MODEL)"),
                io.String.Output(display_name="run_folder", tooltip="The run folder (Kiln Load Run reads it)"),
            ],
        )

    @classmethod
    def execute(cls, arch, model_file, vae_file, text_encoder_file, dataset_dir, resolutions, trigger_word, steps,
                learning_rate, rank, alpha, preset, seed, processes, gpus, options=None, training_adapter="none"):
        if not dataset_dir.strip():
            raise ValueError(f"{WHERE}: dataset_dir is empty; name a folder of images with .txt captions")
        values = {"dataset_dir": dataset_dir.strip(), "resolutions": parse_list(resolutions, int),
                  "trigger_word": trigger_word, "steps": steps, "learning_rate": learning_rate, "rank": rank,
                  "alpha": alpha, "seed": seed}
        files = {"model_file": model_file, "vae_file": vae_file, "text_encoder_file": text_encoder_file,
                 "training_adapter": training_adapter}
        config = build_config(arch, files, values, preset, options)
        run_dir = run_folder(config, processes)
        lora_file, summary = train(config, run_dir, processes, gpus)
        lora_model = bridge.load_lora_file(lora_file)
        return io.NodeOutput(lora_model, str(run_dir), ui=ui.PreviewText(f"{summary}\nrun folder: {run_dir}"))


NODES = [KilnTrainLoRATorchrun]
