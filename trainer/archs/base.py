"""The types every architecture file fills in: an Arch and the facts it holds (ComfyUI model, diffusers
names, sampling defaults), and the per-row model extras two families share. Imports no family."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .layout import Layout


@dataclass(frozen=True)
class DiffusersRule:
    """Maps a ComfyUI module path (regex with groups) onto diffusers names.

    `targets` lists the diffusers module templates (formatted with the regex
    groups); with more than one target the fused layer's output rows are split
    into `len(targets)` equal parts, or by `split_sizes` when given.
    """

    comfy: str  # e.g. r"double_blocks\.(\d+)\.img_attn\.qkv"
    targets: tuple[str, ...]  # e.g. ("transformer_blocks.{0}.attn.to_q", ...)
    split_sizes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ComfyModel:
    """Which loaded ComfyUI models an arch trains. The bridge (nodes/comfy/) reads the facts off the
    MODEL and asks `matches`; names, not classes, so this file never imports ComfyUI."""

    model_class: str  # a comfy.model_base class the model is an instance of, e.g. "Flux2"
    config_class: str = ""  # the exact comfy.supported_models class ("" = any): ZImage, not ZImagePixelSpace
    attributes: tuple[tuple[str, Any], ...] = ()  # (dotted path under model.model, required value)

    def matches(self, classes: set[str], config_class: str, read: Callable[[str], Any]) -> bool:
        return (
            self.model_class in classes
            and (not self.config_class or config_class == self.config_class)
            and all(read(path) == value for path, value in self.attributes)
        )


@dataclass(frozen=True)
class Sampling:
    """How a family is sampled in ComfyUI's KSampler: the defaults of headless validation samples
    (config sample_steps / sample_cfg / sample_sampler / sample_scheduler left at 0 / "auto")."""

    steps: int = 20
    cfg: float = 1.0
    sampler: str = "euler"  # a comfy.samplers.KSampler.SAMPLERS name
    scheduler: str = "simple"  # a comfy.samplers.KSampler.SCHEDULERS name


@dataclass(frozen=True)
class Arch:
    name: str  # registry key, e.g. "flux2_klein"
    family: str  # "flux2", "zimage", "generic": shares key maps
    latent_channels: int  # channels of x handed to the model
    latent_downscale: int  # image pixels per latent cell (Flux2 16, Z-Image 8)
    patch: int  # latent cells per token side inside the model (Flux2 1, Z-Image 2)
    bucket_divisor: int  # image sides are multiples of this (pixels)
    default_targets: tuple[str, ...]  # LoRA target patterns (see backends: exact, suffix, re:)
    block_lists: tuple[str, ...]  # attribute names of the model's block ModuleLists
    shift_mode: str  # "none" | "static" | "resolution": timestep shift default
    shift: float  # static shift value (ignored unless shift_mode == "static")
    # Batch → model inputs: `model(x_t, sigma, context, **extras)` where context = collate_context([T_i,D]
    # per row) and extras = model_extras(batch_size, [T_i]).
    model_extras: Callable[[int, list[int]], dict]
    context_side: str = "right"  # where a caption's padding zeros go: "right", or "left" (Flux2)
    context_tokens: int = 0  # every caption padded to at least this many tokens (Flux2: 512)
    # Rows whose padded caption lengths differ run as separate calls, each trimmed to its own tokens, as
    # ComfyUI runs each prompt alone (a model that masks no padding attends to it otherwise).
    split_by_caption_length: bool = False
    training_adapter: str = "none"  # "none" | "merge": merged at +1 for training, removed for samples
    # Blocks never write into their own inputs, so compile_blocks also compiles the blocks that keep
    # their activations (checkpointing off, skip_checkpoint_blocks). Flux2's `img += ...` blocks do.
    pure_blocks: bool = False
    # Known to add into a tensor a norm keeps for backward (Flux2's `x += ...` after `norm(x)`): compiled,
    # such blocks trace only under bf16 autocast on CUDA (the norm then keeps its own fp32 cast), so
    # compile_blocks auto stays off elsewhere (fp32 on CUDA failed its first step, H100, bench/RESULTS.md).
    blocks_write_norm_inputs: bool = False
    # Linears (names inside a block) whose forward input fp8_compute quantizes with fp8_kernels' opaque
    # Triton kernel instead of inductor's quantization fused into the input's producer, where that fused
    # kernel is slow (Flux2's single-block linear2: the concat with the attention output, 0.49 ms a call
    # against 0.06 ms for its bytes). Taken only where every bucket is ≥ 1024 px: smaller steps ran slower
    # with it (levers.KERNEL_MIN_RESOLUTION, bench/RESULTS.md).
    fp8_quantize_kernel: tuple[str, ...] = ()
    comfy: ComfyModel | None = None  # the ComfyUI model it is (None: detected only as the fallback, or never)
    clip_type: str = ""  # comfy.sd.CLIPType name of its text encoder, for headless loading
    modelspec: tuple[str, str] = ()  # (modelspec.architecture, modelspec.implementation) in LoRA metadata
    module_marker: str = ""  # regex on ComfyUI module paths that says a LoRA is of this layout
    mlx_model: str = ""  # module under trainer/backends/mlx_backend/models/ ("" = none)
    diffusers_prefix: str = "transformer."
    diffusers_rules: tuple[DiffusersRule, ...] = field(default_factory=tuple)
    description: str = ""
    layout: Layout | None = None  # sizes, Linears and block model for the memory estimate (layout.py)
    sampling: Sampling = Sampling()  # validation-sample defaults (steps, cfg, sampler, scheduler)
    # Tokens a caption may have before the family's reference pipeline (diffusers) cuts it: its text
    # encoder's max_sequence_length less the chat template's own tokens. ComfyUI cuts nothing, but the
    # model never saw longer prompts. 0: no known limit. check-dataset warns past it (data/quality.py).
    caption_token_limit: int = 0
    # Edit training: the model_extras key under which ComfyUI's extra_conds takes reference latents (a
    # list of raw [B,C,h,w] VAE latents, as the ReferenceLatent node gives them); "" = the family cannot.
    reference_latents: str = ""
    # The σ range training draws from (objective: sigma_range auto): a Wan 2.2 expert trains only the
    # part of the schedule ComfyUI samples it on.
    sigma_range: tuple[float, float] = (0.0, 1.0)
    # Video frames per latent frame after the first (the VAE's temporal compression; 1: an image model).
    frames_per_latent: int = 1
    # Image-to-video: a clip trains with its first frame as the start image, fed as ComfyUI's WanImageToVideo
    # feeds it (data/companion_batch.py: start_extras).
    start_image: bool = False
    # Image-to-video that also reads the start image's CLIP vision features (Wan 2.1 I2V's img_emb): fed as
    # WanImageToVideo's clip_vision_output (data/companion_batch.py: start_extras).
    clip_vision: bool = False

    def collate_context(self, contexts: list[np.ndarray]) -> np.ndarray:
        """Rows [T_i,D] → [B,T,D], T = max(context_tokens, longest), zeros on the padded side."""
        tokens = max(self.context_tokens, *(c.shape[0] for c in contexts))
        if all(c.shape[0] == tokens and c.dtype == np.float32 for c in contexts):
            # nothing to pad (Flux2's encoder gives its 512 tokens): one row is its own view, no copy
            return contexts[0][None] if len(contexts) == 1 else np.stack(contexts)
        out = np.zeros((len(contexts), tokens, contexts[0].shape[1]), dtype=np.float32)
        for row, c in enumerate(contexts):
            if self.context_side == "left":
                out[row, tokens - c.shape[0] :] = c
            else:
                out[row, : c.shape[0]] = c
        return out


def no_extras(batch_size: int, lengths: list[int]) -> dict:
    return {}


def caption_lengths(batch_size: int, lengths: list[int]) -> dict:
    """{'num_tokens': per-row caption lengths}: how a right-padded batch splits into ComfyUI's calls."""
    return {"num_tokens": np.asarray(lengths, dtype=np.int64)}
