"""One declaration per setting (trainer/config/declaration.py): every field states its facts, the tables are
derived from them and equal the tables as they were written by hand before (a literal snapshot below: a changed
declaration that moves a bound, a group, a node or a run's identity fails here), and run identity is declared."""

from __future__ import annotations

import dataclasses

import pytest

from trainer import config
from trainer.archs import ARCHS
from trainer.config import declaration

FIELD_ORDER = (
    "arch",
    "model_path",
    "vae_path",
    "text_encoder_path",
    "backend",
    "device",
    "sharding",
    "mixed_precision",
    "base_quantize",
    "training_adapter",
    "seed",
    "rank",
    "alpha",
    "lora_dropout",
    "targets",
    "init_lora",
    "init_lora_sha256",
    "steps",
    "batch_size",
    "grad_accum",
    "batch_by",
    "learning_rate",
    "optimizer",
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
    "stream_blocks",
    "offload_activations",
    "attention",
    "fp8_compute",
    "cuda_graphs",
    "step_graphs",
    "timestep_sampling",
    "logit_mean",
    "logit_std",
    "shift_mode",
    "shift",
    "content_or_style",
    "loss_weighting",
    "unmasked_weight",
    "sigma_range",
    "ema",
    "ema_decay",
    "dataset_dir",
    "resolutions",
    "repeats",
    "caption_dropout",
    "trigger_word",
    "caption_prefix",
    "caption_suffix",
    "default_caption",
    "shuffle_tags",
    "keep_tags",
    "caption_variants",
    "crop",
    "cache_dir",
    "cache_max_gb",
    "frames",
    "fps",
    "frame_extraction",
    "frame_windows",
    "preservation_class",
    "preservation_weight",
    "reg_dataset_dir",
    "reg_repeats",
    "reg_weight",
    "output_dir",
    "run_name",
    "checkpoint_every",
    "keep_checkpoints",
    "checkpoint_loras",
    "log_every",
    "log_tensorboard",
    "wandb_project",
    "wandb_mode",
    "save_dtype",
    "lora_format",
    "adapter",
    "lokr_factor",
    "lokr_full_w2",
    "sample_prompts",
    "sample_every",
    "sample_first",
    "sample_seed",
    "sample_walk_seed",
    "sample_negative",
    "sample_steps",
    "sample_cfg",
    "sample_sampler",
    "sample_scheduler",
    "sample_width",
    "sample_height",
    "holdout",
    "holdout_every",
    "holdout_sigmas",
    "early_stop_patience",
    "early_stop_min_delta",
)

BOUNDS = {
    "seed": (0, 4294967295),
    "rank": (1, 256),
    "alpha": (0.001, 4096.0),
    "lora_dropout": (0.0, 0.9),
    "steps": (1, 1000000),
    "batch_size": (1, 64),
    "grad_accum": (1, 256),
    "learning_rate": (1e-07, 10.0),
    "weight_decay": (0.0, 1.0),
    "adam_beta1": (0.0, 0.9999),
    "adam_beta2": (0.0, 0.99999),
    "adam_eps": (1e-12, 0.001),
    "warmup_steps": (0, 1000000),
    "min_lr_ratio": (0.0, 1.0),
    "max_grad_norm": (0.0, 10000.0),
    "logit_mean": (-5.0, 5.0),
    "logit_std": (0.05, 5.0),
    "shift": (0.05, 20.0),
    "ema_decay": (0.5, 0.99999),
    "caption_dropout": (0.0, 1.0),
    "resolutions": (64, 4096),
    "repeats": (1, 1000),
    "keep_tags": (0, 100),
    "caption_variants": (1, 64),
    "cache_max_gb": (0.0, 1000000.0),
    "frames": (1, 1025),
    "fps": (0.0, 240.0),
    "frame_windows": (1, 64),
    "preservation_weight": (0.0, 100.0),
    "reg_repeats": (1, 1000),
    "reg_weight": (0.0, 100.0),
    "checkpoint_every": (0, 1000000),
    "keep_checkpoints": (1, 1000),
    "log_every": (1, 100000),
    "skip_checkpoint_blocks": (0, 1000),
    "stream_blocks": (0, 1000),
    "checkpoint_budget": (0.0, 1.0),
    "sample_every": (0, 1000000),
    "sample_seed": (0, 4294967295),
    "sample_steps": (0, 200),
    "sample_cfg": (0.0, 30.0),
    "sample_width": (64, 4096),
    "sample_height": (64, 4096),
    "unmasked_weight": (0.0, 1.0),
    "lokr_factor": (-1, 4096),
    "holdout": (0.0, 100000.0),
    "holdout_every": (1, 1000000),
    "holdout_sigmas": (1, 64),
    "early_stop_patience": (0, 10000),
    "early_stop_min_delta": (0.0, 1000000.0),
}

CHOICES = {
    "backend": ("torch", "mlx"),
    "device": ("auto", "cpu", "cuda", "mps"),
    "sharding": ("auto", "replicate", "shard"),
    "mixed_precision": ("bf16", "no"),
    "save_dtype": ("bf16", "fp16", "fp32"),
    "lora_format": ("comfy", "diffusers", "kohya"),
    "crop": ("center", "random"),
    "frame_extraction": ("head", "uniform", "windows"),
    "base_quantize": ("auto", "none", "int8", "int4"),
    "attention": ("auto", "torch", "cudnn", "flash", "efficient", "math"),
    "wandb_mode": ("offline", "online"),
}

GROUP = {
    "arch": "model",
    "model_path": "model",
    "vae_path": "model",
    "text_encoder_path": "model",
    "backend": "model",
    "device": "speed",
    "sharding": "speed",
    "mixed_precision": "speed",
    "base_quantize": "speed",
    "training_adapter": "model",
    "seed": "training",
    "rank": "adapter",
    "alpha": "adapter",
    "lora_dropout": "adapter",
    "targets": "adapter",
    "init_lora": "adapter",
    "init_lora_sha256": "adapter",
    "steps": "training",
    "batch_size": "training",
    "grad_accum": "training",
    "batch_by": "training",
    "learning_rate": "training",
    "optimizer": "training",
    "weight_decay": "training",
    "adam_beta1": "training",
    "adam_beta2": "training",
    "adam_eps": "training",
    "lr_schedule": "training",
    "warmup_steps": "training",
    "min_lr_ratio": "training",
    "max_grad_norm": "training",
    "gradient_checkpointing": "speed",
    "skip_checkpoint_blocks": "speed",
    "compile_blocks": "speed",
    "checkpoint_budget": "speed",
    "stream_blocks": "speed",
    "offload_activations": "speed",
    "attention": "speed",
    "fp8_compute": "speed",
    "cuda_graphs": "speed",
    "step_graphs": "speed",
    "timestep_sampling": "objective",
    "logit_mean": "objective",
    "logit_std": "objective",
    "shift_mode": "objective",
    "shift": "objective",
    "content_or_style": "objective",
    "loss_weighting": "objective",
    "unmasked_weight": "objective",
    "sigma_range": "objective",
    "ema": "ema",
    "ema_decay": "ema",
    "dataset_dir": "data",
    "resolutions": "data",
    "repeats": "data",
    "caption_dropout": "data",
    "trigger_word": "data",
    "caption_prefix": "data",
    "caption_suffix": "data",
    "default_caption": "data",
    "shuffle_tags": "data",
    "keep_tags": "data",
    "caption_variants": "data",
    "crop": "data",
    "cache_dir": "data",
    "cache_max_gb": "data",
    "frames": "data",
    "fps": "data",
    "frame_extraction": "data",
    "frame_windows": "data",
    "preservation_class": "data",
    "preservation_weight": "objective",
    "reg_dataset_dir": "data",
    "reg_repeats": "data",
    "reg_weight": "objective",
    "output_dir": "output",
    "run_name": "output",
    "checkpoint_every": "output",
    "keep_checkpoints": "output",
    "checkpoint_loras": "output",
    "log_every": "output",
    "log_tensorboard": "output",
    "wandb_project": "output",
    "wandb_mode": "output",
    "save_dtype": "output",
    "lora_format": "output",
    "adapter": "adapter",
    "lokr_factor": "adapter",
    "lokr_full_w2": "adapter",
    "sample_prompts": "samples",
    "sample_every": "samples",
    "sample_first": "samples",
    "sample_seed": "samples",
    "sample_walk_seed": "samples",
    "sample_negative": "samples",
    "sample_steps": "samples",
    "sample_cfg": "samples",
    "sample_sampler": "samples",
    "sample_scheduler": "samples",
    "sample_width": "samples",
    "sample_height": "samples",
    "holdout": "ema",
    "holdout_every": "ema",
    "holdout_sigmas": "ema",
    "early_stop_patience": "ema",
    "early_stop_min_delta": "ema",
}

ADVANCED = (
    "sigma_range",
    "stream_blocks",
    "offload_activations",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "attention",
    "base_quantize",
    "batch_by",
    "checkpoint_budget",
    "compile_blocks",
    "cuda_graphs",
    "early_stop_min_delta",
    "fp8_compute",
    "holdout_sigmas",
    "log_every",
    "logit_mean",
    "logit_std",
    "lokr_factor",
    "lokr_full_w2",
    "max_grad_norm",
    "min_lr_ratio",
    "shift",
    "shift_mode",
    "skip_checkpoint_blocks",
    "step_graphs",
)

STEPS = {"weight_decay": 1e-06, "early_stop_min_delta": 1e-05}

AUTO_FIELDS = (
    "compile_blocks",
    "checkpoint_budget",
    "stream_blocks",
    "offload_activations",
    "fp8_compute",
    "step_graphs",
)

NOT_IDENTITY = (
    "stream_blocks",
    "offload_activations",
    "sharding",
    "attention",
    "cache_dir",
    "cache_max_gb",
    "frames",
    "fps",
    "frame_extraction",
    "frame_windows",
    "checkpoint_budget",
    "checkpoint_every",
    "checkpoint_loras",
    "compile_blocks",
    "cuda_graphs",
    "dataset_dir",
    "fp8_compute",
    "gradient_checkpointing",
    "init_lora",
    "keep_checkpoints",
    "log_every",
    "log_tensorboard",
    "output_dir",
    "reg_dataset_dir",
    "run_name",
    "sample_cfg",
    "sample_every",
    "sample_first",
    "sample_height",
    "sample_negative",
    "sample_prompts",
    "sample_sampler",
    "sample_scheduler",
    "sample_seed",
    "sample_steps",
    "sample_walk_seed",
    "sample_width",
    "skip_checkpoint_blocks",
    "step_graphs",
    "steps",
    "wandb_mode",
    "wandb_project",
)

TRAIN_WIDGETS = ("steps", "learning_rate", "rank", "alpha", "optimizer", "backend", "seed")

DATASET_FIELDS = (
    "dataset_dir",
    "resolutions",
    "repeats",
    "caption_dropout",
    "trigger_word",
    "caption_prefix",
    "caption_suffix",
    "default_caption",
    "shuffle_tags",
    "keep_tags",
    "caption_variants",
    "crop",
    "cache_dir",
    "cache_max_gb",
    "frames",
    "fps",
    "frame_extraction",
    "frame_windows",
    "preservation_class",
    "reg_dataset_dir",
    "reg_repeats",
)

NOT_IN_GRAPH = (
    "arch",
    "model_path",
    "vae_path",
    "text_encoder_path",
    "sharding",
    "training_adapter",
    "init_lora",
    "init_lora_sha256",
    "output_dir",
    "sample_prompts",
    "sample_every",
    "sample_first",
    "sample_seed",
    "sample_walk_seed",
    "sample_negative",
    "sample_steps",
    "sample_cfg",
    "sample_sampler",
    "sample_scheduler",
    "sample_width",
    "sample_height",
)


# The choices that come from a registry (archs, schedules, adapter kinds, ...) grow with it.
REGISTRY_CHOICES = (
    "arch",
    "optimizer",
    "lr_schedule",
    "timestep_sampling",
    "shift_mode",
    "content_or_style",
    "loss_weighting",
    "batch_by",
    "adapter",
)


def test_derived_tables_equal_the_snapshot():
    assert tuple(config.FIELDS) == FIELD_ORDER
    assert list(config.TrainConfig().to_dict()) == list(FIELD_ORDER)
    assert config.BOUNDS == BOUNDS
    assert {k: v for k, v in config.CHOICES.items() if k not in REGISTRY_CHOICES} == CHOICES
    assert set(config.CHOICES) == set(CHOICES) | set(REGISTRY_CHOICES)
    assert config.CHOICES["arch"] == tuple(ARCHS) and config.CHOICES["optimizer"] == config.OPTIMIZER_NAMES
    assert config.GROUP == GROUP and config.ADVANCED == frozenset(ADVANCED) and config.STEPS == STEPS
    assert config.AUTO_FIELDS == AUTO_FIELDS and config.TRISTATE_FIELDS == (
        "offload_activations",
        "fp8_compute",
        "step_graphs",
    )
    assert set(config.NOT_IDENTITY) == set(NOT_IDENTITY)
    assert config.TRAIN_WIDGETS == TRAIN_WIDGETS
    assert config.DATASET_FIELDS == DATASET_FIELDS and config.NOT_IN_GRAPH == NOT_IN_GRAPH


@pytest.mark.parametrize("name", list(config.FIELDS))
def test_every_field_is_declared_with_a_group_help_and_node(name):
    facts = config.FIELDS[name].metadata
    assert facts["help"].strip() and facts["group"] in config.GROUPS and facts["node"] in config.NODES
    assert isinstance(facts["identity"], bool)  # declared at the field, never inferred elsewhere


def test_a_field_without_a_declaration_is_refused():
    """A field added as a plain dataclass field states no identity: the tables cannot be built."""

    @dataclasses.dataclass
    class Grown(config.TrainConfig):
        new_lever: int = 0

    with pytest.raises(KeyError):
        declaration.Tables({f.name: f for f in dataclasses.fields(Grown)})


def test_run_identity_reads_the_declarations():
    values = config.TrainConfig().to_dict()
    kept = config.identity_values({**values, "not_a_field": 1})
    for name, field in config.FIELDS.items():
        assert (name in kept) == field.metadata["identity"], name
    assert "not_a_field" in kept  # an unknown key is never dropped from a run's identity silently
    assert "steps" not in kept and "rank" in kept and not any(name.startswith("sample_") for name in kept)


@pytest.mark.parametrize("name", ["compile_blocks", "checkpoint_budget", "fp8_compute", "step_graphs"])
def test_auto_fields_have_real_types(name):
    kind = config.KIND[name]
    assert config.FIELDS[name].type == f"{kind} | Literal['auto']" and kind in ("bool", "float")
    assert getattr(config.from_dict({name: "auto"}), name) == "auto"
    with pytest.raises(config.ConfigError, match=f'{name} must be {kind} or "auto"'):
        config.from_dict({name: "fast"})


@pytest.mark.parametrize(
    "bad",
    [
        dict(group="misc"),
        dict(node="sidebar"),
        dict(node="train"),
        dict(slot=3),
        dict(auto=True),
        dict(tristate=True, default="auto"),
    ],
)
def test_a_bad_declaration_is_refused(bad):
    args = {"default": 0, "help_text": "help", "group": "training", **bad}
    with pytest.raises(ValueError):
        config.setting(**args)
