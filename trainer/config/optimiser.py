"""The optimizer's settings (a section of TrainConfig, fields.py): which optimizer, its step size and schedule, and
the settings each optimizer reads."""

from __future__ import annotations

from dataclasses import dataclass

from ..data.sampler import BATCHING
from ..objective.schedules import SCHEDULES
from .declaration import setting

__all__ = ["MLX_OPTIMIZER_NAMES", "OPTIMIZER_NAMES", "OptimiserFields"]

# backends register each; new names go last (a saved workflow's combo keeps its value either way)
OPTIMIZER_NAMES = ("adamw", "adamw8bit", "adafactor", "prodigy", "lion", "came", "schedulefree", "adamw8bit_torchao")
# What backend 'mlx' builds (adamw8bit falls back to fp32 AdamW there: bitsandbytes is CUDA-only)
MLX_OPTIMIZER_NAMES = ("adamw", "adamw8bit", "adafactor")


@dataclass
class OptimiserFields:
    steps: int = setting(
        1000,
        "optimizer steps (each takes grad_accum micro-batches)",
        "training",
        bounds=(1, 1_000_000),
        identity=False,  # raising it on a finished run continues that run
        node="train",
        slot=0,
    )
    batch_size: int = setting(1, "images per micro-batch (one bucket per batch)", "training", bounds=(1, 64))
    grad_accum: int = setting(1, "micro-batches per optimizer step", "training", bounds=(1, 256))
    batch_by: str = setting(
        "images",
        "images: batch_size images from every bucket; tokens: batch_size from the largest bucket and as many "
        "more from a smaller one as carry no more tokens (4 at 512 px for 1 at 1024: small buckets use the GPU "
        "as well; a step's loss stays the per-image mean, an epoch still shows every image once)",
        "training",
        advanced=True,
        choices=tuple(BATCHING),
    )
    learning_rate: float = setting(
        1e-4,
        "peak learning rate. adamw, adamw8bit, came: 1e-4 for a LoRA; lion: 3-10x smaller (1e-5 to 3e-5); "
        "schedulefree: 1e-4 to 1e-3; prodigy: 1.0 (it finds its own step size)",
        "training",
        bounds=(1e-7, 10.0),
        node="train",
        slot=1,
    )
    optimizer: str = setting(
        "adamw",
        "adamw; adamw8bit (bitsandbytes, NVIDIA; elsewhere fp32 adamw, said in the log); adafactor; prodigy "
        "(prodigyopt); lion (lion-pytorch: sign updates, one moment, lr 3-10x smaller, weight decay 3-10x "
        "larger); came (came-pytorch: factored second moment, adafactor's memory with adam's stability); "
        "schedulefree (schedulefree: AdamW without a schedule, lr_schedule constant; samples and saves use its "
        "averaged weights); adamw8bit_torchao (torchao's 8-bit AdamW, any CUDA GPU, no bitsandbytes)",
        "training",
        choices=OPTIMIZER_NAMES,
        node="train",
        slot=4,
    )
    weight_decay: float = setting(
        1e-4,
        "decoupled weight decay on LoRA weights (lion: 3-10x the adamw value)",
        "training",
        step=1e-6,
        bounds=(0.0, 1.0),
    )
    adam_beta1: float = setting(
        0.9,
        "decay of the gradient average (momentum): adamw, adamw8bit(_torchao), prodigy, lion, came, "
        "schedulefree (its interpolation between the average and the fast iterate)",
        "training",
        advanced=True,
        bounds=(0.0, 0.9999),
    )
    adam_beta2: float = setting(
        0.999,
        "decay of the squared-gradient average: adamw, adamw8bit(_torchao), prodigy, came, schedulefree; lion: "
        "decay of its one moment (lion's paper uses 0.99)",
        "training",
        advanced=True,
        bounds=(0.0, 0.99999),
    )
    adam_eps: float = setting(
        1e-8,
        "added to the denominator for stability: adamw, adamw8bit(_torchao), prodigy, schedulefree",
        "training",
        advanced=True,
        bounds=(1e-12, 1e-3),
    )
    lr_schedule: str = setting(
        "constant", "constant, linear, cosine, cosine_with_warmup", "training", choices=tuple(SCHEDULES)
    )
    warmup_steps: int = setting(
        0, "linear warm-up steps (constant, linear, cosine_with_warmup)", "training", bounds=(0, 1_000_000)
    )
    min_lr_ratio: float = setting(
        0.0,
        "final lr = min_lr_ratio * learning_rate (linear, cosine)",
        "training",
        advanced=True,
        bounds=(0.0, 1.0),
    )
    max_grad_norm: float = setting(
        1.0, "global-norm clipping; 0 turns it off", "training", advanced=True, bounds=(0.0, 1e4)
    )


# How a run is computed, not what it trains: changing one after a stop resumes the same run (the levers give
# the same losses to bf16 noise; fp8 rounds the frozen base's products, the loss within about 1 %).
