"""The settings of what trains: the model and backend, the LoRA, the speed levers, the objective, the EMA and
the adapter kind (the optimizer's: optimiser.py). Each section is a dataclass of `setting` declarations; TrainConfig (fields.py)
is all the sections in one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..archs import ARCHS
from ..lora.adapters import ADAPTER_KINDS
from ..objective.flow import CONTENT_OR_STYLE, LOSS_WEIGHTINGS, SAMPLINGS, SHIFT_MODES
from .declaration import AUTO, setting

__all__ = [
    "AdapterKindFields",
    "EmaFields",
    "LoraFields",
    "ModelFields",
    "ObjectiveFields",
    "SpeedFields",
]


@dataclass
class ModelFields:
    arch: str = setting(
        "demo",
        "model family (trainer/archs; `python -m trainer train --help` lists them)",
        "model",
        choices=tuple(ARCHS),
        node="none",
    )
    model_path: str = setting(
        "",
        "ComfyUI diffusion-model .safetensors (headless `train`); nodes pass the MODEL instead",
        "model",
        node="none",
    )
    vae_path: str = setting("", "the model's VAE .safetensors (headless `train`)", "model", node="none")
    text_encoder_path: str = setting(
        "", "the model's text encoder .safetensors (headless `train`)", "model", node="none"
    )
    backend: str = setting(
        "torch",
        '"torch" (CUDA, MPS, CPU) or "mlx" (Apple Silicon; Linux CPU for tests)',
        "model",
        choices=("torch", "mlx"),
        node="train",
        slot=5,
    )
    device: str = setting(
        "auto", "auto picks cuda, then mps, then cpu", "speed", choices=("auto", "cpu", "cuda", "mps")
    )
    sharding: str = setting(
        "auto",
        "several GPUs (torchrun): replicate keeps the whole frozen base on every GPU; shard splits its blocks "
        "over the GPUs (FSDP2), so a model larger than one card trains across several (the LoRA stays whole on "
        "each); auto shards when the base does not fit one card beside the step. One process: ignored",
        "speed",
        choices=("auto", "replicate", "shard"),
        identity=False,  # how the base is held, not what trains: the same LoRA either way
        node="none",  # Kiln Train LoRA (several GPUs) shows it; one process has nothing to shard
    )
    mixed_precision: str = setting(
        "bf16",
        '"bf16": autocast with fp32 LoRA parameters; "no": everything fp32',
        "speed",
        choices=("bf16", "no"),
    )
    base_quantize: str = setting(
        "auto",
        "store the frozen base's block Linears quantized. auto: as stored (none), unless on a CUDA GPU the run "
        "cannot fit even with the base streamed from host memory (or the host lacks the RAM to stream it): then "
        "int8, said in the log. PyTorch: int8 (W8A8: int8 weights and int8 matmuls, for Ampere/Ada cards) "
        "halves the base's memory. MLX: int8 or int4 (QLoRA-style), for a base that does not fit otherwise "
        "(auto: none); int4 is MLX-only",
        "speed",
        advanced=True,
        choices=("auto", "none", "int8", "int4"),
    )
    training_adapter: str = setting(
        "", "Z-Image Turbo: adapter LoRA merged at +1 for training, never saved", "model", node="none"
    )
    seed: int = setting(
        42,
        "one seed for noise, timesteps, captions, data order and LoRA init",
        "training",
        bounds=(0, 2**32 - 1),
        node="train",
        slot=6,
    )


@dataclass
class LoraFields:
    rank: int = setting(32, "16-64 for characters, 8-32 for styles", "adapter", bounds=(1, 256), node="train", slot=2)
    alpha: float = setting(
        32.0,
        "scale = alpha / rank; alpha = rank keeps scale 1",
        "adapter",
        bounds=(1e-3, 4096.0),
        node="train",
        slot=3,
    )
    lora_dropout: float = setting(0.0, "dropout on the LoRA branch input", "adapter", bounds=(0.0, 0.9))
    targets: list[str] = setting(
        [],
        'module patterns: exact, suffix ("img_attn.qkv") or "re:<regex>"; empty = arch defaults',
        "adapter",
    )
    init_lora: str = setting(
        "",
        "a LoRA .safetensors to start from (any trainer's layout Kiln reads) instead of a new LoRA; its rank "
        "and alpha replace rank and alpha. A resumed run continues from its checkpoint. Empty = a new LoRA",
        "adapter",
        identity=False,  # where the init LoRA lies; its content is init_lora_sha256, which counts
        node="none",
    )
    init_lora_sha256: str = setting(
        "",
        "filled in by the run: the sha256 of init_lora (of the file, or of a LORA_MODEL's tensors); a file "
        "that no longer matches stops a resume",
        "adapter",
        node="none",
    )


@dataclass
class SpeedFields:
    gradient_checkpointing: bool = setting(
        True,
        "recompute each block in backward: far less memory, slower steps; turn it off when memory allows",
        "speed",
        identity=False,
    )
    skip_checkpoint_blocks: int = setting(
        0,
        "with checkpointing: the last N blocks keep their activations (faster, +memory each)",
        "speed",
        advanced=True,
        bounds=(0, 1000),
        identity=False,
    )
    compile_blocks: bool | Literal["auto"] = setting(
        AUTO,
        "PyTorch: torch.compile each block (fuses norms, RoPE, gates; the first steps compile). auto: on with "
        "CUDA and Triton, and if the compile fails the run goes on uncompiled; true: on, a failed compile stops "
        "the run",
        "speed",
        advanced=True,
        identity=False,
        auto=True,
    )
    checkpoint_budget: float | Literal["auto"] = setting(
        AUTO,
        "with compile_blocks and checkpointing: share of each block's activation memory kept (0 = recompute "
        "the block, 1 = keep all); the compiler recomputes the cheapest rest. auto: the largest share whose "
        "estimated peak leaves a margin of the GPU's free memory at start",
        "speed",
        advanced=True,
        bounds=(0.0, 1.0),
        identity=False,
        auto=True,
    )
    stream_blocks: int | Literal["auto"] = setting(
        AUTO,
        "PyTorch: how many of the model's blocks keep their frozen weights in pinned host memory and are copied "
        "to the GPU just before they run (a ring of 3 GPU slots), so a card smaller than the model trains it; "
        "steps slow down only where the copies outrun the compute. auto: on a CUDA GPU, the fewest blocks that "
        "make the estimated step fit its free memory (0 where the model fits); 0: every block on the GPU",
        "speed",
        advanced=True,
        bounds=(0, 1000),
        identity=False,
        auto=True,
    )
    offload_activations: bool | Literal["auto"] = setting(
        AUTO,
        "PyTorch, gradient checkpointing on: each block's kept input waits in pinned host memory until the "
        "backward needs it, instead of on the GPU (a long clip's inputs are GBs: Wan 14B at 480p x 81 frames "
        "keeps 13 GiB); each block is then recomputed whole from its input (no checkpoint_budget). auto: on a CUDA "
        "GPU, only where the step does not fit even with every block streamed; true: always; false: never",
        "speed",
        advanced=True,
        identity=False,
        auto=True,
        tristate=True,
    )
    attention: str = setting(
        "auto",
        "PyTorch attention kernel tried first: auto (the fastest measured on this GPU), torch (its own order), "
        "cudnn, flash, efficient, math",
        "speed",
        advanced=True,
        choices=("auto", "torch", "cudnn", "flash", "efficient", "math"),
        identity=False,
    )
    fp8_compute: bool | Literal["auto"] = setting(
        AUTO,
        "PyTorch, H100-class GPUs: the frozen base's block Linears multiply in fp8 (per-row scales) forward and "
        "backward; LoRA stays bf16. auto: on for a base stored in fp8 on a GPU with fp8 matmuls; true: also on "
        "a bf16 base, at the cost of an fp8 copy of the block weights. Pays at 1024 px; at 512-768 px turn it "
        "off (docs/speed-and-memory.md)",
        "speed",
        advanced=True,
        identity=False,
        auto=True,
        tristate=True,
    )
    cuda_graphs: bool = setting(
        False,
        "PyTorch, CUDA, with compiled blocks: replay each block's kernels as a CUDA graph (torch.compile mode "
        "reduce-overhead), so a small bucket's step is not paced by the host's kernel launches. Each new token "
        "count records its graphs: turn it on for one or two small resolutions, not for many buckets",
        "speed",
        advanced=True,
        identity=False,
    )
    step_graphs: bool | Literal["auto"] = setting(
        AUTO,
        "PyTorch, CUDA: record each batch shape's forward and backward as a CUDA graph at its second step and "
        "replay it after, so small buckets are not paced by the host's Python and kernel launches. auto: on for "
        "one process where the graphs' memory pool (about twice the largest recorded step's activations) fits; "
        "a failed recording turns it off with one log line",
        "speed",
        advanced=True,
        identity=False,
        auto=True,
        tristate=True,
    )


@dataclass
class ObjectiveFields:  # flow matching
    timestep_sampling: str = setting("uniform", "uniform or logit_normal", "objective", choices=SAMPLINGS)
    logit_mean: float = setting(
        0.0,
        "logit_normal: centre of the logit; > 0 favours high noise",
        "objective",
        advanced=True,
        bounds=(-5.0, 5.0),
    )
    logit_std: float = setting(
        1.0, "logit_normal: spread of the logit; larger is flatter", "objective", advanced=True, bounds=(0.05, 5.0)
    )
    shift_mode: str = setting(
        "auto",
        "auto (the arch's default), none, static, resolution (Flux2-style)",
        "objective",
        advanced=True,
        choices=("auto",) + SHIFT_MODES,
    )
    shift: float = setting(3.0, "static shift value", "objective", advanced=True, bounds=(0.05, 20.0))
    content_or_style: str = setting(
        "balanced",
        "content favours high noise (composition), style low noise (texture)",
        "objective",
        choices=CONTENT_OR_STYLE,
    )
    loss_weighting: str = setting(
        "none", 'none or bell (ai-toolkit\'s "weighted" / linear_timesteps)', "objective", choices=LOSS_WEIGHTINGS
    )
    # masked training: data/companions.py, data/companion_batch.py
    unmasked_weight: float = setting(
        0.1,
        "masked training: loss weight where an image's mask (name.mask.png, else its alpha) is black; 1 ignores "
        "masks, 0 trains only the white part",
        "objective",
        bounds=(0.0, 1.0),
    )
    sigma_range: str = setting(
        "auto",
        "the noise levels σ training draws from, as 'low-high' (e.g. '0.875-1'); the draws are squeezed into it. "
        "auto: the arch's (a Wan 2.2 A14B expert its side of the boundary, high σ ≥ 0.875 for text-to-video, "
        "0.9 for image-to-video, low below; every other model 0-1)",
        "objective",
        advanced=True,
    )


@dataclass
class EmaFields:
    ema: bool = setting(False, "keep an fp32 EMA of the LoRA weights; used for samples and saves", "ema")
    ema_decay: float = setting(
        0.99,
        "share of the EMA kept at each optimizer step; 0.99 averages about the last 100 steps",
        "ema",
        bounds=(0.5, 0.99999),
    )


# trainer/lora/adapters.py. After every shipped Training Options field: the node lists fields not shipped in
# FIELDS order, and saved workflows are positional.
# "full" is one more choice of `adapter`, not a second setting: a run trains either one adapter kind or every
# weight, so one choice cannot be set to a contradiction (a separate train = full beside adapter = lokr could).
@dataclass
class AdapterKindFields:
    adapter: str = setting(
        "lora",
        "lora; lokr (Kronecker: w1 ⊗ w2, LyCORIS); loha (Hadamard of two low-rank pairs); dora (LoRA + a "
        "magnitude per input column); full (full fine-tune: every weight of the blocks, PyTorch only, saved as a "
        "diffusion-model file). docs/lora-files.md: Adapter kinds; docs/features.md: Full fine-tune",
        "adapter",
        choices=(*ADAPTER_KINDS, "full"),
    )
    lokr_factor: int = setting(
        -1,
        "lokr: w1 is about factor × factor (LyCORIS's factorization); -1 = the split nearest a square (smallest file)",
        "adapter",
        advanced=True,
        bounds=(-1, 4096),
    )
    lokr_full_w2: bool = setting(
        False,
        "lokr: w2 a full matrix (scale 1, alpha unused) instead of w2_a @ w2_b of rank `rank`",
        "adapter",
        advanced=True,
    )
