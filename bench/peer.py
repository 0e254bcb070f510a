"""The peer in bench/gpu_train.py's rows (issue 18 item 3): diffusers' own transformer with a PEFT LoRA,
which is what ai-toolkit, SimpleTuner and musubi-tuner train, on the same GPU in the same process.

    run_peer(dims, inputs, ...)   → {"peer_s_per_step", "peer_compiled_s_per_step", ...}

The model is diffusers' Flux2Transformer2DModel / ZImageTransformer2DModel at the same size as ComfyUI's
(parameter counts equal: 3,875,544,576 for Klein 4B, 6,154,908,736 for Z-Image), built with diffusers'
own random init in bf16 on the GPU. LoRA: PEFT (`add_adapter`, rank 32, alpha 32) on the Linears that
are Kiln's default targets, under diffusers' names (split q/k/v where ComfyUI fuses them, so the peer
has more LoRA parameters: recorded). fp32 adapter weights, bf16 autocast, diffusers' own gradient
checkpointing (`enable_gradient_checkpointing`), torch's fused AdamW (lr 1e-4), clipping at 1.0, loss
in fp32 against a fixed random target. "Compiled" adds diffusers' one line,
`compile_repeated_blocks(fullgraph=True)` (regional compilation of the repeated blocks).

Inputs are the row's own: the same latent tokens and caption tokens per image (Flux2: image tokens as
[B, L, 128] with (t, h, w, l) position ids; Z-Image: the latent [16, 1, H/8, W/8] and caption
embeddings as lists), random, seeded. One step = what a trainer's step is: forward, loss, backward,
clip, optimizer step, zero_grad; timed as the Kiln rows are (a sync at each step boundary).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

PEER_TARGETS = {
    # Kiln's default targets (trainer/archs) under diffusers' module names.
    "flux2_klein": (
        r".*transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj"
        r"|to_add_out)|ff\.(linear_in|linear_out)|ff_context\.(linear_in|linear_out))"
        r"|.*single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)"
    ),
    "zimage": (
        r".*(layers|noise_refiner|context_refiner)\.\d+\.(attention\.(to_q|to_k|to_v|to_out\.0)"
        r"|feed_forward\.(w1|w2|w3))"
    ),
    # Wan's block Linears (trainer/archs/wan.py DEFAULT_TARGETS) under diffusers' WanTransformer3DModel names
    "wan": (
        r".*blocks\.\d+\.(attn1\.(to_q|to_k|to_v|to_out\.0)|attn2\.(to_q|to_k|to_v|to_out\.0)"
        r"|ffn\.net\.(0\.proj|2))"
    ),
}
PEER_TARGETS["wan21_t2v"] = PEER_TARGETS["wan22_ti2v_5b"] = PEER_TARGETS.pop("wan")


def build_peer(dims):
    """diffusers' transformer for a bench variant, bf16, on the current default device."""
    from diffusers import Flux2Transformer2DModel, ZImageTransformer2DModel

    if dims.arch == "flux2_klein":
        heads = dims.hidden // 128
        return Flux2Transformer2DModel(
            num_layers=dims.double_blocks,
            num_single_layers=dims.single_blocks,
            num_attention_heads=heads,
            joint_attention_dim=dims.context_dim,
            guidance_embeds=False,
        )
    if dims.arch == "zimage":
        return ZImageTransformer2DModel(
            dim=dims.hidden,
            n_layers=dims.single_blocks,
            n_refiner_layers=dims.refiner_blocks,
            n_heads=dims.hidden // 128,
            n_kv_heads=dims.hidden // 128,
            cap_feat_dim=dims.context_dim,
        )
    if dims.arch in ("wan21_t2v", "wan22_ti2v_5b"):
        from diffusers import WanTransformer3DModel

        channels = 48 if dims.arch == "wan22_ti2v_5b" else 16
        return WanTransformer3DModel(
            num_attention_heads=dims.hidden // 128,
            attention_head_dim=128,
            in_channels=channels,
            out_channels=channels,
            text_dim=dims.context_dim,
            ffn_dim=dims.mlp_hidden,
            num_layers=dims.single_blocks,
        )
    raise ValueError(f"no diffusers peer for {dims.arch}")


def peer_inputs(dims, latents, contexts, device):
    """The row's latents and captions in the peer's call convention (kwargs of its forward)."""
    batch = len(latents)
    if dims.arch == "flux2_klein":
        c, h, w = latents[0].shape
        hidden = torch.stack([torch.from_numpy(x).reshape(c, h * w).T for x in latents]).to(device, torch.bfloat16)
        context = torch.stack([torch.from_numpy(t) for t in contexts]).to(device, torch.bfloat16)
        img_ids = torch.tensor([[0, y, x, 0] for y in range(h) for x in range(w)], dtype=torch.float32)
        txt_ids = torch.tensor([[0, 0, 0, t] for t in range(context.shape[1])], dtype=torch.float32)
        return dict(
            hidden_states=hidden,
            encoder_hidden_states=context,
            timestep=torch.full((batch,), 0.5, device=device),
            img_ids=img_ids[None].expand(batch, -1, -1).to(device),
            txt_ids=txt_ids[None].expand(batch, -1, -1).to(device),
            return_dict=False,
        )
    if dims.arch in ("wan21_t2v", "wan22_ti2v_5b"):  # latents [C, t, h, w]: the video as diffusers takes it
        return dict(
            hidden_states=torch.stack([torch.from_numpy(x) for x in latents]).to(device, torch.bfloat16),
            timestep=torch.full((batch,), 500.0, device=device),
            encoder_hidden_states=torch.stack([torch.from_numpy(t) for t in contexts]).to(device, torch.bfloat16),
            return_dict=False,
        )
    return dict(
        x=[torch.from_numpy(x)[:, None].to(device, torch.bfloat16) for x in latents],
        t=torch.full((batch,), 0.5, device=device),
        cap_feats=[torch.from_numpy(t).to(device, torch.bfloat16) for t in contexts],
        return_dict=False,
    )


def _output(dims, out):
    out = out[0]
    return torch.stack(list(out)) if isinstance(out, (list, tuple)) else out


def run_peer(
    dims, latents, contexts, *, steps: int, warmup: int, device, compiled: bool, checkpointing: bool, clock
) -> dict:
    """clock: gpu_train.StepClock, timing the peer as the row's Kiln steps are timed (its --timing)."""
    from peft import LoraConfig

    prefix = "peer_compiled_" if compiled else "peer_"
    torch.manual_seed(0)
    with torch.device(device):
        model = build_peer(dims).to(torch.bfloat16)
    model.requires_grad_(False)
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.add_adapter(LoraConfig(r=32, lora_alpha=32, init_lora_weights=True, target_modules=PEER_TARGETS[dims.arch]))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()  # fp32 LoRA weights, as Kiln trains them
    model.train()
    if compiled:
        model.compile_repeated_blocks(fullgraph=True)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    kwargs = peer_inputs(dims, latents, contexts, device)
    generator = torch.Generator(device).manual_seed(1)
    with torch.no_grad():
        target = _output(dims, model(**kwargs)).float()
        target = torch.randn(target.shape, generator=generator, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    losses, started = [], time.perf_counter()
    for _ in range(steps):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            prediction = _output(dims, model(**kwargs))
        loss = (prediction.float() - target).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        clock.mark()
    durations = clock.durations()[max(0, warmup - 1) :]  # durations()[0] is step 2
    losses = [float(v) for v in losses]
    out = {
        f"{prefix}s_per_step": round(statistics.median(durations), 4) if durations else None,
        f"{prefix}first_step_s": round(clock.first_mark - started, 2),
        f"{prefix}loss_first": losses[0],
        f"{prefix}loss_last": losses[-1],
        f"{prefix}loss_finite": all(math.isfinite(v) for v in losses),
        "peer_lora_params": sum(p.numel() for p in params),
        "peer_params": sum(p.numel() for p in model.parameters()),
    }
    if device.type == "cuda":
        out[f"{prefix}peak_alloc_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    del model, optimizer, params, kwargs, target
    return out
