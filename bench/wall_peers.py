"""The peers' whole runs for bench/wall.py (issue 18 item 3): the same 1,000 mixed-bucket steps, trained by
ComfyUI's native Train LoRA node and by diffusers' own transformer with a PEFT LoRA (eager, and with
diffusers' one-line `compile_repeated_blocks`), each doing what a user of that tool gets.

    run_native(ctx)      ComfyUI's TrainLoraNode in bucket mode on the latents ResolutionBucket groups, then
                         the LoRA saved as its Save LoRA node saves it. It has no checkpoints and no samples
                         during training, so its run has none (recorded: validation_s and checkpoints None).
    run_diffusers(ctx)   diffusers' Flux2Transformer2DModel / ZImageTransformer2DModel at ComfyUI's size with
                         PEFT LoRA on Kiln's default targets (bench/peer.py), the loop ai-toolkit and
                         SimpleTuner run: shuffled epochs over the bucket entries, batch 1, flow-matching
                         noise at logit-normal sigmas, bf16 autocast over fp32 adapters, fused AdamW,
                         clipping at 1.0; every --every steps the adapter and optimizer state saved (as those
                         trainers' checkpoints are) and the same samples as Kiln's run (2 prompts, the family's
                         step count and cfg, 1024 px, Euler on the transformer; no VAE, no text encoder, as in
                         Kiln's row); then the LoRA saved (PEFT's state dict to safetensors).

`ctx` is wall.PeerContext: the args, the dims, the synthetic arrays and wall.Phases, which times each step
(after a sync), validation and saving, so the three trainers' records split their wall time the same way.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np
import torch

from trainer.archs import flux2


def entry_order(entries: int, steps: int, seed: int = 0) -> list[int]:
    """Shuffled epochs over the entries, one per step (batch 1), as the peers' samplers draw them."""
    rng = np.random.default_rng(seed)
    order: list[int] = []
    while len(order) < steps:
        order.extend(int(i) for i in rng.permutation(entries))
    return order[:steps]


# ---------------------------------------------------------------- diffusers + PEFT


def _flux2_ids(h: int, w: int, text: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    zero = torch.zeros(h * w, dtype=torch.long)
    img = torch.stack([zero, ys.reshape(-1), xs.reshape(-1), zero], -1)
    txt = torch.stack([torch.zeros(text, dtype=torch.long)] * 3 + [torch.arange(text)], -1)
    return img[None].float().to(device), txt[None].float().to(device)


def peer_call(family: str, model, latent: torch.Tensor, context: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The peer's prediction for one noisy latent [C, H, W] (Flux2: C = 128 patch channels; Z-Image: 16 latent
    channels) and its caption [L, D], in the shape of the latent."""
    if family == "flux2":
        c, h, w = latent.shape
        img_ids, txt_ids = _flux2_ids(h, w, context.shape[0], latent.device)
        out = model(
            hidden_states=latent.reshape(c, h * w).T[None],
            encoder_hidden_states=context[None],
            timestep=sigma.reshape(1),
            img_ids=img_ids,
            txt_ids=txt_ids,
            return_dict=False,
        )[0]
        return out[0].T.reshape(c, h, w)
    out = model(x=[latent[:, None]], t=(1 - sigma).reshape(1), cap_feats=[context], return_dict=False)[0]
    return out[0][:, 0]


def _sample(family: str, model, shape, context, steps: int, cfg: float, negative, generator) -> torch.Tensor:
    """Euler over the flow-matching sigmas 1 → 0 (one transformer call per step, two with cfg > 1)."""
    x = torch.randn(shape, generator=generator, device=context.device, dtype=torch.float32)
    sigmas = torch.linspace(1.0, 0.0, steps + 1, device=context.device)
    for sigma, next_sigma in itertools.pairwise(sigmas):
        with torch.autocast(context.device.type, dtype=torch.bfloat16):
            v = peer_call(family, model, x.to(torch.bfloat16), context, sigma).float()
            if cfg != 1.0:
                v_neg = peer_call(family, model, x.to(torch.bfloat16), negative, sigma).float()
                v = v_neg + cfg * (v - v_neg)
        x = x + (next_sigma - sigma) * v
    return x


def lora_peer(dims, device, dtype, compiled: bool):
    """diffusers' transformer with PEFT LoRA as bench/peer.py trains it: (model, its fp32 LoRA parameters)."""
    from peer import PEER_TARGETS, build_peer
    from peft import LoraConfig

    torch.manual_seed(0)
    with torch.device(device):
        model = build_peer(dims).to(dtype)
    model.requires_grad_(False)
    model.enable_gradient_checkpointing()
    model.add_adapter(LoraConfig(r=32, lora_alpha=32, init_lora_weights=True, target_modules=PEER_TARGETS[dims.arch]))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    model.train()
    if compiled:
        model.compile_repeated_blocks(fullgraph=True)
    return model, params


def run_diffusers(ctx, compiled: bool) -> dict:
    """One whole run of the diffusers + PEFT peer; fills ctx.phases, returns the record's own fields."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    dims, args, device, phases = ctx.dims, ctx.args, ctx.device, ctx.phases
    family = "flux2" if dims.arch.startswith("flux2") else "zimage"
    model, params = lora_peer(dims, device, ctx.dtype, compiled)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    latents = [torch.from_numpy(x).to(device, ctx.dtype) for x in ctx.latents]
    # Flux2's captions reach the model as 512 tokens in diffusers too (Flux2KleinPipeline pads Qwen3's output to
    # max_sequence_length 512), as ComfyUI left-pads them; Z-Image's go in at their own length in both.
    pad = (
        (lambda c: torch.nn.functional.pad(c, (0, 0, flux2.CONTEXT_TOKENS - c.shape[0], 0)))
        if family == "flux2"
        else (lambda c: c)
    )
    contexts = [pad(torch.from_numpy(c).to(device, ctx.dtype)) for c in ctx.contexts]
    prompts = [pad(c[0][0][0].to(device, ctx.dtype)) for c in ctx.prompts]
    negative = pad(ctx.negative[0][0][0].to(device, ctx.dtype))
    down = 16 if family == "flux2" else 8
    channels = latents[0].shape[0]
    side = args.sample_size // down

    def validate():
        generator = torch.Generator(device).manual_seed(42)
        with torch.no_grad():
            for prompt in prompts:
                _sample(
                    family,
                    model,
                    (channels, side, side),
                    prompt,
                    ctx.sample_steps,
                    ctx.sampling.cfg,
                    negative,
                    generator,
                )

    def save(path: Path, with_optimizer: bool):
        lora = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in get_peft_model_state_dict(model).items()}
        save_file(lora, str(path))
        if with_optimizer:
            torch.save(optimizer.state_dict(), path.with_suffix(".optimizer.pt"))

    validate, save = phases.timed("validation", validate), phases.timed("saving", save)
    generator = torch.Generator(device).manual_seed(1)
    losses: list[torch.Tensor] = []
    order = entry_order(len(latents), args.steps)
    phases.begin()
    validate()
    phases.extra[0] = phases.validation
    for step, index in enumerate(order, start=1):
        x0, context = latents[index], contexts[index]
        noise = torch.randn(x0.shape, generator=generator, device=device, dtype=torch.float32)
        sigma = torch.sigmoid(torch.randn((), generator=generator, device=device))
        x_t = ((1 - sigma) * x0.float() + sigma * noise).to(ctx.dtype)
        phases.shape = "x".join(str(n) for n in (1, *x0.shape[1:]))
        with torch.autocast(device.type, dtype=torch.bfloat16):
            prediction = peer_call(family, model, x_t, context, sigma)
        loss = (prediction.float() - (noise - x0.float())).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        phases.step_end()
        if step % args.every == 0:
            save(ctx.run_dir / f"checkpoint-{step}.safetensors", True)
            validate()
    save(ctx.run_dir / "final.safetensors", False)
    values = [float(v) for v in losses]
    out = {
        "peer_lora_params": sum(p.numel() for p in params),
        "peer_params": sum(p.numel() for p in model.parameters()),
        "checkpoints": args.steps // args.every,
        "losses": values,
    }
    return out


# ---------------------------------------------------------------- ComfyUI's native trainer


def run_native(ctx) -> dict:
    """One whole run of ComfyUI's TrainLoraNode (bucket mode, per-block checkpointing as in bench/gpu_train.py's
    native rows), then its LoRA saved as Save LoRA saves it; fills ctx.phases."""
    import comfy.utils
    from comfy_extras import nodes_dataset, nodes_train
    from gpu_train import native_steps

    phases, args = ctx.phases, ctx.args
    latents = [{"samples": torch.from_numpy(x)[None]} for x in ctx.latents]
    conditioning = [[[torch.from_numpy(c)[None], {"pooled_output": None}]] for c in ctx.contexts]
    bucketed = nodes_dataset.ResolutionBucket.execute(latents, conditioning)
    bucket_latents, bucket_conds = bucketed.result[0], bucketed.result[1]
    arguments = {
        "model": ctx.patcher,
        "batch_size": 1,
        "steps": args.steps,
        "grad_accumulation_steps": 1,
        "learning_rate": 1e-4,
        "rank": 32,
        "optimizer": "AdamW",
        "loss_function": "MSE",
        "seed": 0,
        "training_dtype": "bf16",
        "lora_dtype": "bf16",
        "quantized_backward": False,
        "algorithm": "LoRA",
        "gradient_checkpointing": True,
        "checkpoint_depth": args.native_ckpt_depth,
        "offloading": False,
        "existing_lora": "[None]",
        "bucket_mode": True,
        "bypass_mode": False,
    }
    wanted = {item.id for item in nodes_train.TrainLoraNode.define_schema().inputs}
    missing = sorted(wanted - set(arguments) - {"latents", "positive"})
    if missing:
        raise RuntimeError(f"this ComfyUI's TrainLoraNode has inputs the bench does not set: {missing}")
    if "bucket_mode" not in wanted:
        raise RuntimeError("this ComfyUI's TrainLoraNode has no bucket_mode (0.33 has): its wall run needs buckets")
    inputs = {k: [v] for k, v in arguments.items() if k in wanted}
    inputs.update(latents=bucket_latents, positive=bucket_conds)

    fwd_bwd = nodes_train.TrainSampler.fwd_bwd

    def shaped(self, model_wrap, batch_sigmas, batch_noise, batch_latent, *rest, **kwargs):
        phases.shape = "x".join(str(n) for n in (batch_latent.shape[0], *batch_latent.shape[2:]))
        return fwd_bwd(self, model_wrap, batch_sigmas, batch_noise, batch_latent, *rest, **kwargs)

    nodes_train.TrainSampler.fwd_bwd = shaped
    # Alone in its process on an H100 (torch 2.11, ComfyUI 0.33) the node's first backward failed: the
    # checkpoint's recompute ran flash attention where the forward had run cuDNN's (saved tensors differ).
    # With cuDNN's kernel out of ComfyUI's SDPA priority list (its sdpa_kernel context enables what the list
    # names) both run flash, the first of that list.
    import comfy.ops

    priority = list(getattr(comfy.ops, "SDPA_BACKEND_PRIORITY", []))
    if priority:
        comfy.ops.SDPA_BACKEND_PRIORITY[:] = [b for b in priority if b.name != "CUDNN_ATTENTION"]
    entered = time.perf_counter()
    try:
        with native_steps(phases.begin, phases.step_end), torch.inference_mode():
            result = nodes_train.TrainLoraNode.execute(**inputs)
    finally:
        nodes_train.TrainSampler.fwd_bwd = fwd_bwd
        if priority:
            comfy.ops.SDPA_BACKEND_PRIORITY[:] = priority
    lora_sd, loss_map = result.result[0], result.result[1]
    save = phases.timed("saving", lambda: comfy.utils.save_torch_file(lora_sd, str(ctx.run_dir / "final.safetensors")))
    save()
    return {
        "native_setup_s": round(phases.started - entered, 1),
        "native_buckets": len(bucket_latents),
        "native_checkpoint_depth": args.native_ckpt_depth,
        "native_cudnn_sdp": False,
        "native_trainable_params": sum(t.numel() for t in lora_sd.values()),
        "checkpoints": None,
        "losses": [float(v) for v in loss_map["loss"]],
        "wall_from": entered,
    }
