"""The option nodes: Kiln Training Options (every setting declared node="options", trainer/config), and the
smaller ones, Training Options cut by each setting's group.

Each sets only its own settings and takes an optional `options` input, so they chain in any order into one
KILN_TRAIN_OPTIONS: a node's own values win over the ones it receives (the node nearer Train LoRA wins), and
every value set on a connected option node wins over Train LoRA's preset.
"""

from __future__ import annotations

from comfy_api.latest import io

from ..trainer import config as cfg_module
from .widgets import CATEGORY, OPTIONS, from_widget, parse_list, run_name_check, widget

# Training Options' widgets as shipped in 0.1.0. A saved workflow's widgets_values are positional, so this
# order is forever: a field added to trainer/config later goes after these, in field order
# (tests/nodes/test_saved_workflows.py holds every node's shipped order and today's workflows).
SHIPPED_OPTION_ORDER = (
    "device",
    "mixed_precision",
    "base_quantize",
    "lora_dropout",
    "targets",
    "batch_size",
    "grad_accum",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "lr_schedule",
    "warmup_steps",
    "min_lr_ratio",
    "max_grad_norm",
    "gradient_checkpointing",
    "skip_checkpoint_blocks",
    "compile_blocks",
    "checkpoint_budget",
    "attention",
    "timestep_sampling",
    "logit_mean",
    "logit_std",
    "shift_mode",
    "shift",
    "content_or_style",
    "loss_weighting",
    "ema",
    "ema_decay",
    "run_name",
    "checkpoint_every",
    "keep_checkpoints",
    "log_every",
    "save_dtype",
    "lora_format",
)
# Fields added since 0.1.0, in the order main has served them (session workflows saved with them keep their
# positions); a field added to trainer/config later goes after these, in field order.
OPTIONS_SINCE_0_1 = (
    "batch_by",
    "fp8_compute",
    "unmasked_weight",
    "checkpoint_loras",
    "log_tensorboard",
    "wandb_project",
    "wandb_mode",
    "adapter",
    "lokr_factor",
    "lokr_full_w2",
    "holdout",
    "holdout_every",
    "holdout_sigmas",
    "early_stop_patience",
    "early_stop_min_delta",
    "preservation_weight",
    "reg_weight",
    "cuda_graphs",
    "step_graphs",
    "stream_blocks",
    "sigma_range",
    "offload_activations",
)
# The settings an option node shows: those declared node="options" (trainer/config).
_OPTION_NAMES = [name for name, node in cfg_module.NODE.items() if node == "options"]
_PINNED = SHIPPED_OPTION_ORDER + OPTIONS_SINCE_0_1
OPTION_FIELDS = tuple(
    [name for name in _PINNED if name in _OPTION_NAMES] + [name for name in _OPTION_NAMES if name not in _PINNED]
)
LIST_FIELDS = {"targets": str}


def option_values(values: dict) -> dict:
    """An option node's widget values as the config takes them (lists parsed, the auto widgets' words)."""
    lists = {name: parse_list(values[name], kind) for name, kind in LIST_FIELDS.items() if name in values}
    return {name: from_widget(name, value) for name, value in {**values, **lists}.items()}


class KilnTrainingOptions(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnTrainingOptions",
            display_name="Kiln Training Options",
            category=f"{CATEGORY}/train",
            description="Every other training setting (experts' ones under the node's Show advanced). When "
            "connected, all these values win over the preset; the smaller option nodes (Kiln/train/"
            "options) set only their own.",
            inputs=[widget(name) for name in OPTION_FIELDS],
            outputs=[OPTIONS.Output(display_name="options", tooltip="Plug into Kiln Train LoRA")],
        )

    @classmethod
    def validate_inputs(cls, run_name=None):
        return run_name_check(run_name)

    @classmethod
    def execute(cls, **values):
        return io.NodeOutput(option_values(values))


# Each node's widgets as first shipped, everyday settings first. Saved workflows hold widgets_values by
# position, so this order is forever: a setting added to a group later goes after these (group_fields).
SHIPPED_GROUP_ORDER = {
    "training": (
        "lr_schedule",
        "warmup_steps",
        "batch_size",
        "grad_accum",
        "weight_decay",
        "min_lr_ratio",
        "max_grad_norm",
        "batch_by",
        "adam_beta1",
        "adam_beta2",
        "adam_eps",
    ),
    "objective": (
        "content_or_style",
        "loss_weighting",
        "timestep_sampling",
        "unmasked_weight",
        "preservation_weight",
        "reg_weight",
        "shift_mode",
        "shift",
        "logit_mean",
        "logit_std",
    ),
    "ema": (
        "ema",
        "ema_decay",
        "holdout",
        "holdout_every",
        "early_stop_patience",
        "early_stop_min_delta",
        "holdout_sigmas",
    ),
    "adapter": ("adapter", "lora_dropout", "targets", "lokr_factor", "lokr_full_w2"),
    "speed": (
        "device",
        "mixed_precision",
        "gradient_checkpointing",
        "compile_blocks",
        "fp8_compute",
        "step_graphs",
        "cuda_graphs",
        "checkpoint_budget",
        "skip_checkpoint_blocks",
        "attention",
        "base_quantize",
        "stream_blocks",
        "offload_activations",
    ),
    "output": (
        "run_name",
        "checkpoint_every",
        "keep_checkpoints",
        "checkpoint_loras",
        "save_dtype",
        "lora_format",
        "log_tensorboard",
        "wandb_project",
        "wandb_mode",
        "log_every",
    ),
}
_CHAIN = (
    "Chain option nodes through `options`: this node's values win over the ones it receives, and each "
    "wins over Train LoRA's preset."
)
# group → (node id, display name, what it sets); node ids are forever.
GROUP_NODES = {
    "training": (
        "KilnOptimizerOptions",
        "Kiln Optimizer & Schedule",
        "Learning-rate schedule and warm-up, batch size and gradient accumulation, weight decay; "
        "clipping and Adam's betas and eps under Show advanced.",
    ),
    "objective": (
        "KilnNoiseLossOptions",
        "Kiln Noise & Loss",
        "Which noise levels train (content or style, timestep sampling, shift) and how the loss is "
        "weighted (bell, masks, preservation and regularisation weights).",
    ),
    "ema": (
        "KilnEMAHoldoutOptions",
        "Kiln EMA & Held-out",
        "An EMA of the LoRA weights (used for samples and saves); images held out for a held-out loss, and "
        "early stopping on it.",
    ),
    "adapter": (
        "KilnAdapterOptions",
        "Kiln Adapter",
        "The adapter kind (LoRA, LoKr, LoHa, DoRA), its dropout and the modules it targets.",
    ),
    "speed": (
        "KilnSpeedMemoryOptions",
        "Kiln Speed & Memory",
        "Device, mixed precision and gradient checkpointing; compiled blocks, fp8, CUDA graphs and the "
        "attention kernel under Show advanced (auto picks them for the GPU).",
    ),
    "output": (
        "KilnSavingLoggingOptions",
        "Kiln Saving & Logging",
        "Run name, checkpoints and their LoRAs, the saved dtype and format, TensorBoard and W&B logging.",
    ),
}


def group_fields(group: str) -> tuple[str, ...]:
    """The option settings of a group: the shipped order, then any added since in config order."""
    pinned = [name for name in SHIPPED_GROUP_ORDER[group] if name in OPTION_FIELDS]
    added = [name for name in OPTION_FIELDS if cfg_module.GROUP[name] == group and name not in pinned]
    return tuple(pinned + added)


def _group_node(group: str) -> type[io.ComfyNode]:
    node_id, title, what = GROUP_NODES[group]

    def define_schema(cls):
        return io.Schema(
            node_id=node_id,
            display_name=title,
            category=f"{CATEGORY}/train/options",
            description=f"{what} {_CHAIN}",
            inputs=[
                OPTIONS.Input(
                    "options",
                    optional=True,
                    tooltip="Settings from other option nodes (Kiln "
                    "Training Options or another of these); this node's own win",
                ),
                *(widget(name) for name in group_fields(group)),
            ],
            outputs=[
                OPTIONS.Output(
                    display_name="options", tooltip="Plug into Kiln Train LoRA or another option node's options"
                )
            ],
        )

    def execute(cls, options=None, **values):
        return io.NodeOutput({**(options or {}), **option_values(values)})

    members = {
        "__module__": __name__,
        "__doc__": what,
        "define_schema": classmethod(define_schema),
        "execute": classmethod(execute),
    }
    if "run_name" in group_fields(group):  # ComfyUI refuses a bad run name before anything loads
        members["validate_inputs"] = classmethod(lambda cls, run_name=None: run_name_check(run_name))
    return type(node_id, (io.ComfyNode,), members)


NODES = [_group_node(group) for group in GROUP_NODES]
