"""What to do with a trained LoRA: Apply EMA, Save LoRA, Invert Adapter, Loss Graph, Convert LoRA; a full fine-tune's
Save Diffusion Model."""

from __future__ import annotations

import shutil
from pathlib import Path

from comfy_api.latest import io, ui

from ..trainer import paths, safetensors_io
from ..trainer.atomic import atomic_write
from ..trainer.archs import ARCHS, guess_arch
from ..trainer.config import CHOICES
from ..trainer.lora import files as lora_format
from ..trainer.run import folders as run_folders
from . import run
from .comfy import bridge
from .widgets import CATEGORY, STATE, checked


def lora_path(name: str, node: str = "Kiln Save LoRA") -> Path:
    """models/loras/<name>.safetensors; a name that would leave the folder is refused."""
    text = (name or "").strip().removesuffix(".safetensors")
    return paths.inside(bridge.folders()["loras"], text, f"{node}: name", subfolders=True, suffix=".safetensors")


def lora_target(name: str, overwrite: bool, node: str = "Kiln Save LoRA") -> Path:
    """lora_path; a file that exists is refused unless asked."""
    path = lora_path(name, node)
    if path.exists() and not overwrite:
        raise ValueError(f"{node}: {path} exists; choose another name or turn on overwrite")
    return path


RUN_KEY = run_folders.RUN_KEY  # the metadata key naming the run that wrote a file (nodes/run.py: run_key)


def written_by(path: Path) -> str | None:
    """The run that wrote a LoRA file (its kiln.run), or None: another tool, Kiln without a state, unreadable."""
    try:
        return safetensors_io.read_header(path)[1].get(RUN_KEY)
    except (OSError, ValueError):
        return None


def save_target(name: str, overwrite: bool, run_key: str | None) -> tuple[Path, str]:
    """(path, what the report says): a file this run wrote is replaced (re-queueing after a Stop & save, then
    the finished run); another run's, or any other file, only with overwrite; without a run, as lora_target."""
    if run_key is None:
        path = lora_target(name, overwrite)
        return path, "replaced" if path.exists() else "saved"
    path = lora_path(name)
    if not path.exists():
        return path, "saved"
    writer = written_by(path)
    if writer == run_key:
        return path, "replaced (same run)"
    if overwrite:
        return path, f"replaced ({f'run {writer}' if writer else 'a file of no Kiln run'}; overwrite on)"
    who = f"another run, {writer}" if writer else "no Kiln run (another tool, or Save LoRA without a state)"
    raise ValueError(
        f"Kiln Save LoRA: {path} exists, written by {who}; choose another name, or turn on overwrite to replace it"
    )


class KilnApplyEMA(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnApplyEMA",
            display_name="Kiln Apply EMA",
            category=f"{CATEGORY}/lora",
            description="The EMA weights of a run as a LORA_MODEL (and applied to a model, when given one).",
            inputs=[
                STATE.Input("state", tooltip="From Kiln Train LoRA or Kiln Load Run (trained with EMA on)"),
                io.Model.Input("model", optional=True, tooltip="A model to apply the EMA LoRA to"),
                io.Float.Input(
                    "strength",
                    default=1.0,
                    min=-10.0,
                    max=10.0,
                    step=0.05,
                    optional=True,
                    tooltip="LoRA strength on the model",
                ),
            ],
            outputs=[
                io.LoraModel.Output(display_name="lora", tooltip="The EMA LoRA"),
                io.Model.Output(display_name="model", tooltip="The model with the EMA LoRA (None without one)"),
            ],
        )

    @classmethod
    def execute(cls, state: run.KilnState, model=None, strength=1.0):
        if state.ema_lora is None:
            raise ValueError(
                f"Kiln Apply EMA: the run {state.run_dir} trained without EMA; turn ema on in "
                "Kiln Training Options, or use Train LoRA's lora output"
            )
        lora_model = bridge.lora_model_from(state.ema_lora, state.arch)
        return io.NodeOutput(lora_model, bridge.apply_lora(model, lora_model, strength) if model is not None else None)


class KilnSaveLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnSaveLoRA",
            display_name="Kiln Save LoRA",
            category=f"{CATEGORY}/lora",
            is_output_node=True,
            description="Write models/loras/<name>.safetensors; ComfyUI's LoRA loaders list it at once. With a "
            "state, the file records its run: saving the same run again replaces it, a file of "
            "another run (or of no run) needs overwrite.",
            inputs=[
                io.LoraModel.Input("lora", tooltip="From Kiln Train LoRA, Apply EMA or Invert Adapter"),
                io.String.Input(
                    "name",
                    default="kiln/my_lora",
                    tooltip="File name under models/loras/ (sub-folders with /; no .. or absolute paths)",
                ),
                io.Combo.Input(
                    "format",
                    options=list(CHOICES["lora_format"]),
                    default="comfy",
                    tooltip="comfy: ComfyUI keys; diffusers: split q/k/v, transformer. prefix, "
                    "alpha folded in (for diffusers' load_lora_weights / load_lora_adapter); "
                    "kohya: lora_unet_ names. All load in ComfyUI's LoRA loader.",
                ),
                io.Combo.Input(
                    "dtype", options=list(CHOICES["save_dtype"]), default="bf16", tooltip="Weight dtype in the file"
                ),
                io.String.Input(
                    "trigger_word",
                    default="",
                    optional=True,
                    tooltip="Stored in the metadata; left empty, the run's own (Load Dataset's, from the state input)",
                ),
                io.String.Input("notes", default="", multiline=True, optional=True, tooltip="Stored in the metadata"),
                io.Boolean.Input(
                    "overwrite",
                    default=False,
                    optional=True,
                    tooltip="Replace an existing file (one this run wrote is replaced without it)",
                ),
                STATE.Input(
                    "state",
                    optional=True,
                    tooltip="The run, for its config and step count in the "
                    "metadata, and which run wrote the file (a re-save of the same run replaces it)",
                ),
            ],
            outputs=[io.String.Output(display_name="path", tooltip="The written file")],
        )

    @classmethod
    def validate_inputs(cls, name=None):
        return checked(lora_path, name)

    @classmethod
    def execute(cls, lora, name, format, dtype, trigger_word="", notes="", overwrite=False, state=None):
        weights = bridge.lora_weights_from(lora)
        arch = state.arch if state is not None else guess_arch(weights)
        run_key = run.run_key(state) if state is not None else None
        path, done = save_target(name, overwrite, run_key)
        path.parent.mkdir(parents=True, exist_ok=True)
        # The trigger word is typed once, on Load Dataset: the run's config carries it to the file.
        trigger_word = trigger_word or (state.config.get("trigger_word", "") if state is not None else "")
        metadata = lora_format.build_metadata(
            arch_name=arch or "generic",
            config=state.config if state is not None else {},
            steps=state.step if state is not None else 0,
            trigger_words=[trigger_word] if trigger_word else [],
            title=path.stem,
            notes=notes,
        )
        if run_key is not None:
            metadata[RUN_KEY] = run_key
        lora_format.save_lora(path, weights, arch=arch, fmt=format, dtype=dtype, metadata=metadata)  # atomic
        bridge.refresh_loras()
        step = f", step {state.step}" if state is not None else ""
        return io.NodeOutput(
            str(path), ui=ui.PreviewText(f"{done} {path} ({format}, {dtype}, {len(weights)} modules{step})")
        )


class KilnInvertAdapter(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnInvertAdapter",
            display_name="Kiln Invert Adapter",
            category=f"{CATEGORY}/lora",
            description="Remove an adapter from a model by applying it at −strength (e.g. a Z-Image Turbo "
            "training adapter merged into a checkpoint).",
            inputs=[
                io.Model.Input("model", tooltip="The model the adapter is in"),
                io.Combo.Input(
                    "adapter_file",
                    options=["none", *bridge.lora_names()],
                    default="none",
                    tooltip="The adapter LoRA file (or connect a LORA_MODEL)",
                ),
                io.Float.Input(
                    "strength", default=1.0, min=-10.0, max=10.0, step=0.05, tooltip="The strength it was applied at"
                ),
                io.LoraModel.Input(
                    "adapter", optional=True, tooltip="The adapter as a LORA_MODEL (wins over the file)"
                ),
            ],
            outputs=[
                io.Model.Output(display_name="model", tooltip="The model with the adapter removed"),
                io.LoraModel.Output(display_name="inverted", tooltip="The adapter negated, as a LORA_MODEL"),
            ],
        )

    @classmethod
    def execute(cls, model, adapter_file, strength, adapter=None):
        if adapter is None:
            if adapter_file in (None, "none"):
                raise ValueError("Kiln Invert Adapter: choose an adapter_file or connect an adapter LORA_MODEL")
            adapter = bridge.load_lora_file(bridge.lora_path(adapter_file))
            bridge.require_fit(model, adapter, f"Kiln Invert Adapter: adapter_file {adapter_file!r}")
        inverted = bridge.negate_lora(adapter, strength)
        return io.NodeOutput(bridge.apply_lora(model, inverted, 1.0), inverted)


class KilnLossGraph(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnLossGraph",
            display_name="Kiln Loss Graph",
            category=f"{CATEGORY}/lora",
            is_output_node=True,
            description="Raw and smoothed loss, and the learning rate, against step.",
            inputs=[
                io.LossMap.Input("loss_map", optional=True, tooltip="A LOSS_MAP (Kiln's or ComfyUI's trainer)"),
                STATE.Input("state", optional=True, tooltip="A KILN_STATE (also draws the learning rate)"),
            ],
            outputs=[io.Image.Output(display_name="image", tooltip="The graph")],
        )

    @classmethod
    def execute(cls, loss_map=None, state=None):
        from ..trainer.run.plot import loss_curve

        if state is not None:
            image = run.loss_image(state)
        elif loss_map is not None:
            image = bridge.image_tensor(loss_curve(list(loss_map["loss"]), None, title="loss"))
        else:
            raise ValueError("Kiln Loss Graph: connect a loss_map or a state")
        return io.NodeOutput(image, ui=ui.PreviewImage(image, cls=cls))


class KilnConvertLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnConvertLoRA",
            display_name="Kiln Convert LoRA",
            category=f"{CATEGORY}/lora",
            is_output_node=True,
            description="Rewrite another trainer's LoRA (ai-toolkit, musubi-tuner, SimpleTuner, diffusers/PEFT, "
            "kohya, ComfyUI's trainer, LyCORIS LoKr/LoHa) as a file ComfyUI loads key for key; "
            "the report lists every key it could not place.",
            inputs=[
                io.Combo.Input("lora_file", options=bridge.lora_names(), tooltip="The LoRA to read (models/loras)"),
                io.String.Input(
                    "name",
                    default="",
                    tooltip="File name under models/loras/ for the result "
                    "(sub-folders with /); empty: <lora_file>_comfy",
                ),
                io.Combo.Input(
                    "arch",
                    options=["auto", *ARCHS],
                    default="auto",
                    tooltip="The model family the LoRA is for; auto: the file's kiln.arch, else the "
                    "one whose module names its keys fit",
                ),
                io.Boolean.Input(
                    "allow_unplaced",
                    default=False,
                    tooltip="Write the keys that fit and list the "
                    "others in the report, instead of stopping with the list",
                ),
                io.Boolean.Input("overwrite", default=False, tooltip="Replace an existing file"),
            ],
            outputs=[
                io.LoraModel.Output(display_name="lora", tooltip="The converted LoRA (for LoraModelLoader)"),
                io.String.Output(display_name="path", tooltip="The written file"),
                io.String.Output(display_name="report", tooltip="How the file was read; keys not placed"),
            ],
        )

    @classmethod
    def validate_inputs(cls, name=None):  # empty: <lora_file>_comfy
        return checked(lambda text: text.strip() and lora_path(text, "Kiln Convert LoRA"), name)

    @classmethod
    def execute(cls, lora_file, name, arch, allow_unplaced, overwrite):
        source = bridge.lora_path(lora_file)
        path = lora_target(name or f"{Path(lora_file).with_suffix('')}_comfy", overwrite, "Kiln Convert LoRA")
        path.parent.mkdir(parents=True, exist_ok=True)
        converted = lora_format.convert_file(
            source, path, arch=None if arch == "auto" else arch, allow_unplaced=allow_unplaced
        )
        bridge.refresh_loras()
        report = f"{converted.report()}\nwrote {path}"
        return io.NodeOutput(bridge.load_lora_file(path), str(path), report, ui=ui.PreviewText(report))


class KilnSaveDiffusionModel(io.ComfyNode):
    """Save LoRA's sibling for a full fine-tune (Training Options: adapter full)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnSaveDiffusionModel",
            display_name="Kiln Save Diffusion Model",
            category=f"{CATEGORY}/lora",
            is_output_node=True,
            description="A full fine-tune's model (adapter full; EMA weights when on) as "
            "models/diffusion_models/<name>.safetensors, in ComfyUI's own layout: Load Diffusion Model lists it "
            "at once. Kiln Extract LoRA turns it and its base into a LoRA.",
            inputs=[
                STATE.Input("state", tooltip="From Kiln Train LoRA (or Load Run) of a run with adapter full"),
                io.String.Input(
                    "name",
                    default="kiln/my_model",
                    tooltip="File name under models/diffusion_models/ (sub-folders with /; no .. or absolute paths)",
                ),
                io.Boolean.Input("overwrite", default=False, tooltip="Replace a file of that name"),
            ],
            outputs=[io.String.Output(display_name="path", tooltip="The written file")],
        )

    @classmethod
    def execute(cls, state: run.KilnState, name, overwrite):
        node = "Kiln Save Diffusion Model"
        if not state.model_file:
            raise ValueError(
                f"{node}: this run trained adapter {state.config.get('adapter')!r}, not a full "
                "fine-tune; save it with Kiln Save LoRA, or set adapter to full in Training Options"
            )
        folder = bridge.folders()["diffusion_models"]
        path = paths.inside(
            folder, name.strip().removesuffix(".safetensors"), f"{node}: name", subfolders=True, suffix=".safetensors"
        )
        if path.exists() and not overwrite:
            raise ValueError(f"{node}: {path} exists; choose another name or turn on overwrite")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(state.model_file, "rb") as source:  # atomic: a reader never sees half a model
            atomic_write(path, lambda out: shutil.copyfileobj(source, out))
        bridge.refresh_models("diffusion_models")
        return io.NodeOutput(str(path), ui=ui.PreviewText(f"saved {path} (step {state.step})"))


NODES = [KilnApplyEMA, KilnSaveLoRA, KilnInvertAdapter, KilnLossGraph, KilnConvertLoRA, KilnSaveDiffusionModel]
