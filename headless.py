"""`python -m trainer train CONFIG` for ComfyUI architectures: ComfyUI as a library, no server.

A front end beside nodes/, not part of the library: trainer/ never imports ComfyUI or nodes/; its
CLI hands ComfyUI architectures to this module, which reaches ComfyUI only through nodes/comfy/.

Loads the diffusion model, VAE and text encoder from the config's .safetensors paths with
ComfyUI's own loaders, encodes the dataset through the same bridge the nodes use, and runs the
same training sequence (nodes/comfy/training.py), checkpoints and LoRA writer as the node, with
the console's progress bar (Ctrl-C saves a resumable checkpoint; --resume continues it).

Validation samples (the config's sample_prompts) take the node's path: the prompts are encoded
once by the text encoder (then freed), and the node's validation hook draws them with ComfyUI's
sampler and the VAE, on the model without the training adapter (EMA weights when EMA is on), before
the first step, every sample_every steps and at the end; each is saved into <run>/samples/, and
<run>/samples/grid.png (prompts across, steps down) is rewritten after each sampling step. While
<run>/PAUSE exists the run waits between steps (GPU memory kept; Ctrl-C still stops it).

Under torchrun (`torchrun --nproc_per_node N -m trainer train CONFIG`) every rank loads the diffusion
model on its own GPU; rank 0 alone loads the VAE and text encoder, encodes the dataset into its caches
(the other ranks then read them, under rank 0's encoder identities), samples (the others wait at a host
barrier), writes and prints (trainer/run/distributed.py). With KILN_PROGRESS_JSON=1 each sample written is
also named on a `KILN_SAMPLE {json}` line (trainer/cli/launch.py reads it).
"""

from __future__ import annotations

import functools

from .nodes.comfy import loaders as comfy_loaders
from .trainer.archs import get_arch
from .trainer.cli.console import SAMPLE_TAG, emit, finish, run_loop
from .trainer.data.dataset import DataSettings
from .trainer.objective.preservation import encoded_datasets
from .trainer.run import distributed
from .trainer.run.callbacks import Validation
from .trainer.samples.grid import SampleGrid
from .trainer.samples import clips
from .trainer.samples.plan import describe, parameters, sample_path, sample_plan, save_sample


def train_command(run, resume: bool, loaders=comfy_loaders.load_models) -> int:
    """Train `run` (trainer/cli/train.py's Prepared: the config read with its init LoRA's rank and alpha, this
    rank of torchrun's joined, the dataset folder checked, the run folder named) on a ComfyUI architecture."""
    cfg, group, run_dir, config_path = run.cfg, run.group, run.run_dir, run.source
    if get_arch(cfg.arch).clip_vision:  # checked before any model loads
        raise SystemExit(
            f"{config_path}: {cfg.arch} reads each start image's CLIP vision features, which headless training does "
            "not encode (it loads no CLIP vision model): train it in ComfyUI, with a CLIP Vision Loader "
            "(clip_vision_h.safetensors) on Kiln Encode Images' clip_vision input"
        )
    comfy_loaders.start(cpu=cfg.device == "cpu")  # before the bridge imports ComfyUI's model management
    from .nodes.comfy import bridge

    plan = sample_plan(cfg)
    try:
        bridge.check_sampling({p.sampler_name for p in plan}, {p.scheduler for p in plan})
    except ValueError as error:
        raise SystemExit(f"{config_path}: {error}") from None
    # Rank 0 alone encodes and samples: the other ranks load the diffusion model only.
    model, vae, clip = loaders(cfg) if group.is_main else loaders(cfg, encoders=False)
    fits = bridge.matching_archs(model)
    if cfg.arch not in fits:
        raise SystemExit(
            f"{config_path}: arch is {cfg.arch!r} but {cfg.model_path} is a "
            f"{' / '.join(fits) or 'generic'} model; set arch to match the file"
        )
    settings = DataSettings.from_config(cfg, get_arch(cfg.arch).bucket_divisor)
    image_encoder, text_encoder = encoders(vae, clip, group, cfg.dataset_dir)
    with distributed.main_first():  # rank 0 encodes into the caches; the other ranks read them
        dataset = encoded_datasets(cfg, settings, cfg.dataset_dir, image_encoder, text_encoder, cfg.cache_dir or None)
        if group.is_main:
            dataset.prune_cache(cfg.cache_max_gb)
            print(dataset.summary())
    # The VAE stays for the samples (if any; rank 0's); the text encoder goes.
    samples = bridge.prompt_samples(plan, clip, vae) if group.is_main else []
    del vae, clip
    bridge.free_memory()
    if plan and group.is_main:
        print(describe(cfg, run_dir))

    def setup(patcher, data) -> dict:
        """The sampling hook on the patcher to train, as the node's; the base model first on a new run."""
        if not plan:
            return {}
        grid = SampleGrid(run_dir, [p.prompt for p in plan]).load_existing()  # a resumed run's earlier rows

        def on_sample(step: int, index: int, images) -> None:
            frames = images.float().cpu().numpy()
            if clips.is_clip(frames):  # a video model's clip: an animated WebP named as the PNG would be
                where = sample_path(run_dir, step, index, len(plan), clips.CLIP_SUFFIX)
                path = clips.save_clip(where, frames, description=parameters(plan[index], step))
            else:
                where = sample_path(run_dir, step, index, len(plan))
                path = save_sample(where, frames[0], plan[index], step=step, arch=cfg.arch)
            emit(SAMPLE_TAG, {"step": step, "index": index, "path": str(path)})
            grid.add(step, index, frames[0])
            if index == len(plan) - 1:
                grid.write()

        # The loop samples before its first step too (sample_first, a new run only), so its TensorBoard / W&B
        # sinks log those images as step 0.
        validate = bridge.validation(cfg, patcher, samples, on_sample)
        return {"validation": Validation(validate, every=cfg.sample_every or cfg.steps, first=cfg.sample_first)}

    result = bridge.train(
        cfg,
        model,
        dataset,
        adapter=comfy_loaders.training_adapter(cfg),
        setup=setup,
        run=functools.partial(run_loop, run_dir=run_dir, resume=resume),
    )
    finish(cfg, result, run_dir, run.name)
    return 0


def encoders(vae, clip, group: distributed.Group, dataset_dir: str) -> tuple[tuple, tuple]:
    """((encode, identity) of the images, of the captions). Rank 0's are the VAE's and text encoder's; the
    other ranks have neither loaded and get rank 0's identities (so they read the caches rank 0 fills under
    main_first) with encoders that refuse a cache miss, which only a cache changed under the run can cause."""
    from .nodes.comfy import bridge

    if group.is_main:
        image, text = bridge.vae_encoder(vae), bridge.text_encoder(clip)
        distributed.main_texts([image[1], text[1]])
        return image, text
    identities = distributed.main_texts([])

    def missing(what: str):
        def encode(_):
            raise RuntimeError(
                f"rank {group.rank}: {dataset_dir}: {what} is not in the cache rank 0 just filled "
                "(only rank 0 loads the encoders); was the cache folder changed or pruned during "
                "the start? Run again (the cache is filled once more)"
            )

        return encode

    return (missing("an image's latent"), identities[0]), (missing("a caption's encoding"), identities[1])
