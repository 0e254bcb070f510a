"""The settings of what a run writes and watches: the run folder, checkpoints, logs and the saved LoRA; the
validation samples (headless `train`; in a graph, Kiln Validation Settings does this); the held-out loss and
early stopping (trainer/run/holdout.py)."""

from __future__ import annotations

from dataclasses import dataclass

from .declaration import setting

__all__ = ["HoldoutFields", "OutputFields", "SampleFields"]


@dataclass
class OutputFields:
    output_dir: str = setting("runs", "run folders go here", "output", identity=False, node="none")
    run_name: str = setting(
        "",
        "run folder name, as typed; empty: the dataset folder's name in ComfyUI (another run of other settings "
        'there: <name>-2), "<arch>-<date>-<time>" headless',
        "output",
        identity=False,
    )
    checkpoint_every: int = setting(
        250,
        "steps between resumable checkpoints; 0 = only at the end",
        "output",
        bounds=(0, 1_000_000),
        identity=False,
    )
    keep_checkpoints: int = setting(3, "newest K checkpoints kept", "output", bounds=(1, 1000), identity=False)
    checkpoint_loras: bool = setting(
        False,
        "nodes: also write each checkpoint's LoRA to models/loras/kiln/<run>-stepNNNNNN.safetensors, to compare "
        "steps in a graph",
        "output",
        identity=False,
    )
    log_every: int = setting(
        10,
        "steps between loss reads (a host sync on GPU)",
        "output",
        advanced=True,
        bounds=(1, 100_000),
        identity=False,
    )
    log_tensorboard: bool = setting(
        False,
        "write loss, learning rate, validation images and the config as TensorBoard event files under "
        "<run>/tensorboard/ (pip install tensorboard)",
        "output",
        identity=False,
    )
    wandb_project: str = setting(
        "",
        "Weights & Biases project to log the same to, under <run>/wandb/; empty = off (pip install wandb)",
        "output",
        identity=False,
    )
    wandb_mode: str = setting(
        "offline",
        "offline: W&B files stay in the run folder (upload later with `wandb sync`); online: sent as the run "
        "goes (after `wandb login`)",
        "output",
        choices=("offline", "online"),
        identity=False,
    )
    save_dtype: str = setting("bf16", "dtype of saved LoRA weights", "output", choices=("bf16", "fp16", "fp32"))
    lora_format: str = setting(
        "comfy",
        "comfy (ComfyUI-native keys), diffusers, kohya",
        "output",
        choices=("comfy", "diffusers", "kohya"),
    )


# Output settings: they never change what trains, and a run resumes whatever they say (identity=False).
@dataclass
class SampleFields:
    sample_prompts: list[str | dict] = setting(
        [],
        "prompts to sample while training, into <run>/samples/; each a string (ai-toolkit's flags work: "
        '"a cat --n blurry --w 768 --h 1024 --seed 7 --cfg 4 --steps 20") or a table '
        "{prompt, negative, seed, steps, cfg, width, height} whose keys override the sample_* settings; "
        "empty = no samples",
        "samples",
        identity=False,
        node="none",
    )
    sample_every: int = setting(
        250,
        "steps between samples (and at the last step); 0 = only at the end",
        "samples",
        bounds=(0, 1_000_000),
        identity=False,
        node="none",
    )
    sample_first: bool = setting(
        True,
        "also sample before the first step (the model without the LoRA, to compare against); a resumed run does not",
        "samples",
        identity=False,
        node="none",
    )
    sample_seed: int = setting(
        42,
        "sampling seed (fixed, so steps compare)",
        "samples",
        bounds=(0, 2**32 - 1),
        identity=False,
        node="none",
    )
    sample_walk_seed: bool = setting(
        True,
        "prompt N samples with sample_seed + N (ai-toolkit's walk_seed); off: every prompt uses sample_seed",
        "samples",
        identity=False,
        node="none",
    )
    sample_negative: str = setting(
        "",
        "negative prompt of every sample (a prompt's own wins); it counts only with a cfg above 1",
        "samples",
        identity=False,
        node="none",
    )
    sample_steps: int = setting(
        0,
        "sampling steps; 0 = the model family's (Z-Image Turbo 8, Z-Image 30, Flux2 and Qwen-Image 20)",
        "samples",
        bounds=(0, 200),
        identity=False,
        node="none",
    )
    sample_cfg: float = setting(
        0.0,
        "CFG scale; 0 = the model family's (1.0 for Z-Image Turbo and Flux2, 4.0 for Z-Image, 2.5 for Qwen-Image)",
        "samples",
        bounds=(0.0, 30.0),
        identity=False,
        node="none",
    )
    sample_sampler: str = setting(
        "auto",
        "a ComfyUI sampler (euler, res_multistep, ...); auto = the model family's (res_multistep for Z-Image, "
        "else euler)",
        "samples",
        identity=False,
        node="none",
    )
    sample_scheduler: str = setting(
        "auto",
        "a ComfyUI scheduler (simple, beta, karras, ...); auto = the model family's (simple)",
        "samples",
        identity=False,
        node="none",
    )
    sample_width: int = setting(
        1024,
        "sample width in px (a multiple of 16)",
        "samples",
        bounds=(64, 4096),
        identity=False,
        node="none",
    )
    sample_height: int = setting(
        1024,
        "sample height in px (a multiple of 16)",
        "samples",
        bounds=(64, 4096),
        identity=False,
        node="none",
    )


@dataclass
class HoldoutFields:
    holdout: float = setting(
        0.0,
        "images kept out of training for a held-out loss: a count (1, 2, ...) or a share below 1 (0.1 = 10%), "
        "chosen by the seed; 0 = none",
        "ema",
        bounds=(0.0, 100_000.0),
    )
    holdout_every: int = setting(
        100,
        "steps between held-out loss evaluations (and at the last step)",
        "ema",
        bounds=(1, 1_000_000),
    )
    holdout_sigmas: int = setting(
        4,
        "noise levels per held-out image, spread evenly over (0,1); the noise is drawn once from the seed, so "
        "every evaluation sees the same draws",
        "ema",
        advanced=True,
        bounds=(1, 64),
    )
    early_stop_patience: int = setting(
        0,
        "stop after this many held-out evaluations without improvement; the best step's LoRA is kept in "
        "<run>/best/; 0 = off (needs holdout)",
        "ema",
        bounds=(0, 10_000),
    )
    early_stop_min_delta: float = setting(
        0.0,
        "improvement the held-out loss must make to count as one",
        "ema",
        advanced=True,
        step=1e-5,
        bounds=(0.0, 1e6),
    )
