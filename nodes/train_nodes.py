"""Train LoRA and the nodes that feed it: Training Options, Validation Settings, Load Run."""

from __future__ import annotations

from pathlib import Path

from comfy_api.latest import io, ui

from ..trainer import config as cfg_module
from ..trainer.archs import ARCHS
from ..trainer.config import layers as config_layers
from ..trainer.run import init_lora as init_module
from ..trainer.samples.plan import SAMPLE_FRAMES
from . import live, run, validation_chain
from .comfy import bridge
from .option_nodes import OPTION_FIELDS, KilnTrainingOptions, option_values  # noqa: F401 (kept here one release)
from .widgets import CATEGORY, DATASET, OPTIONS, STATE, STEPS_TOOLTIP, VALIDATION, checked, preset_input, widget

TRAIN_WIDGETS = cfg_module.TRAIN_WIDGETS  # the settings declared node="train", in slot order
# Validation Settings' last inputs, frames then start_latent (added after the shipped ones: saved workflows keep
# their values).
FRAMES_INPUT = io.Int.Input(
    "frames",
    default=SAMPLE_FRAMES,
    min=1,
    max=1025,
    step=4,  # as ComfyUI's own video latents (EmptyHunyuanLatentVideo's length): 1, 5, ..., 33
    tooltip="Video models (Wan): frames per sample clip (4k+1: 33 = 2 s at 16 fps), saved as an animated WebP; "
    "image models ignore it",
)

START_LATENT_INPUT = io.Latent.Input(
    "start_latent",
    optional=True,
    tooltip="A LATENT to start each sample from, as KSampler takes it: Wan22ImageToVideoLatent's for Wan 2.2 5B "
    "image-to-video samples (the start image stays as the first frame). Its size replaces width, height and "
    "frames. Unset: an empty latent of that size",
)


class KilnValidationSettings(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnValidationSettings",
            display_name="Kiln Validation Settings",
            category=f"{CATEGORY}/train",
            description="Sample images during training with ComfyUI's own sampler (EMA weights when EMA is on, "
            "the model without the training adapter). Samples stream as previews. A video model samples short "
            "clips (animated WebP).",
            inputs=[
                io.Conditioning.Input("positive", tooltip="Prompt to sample (use the trigger word)"),
                io.Conditioning.Input("negative", tooltip="Negative prompt (an empty CLIP Text Encode is fine)"),
                io.Vae.Input("vae", tooltip="VAE to decode the samples"),
                io.Int.Input(
                    "seed",
                    default=0,
                    min=0,
                    max=2**32 - 1,
                    control_after_generate=io.ControlAfterGenerate.fixed,
                    tooltip="Sampling seed (fixed: compare steps)",
                ),
                io.Int.Input("steps", default=8, min=1, max=200, tooltip="Sampling steps (Turbo: 8)"),
                io.Float.Input(
                    "cfg", default=1.0, min=0.0, max=30.0, step=0.1, tooltip="CFG scale (Turbo, Klein: 1.0)"
                ),
                io.Combo.Input(
                    "sampler_name", options=bridge.sampler_names(), default="euler", tooltip="ComfyUI sampler"
                ),
                io.Combo.Input(
                    "scheduler", options=bridge.scheduler_names(), default="simple", tooltip="ComfyUI scheduler"
                ),
                io.Int.Input("width", default=512, min=64, max=4096, step=16, tooltip="Sample width"),
                io.Int.Input("height", default=512, min=64, max=4096, step=16, tooltip="Sample height"),
                io.Int.Input(
                    "every",
                    default=250,
                    min=1,
                    max=1_000_000,
                    tooltip="Sample every N steps and at the end (in a chain, the smallest every of the chain)",
                ),
                VALIDATION.Input(
                    "validation",
                    optional=True,
                    tooltip="Another Kiln Validation Settings: its "
                    "prompts are sampled first, then this one (one column of the sample grid each)",
                ),
                FRAMES_INPUT,
                START_LATENT_INPUT,
            ],
            outputs=[
                VALIDATION.Output(
                    display_name="validation",
                    tooltip="Plug into Kiln Train LoRA, or into another Validation Settings to sample several prompts",
                )
            ],
            hidden=[io.Hidden.prompt, io.Hidden.unique_id],  # the positive prompt's text heads its grid column
        )

    @classmethod
    def execute(cls, validation=None, **values):
        hidden = cls.hidden  # None when called outside a prompt (tests)
        text = validation_chain.header(getattr(hidden, "prompt", None), getattr(hidden, "unique_id", None))
        return io.NodeOutput(validation_chain.chain(validation, validation_chain.Validation(**values, prompt=text)))


# What the model input's tooltip lists: the archs detected from a ComfyUI model, in registry order.
MODEL_FAMILIES = [arch.name for arch in ARCHS.values() if arch.comfy is not None]


def build_config(
    model, dataset, widgets: dict, preset: str, options: dict | None, adapter: bool
) -> config_layers.Resolved:
    """preset < option nodes < this node's widgets < the dataset's own settings < the detected arch.

    Every value a connected option node sets wins over the preset, at its default or not: connect only the
    option nodes whose settings you mean to set (Kiln EMA & Held-out alone keeps the preset's loss weighting)."""
    arch = bridge.detect_arch(model, adapter=adapter)  # with a training adapter: Z-Image Turbo
    s = dataset.settings
    data = dict(
        resolutions=list(s.resolutions),
        repeats=s.repeats,
        caption_dropout=s.caption_dropout,
        trigger_word=s.captions.trigger_word,
        dataset_dir=dataset.report.root,
        preservation_class=dataset.preservation_class,
    )
    reg = dataset.regularisation
    if reg is not None:
        data.update(reg_dataset_dir=reg.report.root, reg_repeats=reg.settings.repeats)
    layers = [("options", options or {}), ("Train LoRA", widgets), ("dataset", data), ("model", {"arch": arch})]
    return config_layers.resolve(layers, preset=None if preset == "none" else preset)


def start_from(cfg, lora_model, file_name: str, resume):
    """(config, init LoRA): the init_lora input or file read, and its rank, alpha and sha256 in the config
    (before the run folder is hashed). Resuming a run started from a LoRA keeps that run's rank, alpha and
    record, and starts from its checkpoint, not from a LoRA."""
    where = "Kiln Train LoRA"
    chosen = file_name not in (None, "none")
    if lora_model is not None and chosen:
        raise ValueError(
            f"{where}: both init_lora and init_lora_file are set; connect one LoRA to start from "
            "(set init_lora_file to none, or disconnect init_lora)"
        )
    if resume is not None and (lora_model is not None or chosen):
        raise ValueError(
            f"{where}: resume continues a run from its checkpoint, init_lora starts a new one from "
            "a LoRA; connect one of them"
        )
    if resume is not None and resume.config.get("init_lora_sha256"):
        started = {key: resume.config[key] for key in ("rank", "alpha", "init_lora", "init_lora_sha256")}
        return cfg_module.replace(cfg, **started), None
    if lora_model is None and not chosen:
        return cfg, None
    try:
        init = (
            init_module.from_file(bridge.lora_path(file_name), cfg.arch)
            if chosen
            else init_module.from_tensors_named(bridge.lora_arrays(lora_model), "LORA_MODEL", cfg.arch)
        )
        return init_module.settle(cfg, init), init
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


FULL_HAS_NO_LORA = (
    "Kiln Train LoRA: this run trained every weight (adapter full), so it has no LoRA output: save the model "
    "with Kiln Save Diffusion Model from its state output, or make a LoRA of it with Kiln Extract LoRA"
)


def trained_outputs(model, outcome: run.Outcome) -> tuple:
    """(model, lora, state): what leads to a saved LoRA, blocked after a dashboard Stop (the run is not done, so
    Save LoRA and every other node downstream is skipped). loss_map and samples still flow: they show how far the
    run got and write nothing under a LoRA's final name."""
    if outcome.blocked:
        return bridge.blocked(), bridge.blocked(), bridge.blocked()
    state = outcome.state
    if state.model_file:  # adapter full: the trained model itself, and no LoRA to save
        return bridge.with_weights(model, state.model_file), bridge.blocked(FULL_HAS_NO_LORA), state
    lora_model = bridge.lora_model_from(state.best_lora(), state.arch)
    return bridge.apply_lora(model, lora_model, 1.0), lora_model, state


def train_inputs() -> list:
    """Train LoRA's model, dataset and widgets: the settings declared node="train" in slot order, the preset
    combo after the optimizer (where 0.1.0 put it: widgets_values are positional)."""
    widgets = [widget(name, tooltip_text=STEPS_TOOLTIP if name == "steps" else None) for name in TRAIN_WIDGETS]
    cut = TRAIN_WIDGETS.index("optimizer") + 1
    return [
        io.Model.Input(
            "model",
            tooltip="A model of a Kiln family (" + ", ".join(MODEL_FAMILIES) + "), "
            "or any ComfyUI model (then list targets in Training Options)",
        ),
        DATASET.Input("dataset", tooltip="From Kiln Encode Captions (latents and captions encoded)"),
        *widgets[:cut],
        preset_input(),
        *widgets[cut:],
    ]


def train_sockets() -> list:
    """Train LoRA's optional inputs, after its widgets."""
    loras = ["none", *bridge.lora_names()]
    return [
        OPTIONS.Input(
            "options",
            optional=True,
            tooltip="From Kiln Training Options or a chain of the smaller option nodes; every value they set wins "
            "over the preset",
        ),
        io.Combo.Input(
            "training_adapter",
            options=loras,
            default="none",
            optional=True,
            tooltip="Z-Image Turbo: the training adapter LoRA, merged at +1 for training, removed for samples, "
            "never saved",
        ),
        STATE.Input(
            "resume", optional=True, tooltip="A KILN_STATE to continue (from another Train LoRA or Kiln Load Run)"
        ),
        VALIDATION.Input(
            "validation",
            optional=True,
            tooltip="From Kiln Validation Settings (chain several to sample several prompts)",
        ),
        io.LoraModel.Input(
            "init_lora",
            optional=True,
            tooltip="A LoRA to start from instead of a new one (a LORA_MODEL: another Train LoRA, Kiln Convert "
            "LoRA, Merge/Resize LoRA); its rank and alpha replace rank and alpha. Ignored when resuming",
        ),
        io.Combo.Input(
            "init_lora_file",
            options=loras,
            default="none",
            optional=True,
            tooltip="A LoRA file (models/loras; ai-toolkit, musubi-tuner, SimpleTuner, diffusers/PEFT, kohya, "
            "ComfyUI or Kiln layout) to start from, as init_lora",
        ),
        DATASET.Input(
            "reg_dataset",
            optional=True,
            tooltip="Regularisation images (prior preservation): a folder of class images with their own "
            "captions, through Load Dataset (its repeats are reg_repeats; no trigger word), Encode Images and "
            "Encode Captions with the same VAE and text encoder. Trained in batches of their own each epoch, "
            "their loss times reg_weight (Training Options)",
        ),
    ]


class KilnTrainLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnTrainLoRA",
            display_name="Kiln Train LoRA",
            category=f"{CATEGORY}/train",
            description="Train a LoRA on the model in place (side branches; the model is left as it was). "
            "Checkpoints go to output/kiln/<run>; re-queueing resumes a stopped run and reuses a "
            "finished one. The dashboard's Stop skips the nodes after this one (the run is not done); "
            "its Stop & save passes the LoRA as of that step on.",
            is_output_node=True,
            inputs=[*train_inputs(), *train_sockets()],
            outputs=[
                io.Model.Output(
                    display_name="model",
                    tooltip="The input model with the trained LoRA (EMA weights when EMA is on), ready for KSampler; "
                    "of a full fine-tune (adapter full) the trained model itself",
                ),
                io.LoraModel.Output(
                    display_name="lora",
                    tooltip="The trained LoRA (ComfyUI's LORA_MODEL); none of a full fine-tune (save its state with "
                    "Kiln Save Diffusion Model)",
                ),
                STATE.Output(display_name="state", tooltip="The resumable run (KILN_STATE)"),
                io.LossMap.Output(display_name="loss_map", tooltip="Loss per step (ComfyUI's LOSS_MAP)"),
                io.Image.Output(display_name="samples", tooltip="Validation samples, else the loss curve"),
            ],
        )

    @classmethod
    def fingerprint_inputs(cls, **_inputs):
        return live.fingerprint()  # after a dashboard Stop, queueing again resumes instead of reusing the cache

    @classmethod
    def execute(
        cls,
        model,
        dataset,
        steps,
        learning_rate,
        rank,
        alpha,
        optimizer,
        preset,
        backend,
        seed,
        options=None,
        training_adapter="none",
        resume=None,
        validation=None,
        init_lora=None,
        init_lora_file="none",
        reg_dataset=None,
    ):
        widgets = dict(
            steps=steps,
            learning_rate=learning_rate,
            rank=rank,
            alpha=alpha,
            optimizer=optimizer,
            backend=backend,
            seed=seed,
        )
        adapter = (
            None if training_adapter in (None, "none") else bridge.load_lora_file(bridge.lora_path(training_adapter))
        )
        if adapter is not None:
            bridge.require_fit(model, adapter, f"Kiln Train LoRA: training_adapter {training_adapter!r}")
        dataset = dataset.with_regularisation(reg_dataset)
        resolved = build_config(model, dataset, widgets, preset, options, adapter is not None)
        cfg, init = start_from(resolved.config, init_lora, init_lora_file, resume)
        resolved = resolved.then(cfg, "init LoRA" if init is not None else "resumed run")
        outcome = run.execute(
            cfg,
            model,
            dataset,
            adapter=adapter,
            resume_state=resume,
            validation=validation,
            output_root=Path(bridge.folders()["output"]) / "kiln",
            init=init,
        )
        state = outcome.state
        images = bridge.cat_images(outcome.samples) if outcome.samples else run.loss_image(state)
        return io.NodeOutput(
            *trained_outputs(model, outcome),
            bridge.loss_map(state.history.loss),
            images,
            ui=ui.PreviewText(f"{outcome.message}\n{resolved.report()}"),
        )


class KilnLoadRun(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnLoadRun",
            display_name="Kiln Load Run",
            category=f"{CATEGORY}/train",
            description="A run folder (or one step-NNNNNN checkpoint) as KILN_STATE: resume it in Train LoRA, "
            "or take its LoRA with Apply EMA.",
            inputs=[
                io.String.Input(
                    "run_folder",
                    default="",
                    tooltip="A folder under output/kiln/ (name, "
                    "or an absolute path; the 'choose a run…' button lists them); its newest "
                    "complete checkpoint is used",
                )
            ],
            outputs=[STATE.Output(display_name="state", tooltip="The run state (KILN_STATE)")],
        )

    @classmethod
    def validate_inputs(cls, run_folder=None):
        return checked(run.resolve_run, run_folder)

    @classmethod
    def fingerprint_inputs(cls, run_folder):
        return str(run.resolve_run(run_folder))

    @classmethod
    def execute(cls, run_folder):
        state = run.KilnState.from_checkpoint(run.resolve_run(run_folder))
        return io.NodeOutput(state, ui=ui.PreviewText(f"{state.checkpoint}: step {state.step}, arch {state.arch}"))


NODES = [KilnTrainingOptions, KilnValidationSettings, KilnTrainLoRA, KilnLoadRun]
