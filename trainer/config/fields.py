"""TrainConfig: every setting of a run, typed, documented and validated at the edge.

Bounds live in `BOUNDS` and choices in `CHOICES`; the ComfyUI nodes build their
widgets from the same tables, so a widget can never offer a value this module
rejects. Each field's help text sits beside its default as field metadata
(`rank: int = setting(32, "...", "adapter")`): data, not a comment, so a bytecode-only install
has it too; `HELP` gathers it for the widgets' tooltips, `GROUP` cuts the option nodes. Presets are plain dicts of
overrides (see PRESETS). The checks from_dict runs live in trainer/config/checks.py; config files
(.toml, .json) are read and written by trainer/config/files.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..archs import ARCHS
from ..data.sampler import BATCHING
from ..errors import KilnError
from ..lora.adapters import ADAPTER_KINDS
from ..objective.flow import CONTENT_OR_STYLE, LOSS_WEIGHTINGS, SAMPLINGS, SHIFT_MODES
from ..objective.schedules import SCHEDULES

OPTIMIZER_NAMES = ("adamw", "adamw8bit", "adafactor", "prodigy")  # backends register each
# Settings that may also be "auto": the backend decides at the start of a run, from the device and its
# free memory (trainer/backends/torch_backend/levers.py). They are the fast path, so they are defaults.
AUTO = "auto"
AUTO_FIELDS = ("compile_blocks", "checkpoint_budget", "fp8_compute", "step_graphs")

CHOICES: dict[str, tuple[str, ...]] = {
    "arch": tuple(ARCHS),
    "backend": ("torch", "mlx"),
    "device": ("auto", "cpu", "cuda", "mps"),
    "mixed_precision": ("bf16", "no"),
    "optimizer": OPTIMIZER_NAMES,
    "lr_schedule": tuple(SCHEDULES),
    "timestep_sampling": SAMPLINGS,
    "shift_mode": ("auto",) + SHIFT_MODES,
    "content_or_style": CONTENT_OR_STYLE,
    "loss_weighting": LOSS_WEIGHTINGS,
    "save_dtype": ("bf16", "fp16", "fp32"),
    "lora_format": ("comfy", "diffusers", "kohya"),
    "crop": ("center", "random"),
    "batch_by": tuple(BATCHING),
    "base_quantize": ("none", "int8", "int4"),
    "attention": ("auto", "torch", "cudnn", "flash", "efficient", "math"),
    "wandb_mode": ("offline", "online"),
    "adapter": ADAPTER_KINDS,
}

# Inclusive (low, high) for numbers; for lists, the bounds of each element.
BOUNDS: dict[str, tuple[float, float]] = {
    "seed": (0, 2**32 - 1),
    "rank": (1, 256),
    "alpha": (1e-3, 4096.0),
    "lora_dropout": (0.0, 0.9),
    "steps": (1, 1_000_000),
    "batch_size": (1, 64),
    "grad_accum": (1, 256),
    "learning_rate": (1e-7, 10.0),
    "weight_decay": (0.0, 1.0),
    "adam_beta1": (0.0, 0.9999),
    "adam_beta2": (0.0, 0.99999),
    "adam_eps": (1e-12, 1e-3),
    "warmup_steps": (0, 1_000_000),
    "min_lr_ratio": (0.0, 1.0),
    "max_grad_norm": (0.0, 1e4),
    "logit_mean": (-5.0, 5.0),
    "logit_std": (0.05, 5.0),
    "shift": (0.05, 20.0),
    "ema_decay": (0.5, 0.99999),
    "caption_dropout": (0.0, 1.0),
    "resolutions": (64, 4096),
    "repeats": (1, 1000),
    "keep_tags": (0, 100),
    "caption_variants": (1, 64),
    "cache_max_gb": (0.0, 1e6),
    "preservation_weight": (0.0, 100.0),
    "reg_repeats": (1, 1000),
    "reg_weight": (0.0, 100.0),
    "checkpoint_every": (0, 1_000_000),
    "keep_checkpoints": (1, 1000),
    "log_every": (1, 100_000),
    "skip_checkpoint_blocks": (0, 1000),
    "checkpoint_budget": (0.0, 1.0),
    "sample_every": (0, 1_000_000),
    "sample_seed": (0, 2**32 - 1),
    "sample_steps": (0, 200),
    "sample_cfg": (0.0, 30.0),
    "sample_width": (64, 4096),
    "sample_height": (64, 4096),
    "unmasked_weight": (0.0, 1.0),
    "lokr_factor": (-1, 4096),
    # held-out loss and early stopping (trainer/run/holdout.py)
    "holdout": (0.0, 100_000.0),
    "holdout_every": (1, 1_000_000),
    "holdout_sigmas": (1, 64),
    "early_stop_patience": (0, 10_000),
    "early_stop_min_delta": (0.0, 1e6),
}


# Each setting's group: what it is about. The option nodes are cut by it (nodes/option_nodes.py), everyday
# settings before advanced ones.
GROUPS = ("model", "training", "adapter", "objective", "ema", "speed", "data", "output", "samples")


def setting(default: Any, help_text: str, group: str, *, advanced: bool = False, step: float | None = None) -> Any:
    """A TrainConfig field with its help text (a node's tooltip), its group, whether only experts change it
    (`advanced`), and for a float the finest change that matters when the default and bounds do not say it
    (`step`: a widget shows that many decimals). A list default is copied for each config."""
    if group not in GROUPS:
        raise ValueError(f"setting group {group!r} is not one of {GROUPS}")
    metadata = {"help": help_text, "group": group, "advanced": advanced, "step": step}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainConfig:
    # --- model and backend
    arch: str = setting("demo", "model family (trainer/archs; `python -m trainer train --help` lists them)", "model")
    model_path: str = setting("", "ComfyUI diffusion-model .safetensors (headless `train`); "
                                  "nodes pass the MODEL instead", "model")
    vae_path: str = setting("", "the model's VAE .safetensors (headless `train`)", "model")
    text_encoder_path: str = setting("", "the model's text encoder .safetensors (headless `train`)", "model")
    backend: str = setting("torch", '"torch" (CUDA, MPS, CPU) or "mlx" (Apple Silicon; Linux CPU for tests)', "model")
    device: str = setting("auto", "auto picks cuda, then mps, then cpu", "speed")
    mixed_precision: str = setting("bf16", '"bf16": autocast with fp32 LoRA parameters; "no": everything fp32', "speed")
    base_quantize: str = setting("none", "MLX: store the frozen base's block Linears as int8 or int4 "
                                         "(QLoRA-style, ~2x/3.5x smaller)", "speed", advanced=True)
    training_adapter: str = setting("", "Z-Image Turbo: adapter LoRA merged at +1 for training, never saved", "model")
    seed: int = setting(42, "one seed for noise, timesteps, captions, data order and LoRA init", "training")
    # --- LoRA
    rank: int = setting(32, "16-64 for characters, 8-32 for styles", "adapter")
    alpha: float = setting(32.0, "scale = alpha / rank; alpha = rank keeps scale 1", "adapter")
    lora_dropout: float = setting(0.0, "dropout on the LoRA branch input", "adapter")
    targets: list[str] = setting([], 'module patterns: exact, suffix ("img_attn.qkv") or "re:<regex>"; '
                                     "empty = arch defaults", "adapter")
    init_lora: str = setting("", "a LoRA .safetensors to start from (any trainer's layout Kiln reads) instead of a "
                                 "new LoRA; its rank and alpha replace rank and alpha. A resumed run continues "
                                 "from its checkpoint. Empty = a new LoRA", "adapter")
    init_lora_sha256: str = setting("", "filled in by the run: the sha256 of init_lora (of the file, or of a "
                                        "LORA_MODEL's tensors); a file that no longer matches stops a resume",
                                    "adapter")
    # --- optimisation
    steps: int = setting(1000, "optimizer steps (each takes grad_accum micro-batches)", "training")
    batch_size: int = setting(1, "images per micro-batch (one bucket per batch)", "training")
    grad_accum: int = setting(1, "micro-batches per optimizer step", "training")
    batch_by: str = setting("images", "images: batch_size images from every bucket; tokens: batch_size from the "
                                      "largest bucket and as many more from a smaller one as carry no more tokens "
                                      "(4 at 512 px for 1 at 1024: small buckets use the GPU as well; a step's loss "
                                      "stays the per-image mean, an epoch still shows every image once)",
                            "training", advanced=True)
    learning_rate: float = setting(1e-4, "peak learning rate (prodigy: 1.0)", "training")
    optimizer: str = setting("adamw", "adamw, adamw8bit (bitsandbytes), adafactor, prodigy (prodigyopt)", "training")
    weight_decay: float = setting(1e-4, "decoupled weight decay on LoRA weights", "training", step=1e-6)
    adam_beta1: float = setting(0.9, "adamw, adamw8bit, prodigy: decay of the gradient average (momentum)",
                                "training", advanced=True)
    adam_beta2: float = setting(0.999, "adamw, adamw8bit, prodigy: decay of the squared-gradient average",
                                "training", advanced=True)
    adam_eps: float = setting(1e-8, "adamw, adamw8bit, prodigy: added to the denominator for stability",
                              "training", advanced=True)
    lr_schedule: str = setting("constant", "constant, linear, cosine, cosine_with_warmup", "training")
    warmup_steps: int = setting(0, "linear warm-up steps (constant, linear, cosine_with_warmup)", "training")
    min_lr_ratio: float = setting(0.0, "final lr = min_lr_ratio * learning_rate (linear, cosine)",
                                  "training", advanced=True)
    max_grad_norm: float = setting(1.0, "global-norm clipping; 0 turns it off", "training", advanced=True)
    gradient_checkpointing: bool = setting(True, "recompute each block in backward: far less memory, ~30% slower",
                                           "speed")
    skip_checkpoint_blocks: int = setting(0, "with checkpointing: the last N blocks keep their activations "
                                             "(faster, +memory each)", "speed", advanced=True)
    compile_blocks: bool = setting(AUTO, "PyTorch: torch.compile each block (fuses norms, RoPE, gates; the first "
                                         "steps compile). auto: on with CUDA and Triton, and if the compile fails "
                                         "the run goes on uncompiled; true: on, a failed compile stops the run",
                                   "speed", advanced=True)
    checkpoint_budget: float = setting(AUTO, "with compile_blocks and checkpointing: share of each block's "
                                             "activation memory kept (0 = recompute the block, 1 = keep all); the "
                                             "compiler recomputes the cheapest rest. auto: the largest share whose "
                                             "estimated peak leaves a margin of the GPU's free memory at start",
                                       "speed", advanced=True)
    attention: str = setting("auto", "PyTorch attention kernel tried first: auto (the fastest measured on this GPU), "
                                     "torch (its own order), cudnn, flash, efficient, math", "speed", advanced=True)
    fp8_compute: bool = setting(AUTO, "PyTorch, H100-class GPUs: the frozen base's block Linears multiply in fp8 "
                                      "(per-row scales) forward and backward; LoRA stays bf16. auto: on for a base "
                                      "stored in fp8 on a GPU with fp8 matmuls (H100, 1024 px: Z-Image -18 %/step, "
                                      "Klein 4B -14 %, Flux2 Dev -10 %, in less memory); true: also on a bf16 base, "
                                      "at the cost of an fp8 copy of the block weights (Z-Image -16 %/step at 1024 "
                                      "px, +11.5 GiB). Pays at 1024 px; at 512-768 px steps ran up to 30 % slower "
                                      "(bench/RESULTS.md)", "speed", advanced=True)
    cuda_graphs: bool = setting(False, "PyTorch, CUDA, with compiled blocks: replay each block's kernels as a CUDA "
                                       "graph (torch.compile mode reduce-overhead), so a small bucket's step is not "
                                       "paced by the host's kernel launches (H100, 512 px: Z-Image -20 %/step). "
                                       "Each new token count records its graphs (4-7 s): pays for one or two small "
                                       "resolutions, not for many buckets (bench/RESULTS.md)", "speed", advanced=True)
    step_graphs: bool = setting(AUTO, "PyTorch, CUDA: record each batch shape's forward and backward as a CUDA "
                                      "graph at its second step and replay it after, so small buckets are not "
                                      "paced by the host's Python and kernel launches. auto: on for one process "
                                      "where the graphs' memory pool (about twice the largest recorded step's "
                                      "activations) fits; a failed recording turns it off with one log line "
                                      "(bench/RESULTS.md)", "speed", advanced=True)
    # --- objective (flow matching)
    timestep_sampling: str = setting("uniform", "uniform or logit_normal", "objective")
    logit_mean: float = setting(0.0, "logit_normal: centre of the logit; > 0 favours high noise",
                                "objective", advanced=True)
    logit_std: float = setting(1.0, "logit_normal: spread of the logit; larger is flatter", "objective", advanced=True)
    shift_mode: str = setting("auto", "auto (the arch's default), none, static, resolution (Flux2-style)",
                              "objective", advanced=True)
    shift: float = setting(3.0, "static shift value", "objective", advanced=True)
    content_or_style: str = setting("balanced", "content favours high noise (composition), style low noise (texture)",
                                    "objective")
    loss_weighting: str = setting("none", "none or bell (ai-toolkit's \"weighted\" / linear_timesteps)", "objective")
    # --- masked training (issue #21 item 3; data/companions.py, companion_batch.py)
    unmasked_weight: float = setting(0.1, "masked training: loss weight where an image's mask (name.mask.png, "
                                     "else its alpha) is black; 1 ignores masks, 0 trains only the white part",
                                     "objective")
    # --- EMA
    ema: bool = setting(False, "keep an fp32 EMA of the LoRA weights; used for samples and saves", "ema")
    ema_decay: float = setting(0.99, "share of the EMA kept at each optimizer step; "
                                     "0.99 averages about the last 100 steps", "ema")
    # --- data
    dataset_dir: str = setting("", "folder of images + same-stem .txt captions", "data")
    resolutions: list[int] = setting([512], "bucket resolutions (area cap res²)", "data")
    repeats: int = setting(1, "times each image is seen per epoch", "data")
    caption_dropout: float = setting(0.05, "probability of training on the empty caption", "data")
    trigger_word: str = setting("", "replaces {trigger} in captions, else prepended", "data")
    caption_prefix: str = setting("", "put before every caption (after the trigger word)", "data")
    caption_suffix: str = setting("", "put after every caption", "data")
    default_caption: str = setting("", "for images without a .txt (else the trigger word alone)", "data")
    shuffle_tags: bool = setting(False, "shuffle comma-separated tags (seeded variants, each encoded once)", "data")
    keep_tags: int = setting(0, "leading tags that shuffling keeps in place", "data")
    caption_variants: int = setting(4, "shuffled variants cached per caption when shuffle_tags is on", "data")
    crop: str = setting("center", "center or random (seeded, fixed per image so latents stay cached)", "data")
    cache_dir: str = setting("", "latent/text cache; empty = <dataset_dir>/.kiln_cache", "data")
    cache_max_gb: float = setting(0.0, "prune other entries (least recently used) above this size; 0 = no limit",
                                  "data")
    # --- preservation (issue 21 item 2): differential output preservation and regularisation images
    preservation_class: str = setting("", "differential output preservation (DOP): the class word that replaces "
                                          "the trigger word in every caption (e.g. person); those captions are "
                                          "encoded and cached beside the others", "data")
    preservation_weight: float = setting(0.0, "DOP: weight of the loss that holds the LoRA's prediction on the "
                                              "class-word caption to the base model's (ai-toolkit's "
                                              "diff_output_preservation_multiplier; 1.0 is usual); 0 = off. Costs "
                                              "one more forward without grad a step, and the forward with grad runs "
                                              "twice the batch (2.3-2.4x the step time on an H100 and 2x the "
                                              "activations)",
                                         "objective")
    reg_dataset_dir: str = setting("", "regularisation images (prior preservation): a folder of class images with "
                                       "their own captions; each epoch draws them, in batches of their own, beside "
                                       "the training images; empty = none", "data")
    reg_repeats: int = setting(1, "times each regularisation image is seen per epoch", "data")
    reg_weight: float = setting(1.0, "loss weight of the regularisation batches (kohya's prior_loss_weight)",
                                "objective")
    # --- run output
    output_dir: str = setting("runs", "run folders go here", "output")
    run_name: str = setting("", "run folder name, as typed; empty: the dataset folder's name in ComfyUI "
                                '(another run of other settings there: <name>-2), "<arch>-<date>-<time>" headless',
                            "output")
    checkpoint_every: int = setting(250, "steps between resumable checkpoints; 0 = only at the end", "output")
    keep_checkpoints: int = setting(3, "newest K checkpoints kept", "output")
    checkpoint_loras: bool = setting(False, "nodes: also write each checkpoint's LoRA to models/loras/kiln/"
                                            "<run>-stepNNNNNN.safetensors, to compare steps in a graph", "output")
    log_every: int = setting(10, "steps between loss reads (a host sync on GPU)", "output", advanced=True)
    log_tensorboard: bool = setting(False, "write loss, learning rate, validation images and the config as "
                                           "TensorBoard event files under <run>/tensorboard/ (pip install tensorboard)",
                                    "output")
    wandb_project: str = setting("", "Weights & Biases project to log the same to, under <run>/wandb/; "
                                     "empty = off (pip install wandb)", "output")
    wandb_mode: str = setting("offline", "offline: W&B files stay in the run folder (upload later with "
                                         "`wandb sync`); online: sent as the run goes (after `wandb login`)", "output")
    save_dtype: str = setting("bf16", "dtype of saved LoRA weights", "output")
    lora_format: str = setting("comfy", "comfy (ComfyUI-native keys), diffusers, kohya", "output")
    # --- adapter kind (issue 21.1; trainer/lora/adapters.py). After every shipped Training Options field:
    # the node lists fields not shipped in FIELDS order, and saved workflows are positional
    adapter: str = setting("lora", "lora; lokr (Kronecker: w1 ⊗ w2, LyCORIS); loha (Hadamard of two low-rank "
                           "pairs); dora (LoRA + a magnitude per input column). README: Adapter kinds", "adapter")
    lokr_factor: int = setting(-1, "lokr: w1 is about factor × factor (LyCORIS's factorization); -1 = the split "
                               "nearest a square (smallest file)", "adapter", advanced=True)
    lokr_full_w2: bool = setting(False, "lokr: w2 a full matrix (scale 1, alpha unused) instead of w2_a @ w2_b of "
                                 "rank `rank`", "adapter", advanced=True)
    # --- validation samples (headless `train`; in a graph, Kiln Validation Settings does this). Output
    # settings: they never change what trains, and a run resumes whatever they say.
    sample_prompts: list[str | dict] = setting(
        [], "prompts to sample while training, into <run>/samples/; each a string (ai-toolkit's flags work: "
            '"a cat --n blurry --w 768 --h 1024 --seed 7 --cfg 4 --steps 20") or a table '
            "{prompt, negative, seed, steps, cfg, width, height} whose keys override the sample_* settings; "
            "empty = no samples", "samples")
    sample_every: int = setting(250, "steps between samples (and at the last step); 0 = only at the end", "samples")
    sample_first: bool = setting(True, "also sample before the first step (the model without the LoRA, to "
                                       "compare against); a resumed run does not", "samples")
    sample_seed: int = setting(42, "sampling seed (fixed, so steps compare)", "samples")
    sample_walk_seed: bool = setting(True, "prompt N samples with sample_seed + N (ai-toolkit's walk_seed); "
                                           "off: every prompt uses sample_seed", "samples")
    sample_negative: str = setting("", "negative prompt of every sample (a prompt's own wins); "
                                       "it counts only with a cfg above 1", "samples")
    sample_steps: int = setting(0, "sampling steps; 0 = the model family's (Z-Image Turbo 8, Z-Image 30, "
                                   "Flux2 and Qwen-Image 20)", "samples")
    sample_cfg: float = setting(0.0, "CFG scale; 0 = the model family's (1.0 for Z-Image Turbo and Flux2, "
                                     "4.0 for Z-Image, 2.5 for Qwen-Image)", "samples")
    sample_sampler: str = setting("auto", "a ComfyUI sampler (euler, res_multistep, ...); auto = the model "
                                          "family's (res_multistep for Z-Image, else euler)", "samples")
    sample_scheduler: str = setting("auto", "a ComfyUI scheduler (simple, beta, karras, ...); auto = the model "
                                            "family's (simple)", "samples")
    sample_width: int = setting(1024, "sample width in px (a multiple of 16)", "samples")
    sample_height: int = setting(1024, "sample height in px (a multiple of 16)", "samples")
    # --- held-out loss and early stopping (trainer/run/holdout.py)
    holdout: float = setting(0.0, "images kept out of training for a held-out loss: a count (1, 2, ...) or a "
                                  "share below 1 (0.1 = 10%), chosen by the seed; 0 = none", "ema")
    holdout_every: int = setting(100, "steps between held-out loss evaluations (and at the last step)", "ema")
    holdout_sigmas: int = setting(4, "noise levels per held-out image, spread evenly over (0,1); the noise is "
                                     "drawn once from the seed, so every evaluation sees the same draws",
                                  "ema", advanced=True)
    early_stop_patience: int = setting(0, "stop after this many held-out evaluations without improvement; "
                                          "the best step's LoRA is kept in <run>/best/; 0 = off (needs holdout)", "ema")
    early_stop_min_delta: float = setting(0.0, "improvement the held-out loss must make to count as one",
                                          "ema", advanced=True, step=1e-5)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
HELP: dict[str, str] = {name: f.metadata.get("help", "") for name, f in FIELDS.items()}
GROUP: dict[str, str] = {name: f.metadata["group"] for name, f in FIELDS.items()}
ADVANCED = frozenset(name for name, f in FIELDS.items() if f.metadata["advanced"])
STEPS: dict[str, float] = {name: f.metadata["step"] for name, f in FIELDS.items() if f.metadata["step"]}
# The sample settings: output, not identity (a run's folder hash and resume ignore them; see nodes/run.py).
SAMPLE_FIELDS = tuple(name for name in FIELDS if name.startswith("sample_"))
# A sample prompt's own settings (a table's keys) → the setting each overrides (its type and bounds).
PROMPT_KEYS = {"prompt": "", "negative": "sample_negative", "seed": "sample_seed", "steps": "sample_steps",
               "cfg": "sample_cfg", "width": "sample_width", "height": "sample_height"}
# ai-toolkit's (and sd-scripts') flags in a prompt string → the key each sets.
PROMPT_FLAGS = {"n": "negative", "w": "width", "h": "height", "d": "seed", "seed": "seed", "l": "cfg", "cfg": "cfg",
                "s": "steps", "steps": "steps"}

# Presets after ai-toolkit's Z-Image Turbo / Flux2 LoRA preset (shared/REFERENCE.md):
# rank 32, lr 1e-4, wd 1e-4, [512, 768, 1024], caption dropout 0.05, checkpointing,
# bf16, "weighted" timesteps (our bell loss weighting). Kiln uses AdamW rather than
# adamw8bit: on a rank-32 LoRA the 8-bit state saves ~0.5 GB and bitsandbytes is
# missing on Macs, so the presets run everywhere.
PRESETS: dict[str, dict[str, Any]] = {
    "quick_test": dict(steps=100, rank=8, alpha=8.0, learning_rate=4e-4, resolutions=[512],
                       checkpoint_every=50, keep_checkpoints=2, log_every=5, caption_dropout=0.0),
    "character": dict(steps=3000, rank=32, alpha=32.0, learning_rate=1e-4, weight_decay=1e-4,
                      resolutions=[512, 768, 1024], caption_dropout=0.05, loss_weighting="bell",
                      content_or_style="balanced", gradient_checkpointing=True, mixed_precision="bf16",
                      checkpoint_every=250),
    "style": dict(steps=2000, rank=16, alpha=16.0, learning_rate=1e-4, weight_decay=1e-4,
                  resolutions=[512, 768, 1024], caption_dropout=0.05, loss_weighting="bell",
                  content_or_style="style", gradient_checkpointing=True, mixed_precision="bf16",
                  checkpoint_every=250),
    "concept": dict(steps=2500, rank=32, alpha=32.0, learning_rate=1e-4, weight_decay=1e-4,
                    resolutions=[512, 768, 1024], caption_dropout=0.05, loss_weighting="bell",
                    content_or_style="content", gradient_checkpointing=True, mixed_precision="bf16",
                    checkpoint_every=250),
}


class ConfigError(KilnError):
    """A bad setting: the message names the key, the value and what is allowed."""
