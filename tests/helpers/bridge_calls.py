"""What a diffusion model is called with, ComfyUI's sampler's calls beside Kiln's forward's (the bridge tests of
tests/nodes/comfy/). Import after helpers.comfy_env.require_comfy(): it imports ComfyUI."""

from __future__ import annotations

import comfy.sample
import numpy as np
import torch

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.trainer.archs as archs
import kiln_pack.trainer.config as config
from kiln_pack.trainer.lora.files import LoraWeights


class Calls:
    """Records (positional args, kwargs, output) of every diffusion-model call."""

    def __init__(self, module):
        self.calls = []
        self._pending = []
        self.handles = [
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post, with_kwargs=True),
        ]

    def _pre(self, module, args, kwargs):
        self._pending.append((args, dict(kwargs)))

    def _post(self, module, args, kwargs, output):
        call_args, call_kwargs = self._pending.pop()
        self.calls.append((call_args, call_kwargs, output.detach().clone()))

    def __enter__(self):
        return self.calls

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def comfy_sampling_calls(model, cond, latent_shape, steps=2, seed=0):
    """The diffusion-model calls ComfyUI's own sampler makes for one prompt (cfg 1: positive only)."""
    latent = torch.zeros(latent_shape)
    noise = comfy.sample.prepare_noise(latent, seed)
    with Calls(bridge.diffusion_model(model)) as calls, torch.inference_mode():
        comfy.sample.sample(
            model, noise, steps, 1.0, "euler", "simple", cond, cond, latent, seed=seed, disable_pbar=True
        )
    return calls


def our_call(model, arch_name, x, sigmas, embeddings, *, grad: bool = False):
    """The diffusion-model call(s) our forward makes for rows (x, sigma, caption embedding). grad=True runs it
    as the training step does (inside a training session: grad on, a weight trainable), else as inference."""
    arch = archs.get_arch(arch_name)
    context = torch.from_numpy(arch.collate_context(embeddings))
    extras = {
        k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
        for k, v in arch.model_extras(len(embeddings), [e.shape[0] for e in embeddings]).items()
    }
    forward = bridge.make_forward(model, arch_name)
    dm = bridge.diffusion_model(model)
    if not grad:
        with Calls(dm) as calls, torch.inference_mode():
            out = forward(dm, x, sigmas, context, extras)
        return out, calls
    weight = next(dm.parameters())
    weight.requires_grad_(True)
    try:
        with Calls(dm) as calls:
            out = forward(dm, x.clone(), sigmas.clone(), context, extras)
    finally:
        weight.requires_grad_(False)
    return out, calls


APPLY_MODEL_OPTIONS = ("prefetch_dynamic_vbars",)  # what BaseModel._apply_model itself adds (0.33, not 0.17)


def same_call(ours, theirs):
    """Bitwise-equal inputs: x, timestep, context and every model kwarg. transformer_options: the sampler
    adds its own bookkeeping (uuids, cond_or_uncond, ...); ours carry a subset with equal values, and
    what the version's _apply_model adds, ours add too."""
    (args_a, kw_a, _), (args_b, kw_b, _) = ours, theirs
    assert len(args_a) == len(args_b) == 2
    for a, b in zip(args_a, args_b, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    keys = set(kw_a) - {"transformer_options"}
    assert keys == set(kw_b) - {"transformer_options"}
    for key in keys:
        a, b = kw_a[key], kw_b[key]
        if torch.is_tensor(a):
            assert a.dtype == b.dtype and torch.equal(a, b), key
        else:
            assert a == b, key
    options_a, options_b = kw_a["transformer_options"], kw_b["transformer_options"]
    assert set(options_a) <= set(options_b), sorted(set(options_a) - set(options_b))
    for key, a in options_a.items():
        b = options_b[key]
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b, key
    for key in APPLY_MODEL_OPTIONS:
        assert (key in options_a) == (key in options_b), key


def embedding(clip, text):
    return bridge.text_encoder(clip)[0](text)["context"]


def random_lora(model, arch_name, seed=0, rank=4):
    """Nonzero LoRA weights on the arch's default targets."""
    rng = np.random.default_rng(seed)
    from kiln_pack.trainer.lora.targets import select_targets as from_targets

    layers = {n: m for n, m in bridge.diffusion_model(model).named_modules() if isinstance(m, torch.nn.Linear)}
    paths = from_targets(list(layers), list(archs.get_arch(arch_name).default_targets))
    return {
        p: LoraWeights(
            A=rng.standard_normal((rank, layers[p].in_features)).astype(np.float32) * 0.1,
            B=rng.standard_normal((layers[p].out_features, rank)).astype(np.float32) * 0.1,
            alpha=float(rank),
        )
        for p in paths
    }


def small_config(arch_name, **overrides):
    values = dict(
        arch=arch_name,
        device="cpu",
        mixed_precision="no",
        steps=3,
        batch_size=2,
        rank=4,
        alpha=4.0,
        learning_rate=1e-3,
        checkpoint_every=0,
        keep_checkpoints=1,
        log_every=1,
        resolutions=[64],
        caption_dropout=0.0,
        gradient_checkpointing=True,
        seed=3,
    )
    values.update(overrides)
    return config.from_dict(values)
