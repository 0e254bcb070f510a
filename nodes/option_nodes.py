"""The smaller option nodes: Kiln Training Options cut by each setting's group (trainer/config/fields.py `setting`).

Each sets only its own settings and takes an optional `options` input, so they chain in any order into one
KILN_TRAIN_OPTIONS: a node's own values win over the ones it receives (the node nearer Train LoRA wins), and
every value set on a connected option node wins over Train LoRA's preset.
"""
from __future__ import annotations

from comfy_api.latest import io

from ..trainer import config as cfg_module
from .train_nodes import OPTION_FIELDS, option_values
from .widgets import CATEGORY, OPTIONS, run_name_check, widget

# Each node's widgets as first shipped, everyday settings first. Saved workflows hold widgets_values by
# position, so this order is forever: a setting added to a group later goes after these (group_fields).
SHIPPED_GROUP_ORDER = {
    "training": ("lr_schedule", "warmup_steps", "batch_size", "grad_accum", "weight_decay", "min_lr_ratio",
                 "max_grad_norm", "batch_by", "adam_beta1", "adam_beta2", "adam_eps"),
    "objective": ("content_or_style", "loss_weighting", "timestep_sampling", "unmasked_weight",
                  "preservation_weight", "reg_weight", "shift_mode", "shift", "logit_mean", "logit_std"),
    "ema": ("ema", "ema_decay", "holdout", "holdout_every", "early_stop_patience", "early_stop_min_delta",
            "holdout_sigmas"),
    "adapter": ("adapter", "lora_dropout", "targets", "lokr_factor", "lokr_full_w2"),
    "speed": ("device", "mixed_precision", "gradient_checkpointing", "compile_blocks", "fp8_compute", "step_graphs",
              "cuda_graphs", "checkpoint_budget", "skip_checkpoint_blocks", "attention", "base_quantize"),
    "output": ("run_name", "checkpoint_every", "keep_checkpoints", "checkpoint_loras", "save_dtype", "lora_format",
               "log_tensorboard", "wandb_project", "wandb_mode", "log_every"),
}
_CHAIN = ("Chain option nodes through `options`: this node's values win over the ones it receives, and each "
          "wins over Train LoRA's preset.")
# group → (node id, display name, what it sets); node ids are forever.
GROUP_NODES = {
    "training": ("KilnOptimizerOptions", "Kiln Optimizer & Schedule",
                 "Learning-rate schedule and warm-up, batch size and gradient accumulation, weight decay; "
                 "clipping and Adam's betas and eps under Show advanced."),
    "objective": ("KilnNoiseLossOptions", "Kiln Noise & Loss",
                  "Which noise levels train (content or style, timestep sampling, shift) and how the loss is "
                  "weighted (bell, masks, preservation and regularisation weights)."),
    "ema": ("KilnEMAHoldoutOptions", "Kiln EMA & Held-out",
            "An EMA of the LoRA weights (used for samples and saves); images held out for a held-out loss, and "
            "early stopping on it."),
    "adapter": ("KilnAdapterOptions", "Kiln Adapter",
                "The adapter kind (LoRA, LoKr, LoHa, DoRA), its dropout and the modules it targets."),
    "speed": ("KilnSpeedMemoryOptions", "Kiln Speed & Memory",
              "Device, mixed precision and gradient checkpointing; compiled blocks, fp8, CUDA graphs and the "
              "attention kernel under Show advanced (auto picks them for the GPU)."),
    "output": ("KilnSavingLoggingOptions", "Kiln Saving & Logging",
               "Run name, checkpoints and their LoRAs, the saved dtype and format, TensorBoard and W&B logging."),
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
            node_id=node_id, display_name=title, category=f"{CATEGORY}/train/options", description=f"{what} {_CHAIN}",
            inputs=[OPTIONS.Input("options", optional=True, tooltip="Settings from other option nodes (Kiln "
                                  "Training Options or another of these); this node's own win"),
                    *(widget(name) for name in group_fields(group))],
            outputs=[OPTIONS.Output(display_name="options", tooltip="Plug into Kiln Train LoRA or another option "
                                    "node's options")],
        )

    def execute(cls, options=None, **values):
        return io.NodeOutput({**(options or {}), **option_values(values)})

    members = {"__module__": __name__, "__doc__": what, "define_schema": classmethod(define_schema),
               "execute": classmethod(execute)}
    if "run_name" in group_fields(group):   # ComfyUI refuses a bad run name before anything loads
        members["validate_inputs"] = classmethod(lambda cls, run_name=None: run_name_check(run_name))
    return type(node_id, (io.ComfyNode,), members)


NODES = [_group_node(group) for group in GROUP_NODES]
