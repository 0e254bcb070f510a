"""The one training sequence of both front ends, the Train LoRA node (nodes/run.py) and headless
training (headless.py): the patcher to train → its latent format on the cached latents → the
training adapter merged → the backend's model (ComfyUI's module in a training session, or Kiln's
MLX port of its weights) → the loop. The backend branch lives here and nowhere else; so does the
validation sampling both front ends hand the loop (`validation`)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ...trainer.archs import get_arch
from ...trainer.data import MappedLatents, text_conds
from ...trainer.samples.plan import SAMPLE_FRAMES

# Called through their modules, so a test can wrap one (a forward that fails at step N, a counted free).
from . import encoders, session, ui
from . import lora as comfy_lora
from . import model as comfy_model


def train(cfg, model, dataset, *, run: Callable, adapter=None, setup: Callable | None = None):
    """Train a LoRA for `model` (a ComfyUI MODEL) on `dataset` (latents and captions encoded).

    run(cfg, model, data, forward=None, **front) is the loop as the front end runs it (trainer.run.loop.train
    with its run folder bound, or the console's run_loop); setup(patcher, data) -> front (keywords for `run`:
    the front end's callbacks, trainer/run/callbacks.py) is called once the patcher to train and sample on and
    the mapped data exist (the node's dashboard and validation need both). Memory is given back to ComfyUI
    afterwards, also after an error."""
    arch = get_arch(cfg.arch)
    divisor = dataset.settings.divisor
    if divisor % arch.bucket_divisor:
        raise ValueError(
            f"the dataset's buckets are multiples of {divisor} px, but {arch.name} needs multiples of "
            f"{arch.bucket_divisor}: load the dataset again with divisor {arch.bucket_divisor}"
        )
    model = session.trainable(model)  # dynamic VRAM: ComfyUI's fully loadable delegate (outputs use the original)
    # Caches hold raw VAE latents; the model sees them in its latent format (Z-Image: shift and scale).
    data = MappedLatents(dataset.training_data(), lambda raw: comfy_model.item_latent_in(model, raw))
    comfy_model.check_conditioning(model, text_conds.read(data, "empty_conds"))
    front = setup(model, data) if setup is not None else {}
    train_model = comfy_lora.training_adapter_merged(model, adapter) if adapter is not None else model
    try:
        if cfg.backend == "mlx":
            return run(cfg, mlx_model(train_model, cfg), data, **front)
        with session.training_session(train_model, cfg.device, step_room=step_room(cfg, train_model)) as (
            module,
            _device,
        ):
            return run(cfg, module, data, forward=comfy_model.make_forward(train_model, cfg.arch), **front)
    finally:
        session.free_memory()


def step_room(cfg, model):
    """For training_session: the room Kiln's step needs beside the weights on a GPU of `total` bytes, where
    stream_blocks may stream (memory_plan.step_room); None where it may not."""
    from ...trainer.backends.torch_backend import memory_plan

    if cfg.backend != "torch" or cfg.stream_blocks == 0:
        return None
    return lambda total: memory_plan.step_room(model.model.diffusion_model, cfg, total)


def mlx_model(model, cfg):
    """The ComfyUI model's weights (training adapter merged, as ComfyUI loads the clone) in Kiln's MLX
    port of the same architecture; ComfyUI's copy is then given back to its memory manager."""
    from ...trainer.backends.mlx_backend import models as mlx_models
    from ...trainer.backends.mlx_backend.models.weights import from_state_dict

    dtype = "bfloat16" if cfg.mixed_precision == "bf16" else "float32"
    with session.training_session(model, "auto") as (module, _device):
        weights = from_state_dict(module.state_dict(), dtype)  # tensor by tensor, straight to dtype
    session.free_memory()
    return mlx_models.build(cfg.arch, weights, dtype, quantize=cfg.base_quantize)


@dataclass(frozen=True)
class Sample:
    """One validation image: CONDITIONING, VAE and KSampler settings (the node's Validation Settings
    output has the same fields)."""

    positive: object
    negative: object
    vae: object
    seed: int
    steps: int
    cfg: float
    sampler_name: str
    scheduler: str
    width: int
    height: int
    frames: int = 1  # a video model's clip length (image models ignore it)
    start_latent: object = None  # a LATENT to start from (Wan22ImageToVideoLatent's), else an empty one


def validation(cfg, model, samples: Sequence, on_sample: Callable) -> Callable:
    """validate(step, lora) for the loop (a front end's Callbacks.validate), the node's and headless training's:
    each of `samples` (Sample-like) drawn by ComfyUI's sampler and VAE (ui.sample) on `model`, the patcher
    setup() got, i.e. without the training adapter. Torch: the LoRA branches are live in its modules (the
    loop swaps the EMA weights in when EMA is on); MLX: the weights `lora()` gives are patched onto a clone
    through ComfyUI's loader. lora None (before training): the model as it is. on_sample(step, index,
    images) takes each IMAGE. Sampling leaves torch's random state as it was, so a run's LoRA dropout
    draws are the same with or without samples."""

    note = start_image_note(cfg.arch, samples)
    if note:
        logging.getLogger("kiln").warning("[Kiln] %s", note)

    def validate(step: int, lora: Callable | None = None) -> list:
        sampler_model, plain = (
            _unstreamed(model)
            if cfg.backend == "torch" or lora is None
            else (
                comfy_lora.apply_lora(model, comfy_lora.lora_model_from(lora(), cfg.arch), 1.0),
                contextlib.nullcontext(),
            )
        )
        drawn = []
        with plain:
            for index, s in enumerate(samples):
                with torch.random.fork_rng(devices=_rng_devices()):
                    images = ui.sample(
                        sampler_model,
                        s.positive,
                        s.negative,
                        s.vae,
                        seed=s.seed,
                        steps=s.steps,
                        cfg=s.cfg,
                        sampler_name=s.sampler_name,
                        scheduler=s.scheduler,
                        width=s.width,
                        height=s.height,
                        frames=s.frames,
                        start_latent=s.start_latent,
                    )
                on_sample(step, index, images)
                drawn.append(images[0].float().cpu().numpy())  # a clip's first frame stands for it in the sinks
        return drawn  # [H,W,3] in 0..1 each: the loop's TensorBoard / W&B sinks log them

    return validate


def start_image_note(arch_name: str, samples: Sequence) -> str:
    """For an image-to-video model whose sample prompts carry no start image (ComfyUI's sampler reads it from the
    conditioning WanImageToVideo returns: concat_latent_image), what to wire; "" otherwise."""
    if not get_arch(arch_name).start_image or not samples:
        return ""
    if all(any("concat_latent_image" in extra for _, extra in s.positive) for s in samples):
        return ""
    return (
        f"{arch_name} is an image-to-video model and its samples have no start image: they are drawn from the "
        "prompt alone. To sample from a start image, feed Kiln Validation Settings the positive and negative "
        "outputs of WanImageToVideo (its start_image; for Wan 2.1 I2V also clip_vision_output from CLIP Vision "
        "Encode)"
    )


def _unstreamed(model):
    """(the patcher to sample on, the context to sample in): `model`, unless the training model is another clone
    of it (the training adapter merged) whose blocks stream from host memory: loading `model` would have ComfyUI
    re-patch the shared weights, which the stream holds in its GPU ring. Then the samples are drawn on the
    training model with the adapter taken out by live branches of −ΔW (torch_backend.lora.subtracted): the
    model without the adapter up to the rounding of the merged weights."""
    from ...trainer.backends.torch_backend.lora import subtracted
    from ...trainer.backends.torch_backend.streaming import streams

    training = session.training_model()
    if training is None or training is model or not streams(training.model.diffusion_model):
        return model, contextlib.nullcontext()
    return training, subtracted(training.model.diffusion_model, comfy_lora.merged_adapter(training))


def _rng_devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def prompt_samples(plan, clip, vae) -> list[Sample]:
    """Headless samples: trainer.samples.plan.sample_plan's prompts with their CONDITIONING (CLIPTextEncode's,
    each text encoded once) and the VAE to decode them."""
    conds: dict[str, object] = {}
    for text in [t for p in plan for t in (p.prompt, p.negative)]:
        if text not in conds:
            conds[text] = encoders.conditioning(clip, text)
    return [
        Sample(
            positive=conds[p.prompt],
            negative=conds[p.negative],
            vae=vae,
            seed=p.seed,
            steps=p.steps,
            cfg=p.cfg,
            sampler_name=p.sampler_name,
            scheduler=p.scheduler,
            width=p.width,
            height=p.height,
            frames=SAMPLE_FRAMES,
        )
        for p in plan
    ]
