"""The image DiT families ComfyUI ships — Chroma, Lumina 2, SD 3.5, HiDream, HunyuanImage 2.1 — on tiny models built
with ComfyUI's own classes (tests/helpers/tiny_families.py), in whichever tree runs the tests:

  - ComfyUI's detection (from a tiny file where ComfyUI detects one, else supported_models.X(unet_config)) and
    the arch Kiln trains it as: `chroma` and `lumina2` have arch files, the others train through `generic`;
    Lumina 2 and Z-Image (one NextDiT class) never take each other's models;
  - training steps through the bridge learn (finite loss, LoRA B nonzero) and leave the model bitwise as it was;
  - the saved LoRA loads through ComfyUI's LoRA loader with zero unmatched keys and changes the model's output;
  - for the arch files: the training forward is bitwise the call ComfyUI's sampler makes, a batch of captions
    of different lengths runs one call per length, the shift is ComfyUI's schedule, the text encoder type and
    sampler names exist, the diffusers names round-trip.
SD 3.5 and HiDream take conds beyond the cross-attention tensor (pooled CLIP output; HiDream also Llama 3.1's
layers): the tests on tiny_families' models hand them to the bridge as extras; the last tests encode them with
tiny SD 3.5 and HiDream text encoders (tests/helpers/tiny_pooled.py) through Encode Captions → Train LoRA, the
caption cache keeping them and the training forward bitwise the sampler's call with them, and a cache without
them refused by name.
"""

from __future__ import annotations

from helpers import comfy_env
import numpy as np
import pytest

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()  # skips this whole module without COMFYUI_PATH

import comfy.model_management as mm  # noqa: E402
import comfy.supported_models  # noqa: E402
from helpers import node_runs  # noqa: E402
from helpers import tiny_comfy as tc  # noqa: E402
from helpers import tiny_families as tf  # noqa: E402
from helpers import tiny_pooled as tp  # noqa: E402
import torch  # noqa: E402
from helpers.bridge_calls import Calls, comfy_sampling_calls, our_call, same_call, small_config  # noqa: E402

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.trainer.archs as archs
import kiln_pack.trainer.data as data_module
import kiln_pack.trainer.lora.files as lf
import kiln_pack.trainer.run.loop as loop
from kiln_pack.trainer.data import text_conds
from kiln_pack.trainer.lora.targets import select_targets

ARCH_FILES = [name for name, family in tf.FAMILIES.items() if family.arch != "generic"]


def _built(name, tmp_path_factory):
    family = tf.FAMILIES[name]
    if not hasattr(comfy.supported_models, family.config_class):
        pytest.skip(f"this ComfyUI has no supported_models.{family.config_class}")
    return family, family.build(tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module", params=list(tf.FAMILIES))
def family(request, tmp_path_factory):
    return _built(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=ARCH_FILES)
def arch_family(request, tmp_path_factory):
    return _built(request.param, tmp_path_factory)


def targets(family, model) -> list[str]:
    """The module paths a LoRA trains: the arch's defaults, or the generic family's patterns."""
    layers = [n for n, m in bridge.diffusion_model(model).named_modules() if isinstance(m, torch.nn.Linear)]
    patterns = family.targets or archs.get_arch(family.arch).default_targets
    return select_targets(layers, list(patterns))


def caption(tokens: int, seed: int) -> np.ndarray:
    """One prompt's embedding [T, D] as the family's text encoder gives it (unpadded, no zero rows)."""
    return np.random.default_rng(seed).standard_normal((tokens, tf.CONTEXT_DIM)).astype(np.float32)


def forward_with_conds(family, model, arch_name):
    """The bridge's forward, with the family's other conds (pooled output, ...) handed in as extras."""
    forward = bridge.make_forward(model, arch_name)
    return lambda dm, x, sigmas, context, extras: forward(
        dm, x, sigmas, context, {**family.extra_conds(len(x)), **extras}
    )


def probe(family, model, arch_name):
    x, sigma = torch.from_numpy(latent(family, 0)[None]), torch.tensor([0.6])
    with torch.inference_mode():
        return forward_with_conds(family, model, arch_name)(
            bridge.diffusion_model(model), x, sigma, torch.from_numpy(caption(5, 5)[None]), {}
        )


def latent(family, seed: int) -> np.ndarray:
    channels, _ = family.latent
    return np.random.default_rng(seed).standard_normal((channels, 4, 4)).astype(np.float32)


def test_detected_as_its_arch(family):
    fam, model = family
    assert type(model.model.model_config).__name__ == fam.config_class
    assert bridge.detect_arch(model) == fam.arch
    assert bridge.matching_archs(model) == ([] if fam.arch == "generic" else [fam.arch])


def test_lumina2_and_zimage_keep_to_their_own_models(tmp_path_factory):
    _, lumina = _built("lumina2", tmp_path_factory)
    zimage = tc.tiny_zimage()
    assert bridge.matching_archs(lumina) == ["lumina2"]
    assert bridge.matching_archs(zimage) == ["zimage_turbo", "zimage"]
    assert bridge.detect_arch(zimage) == "zimage" and bridge.detect_arch(lumina, adapter=True) == "lumina2"


def test_training_steps_learn_and_leave_model_unchanged(family, tmp_path):
    fam, model = family
    latents = [bridge.latents_in(model, latent(fam, i)) for i in range(3)]
    data = data_module.InMemoryData.from_arrays(
        latents, [caption(n, n) for n in (4, 9, 4)], [f"img{i}.png" for i in range(3)], caption(1, 99)
    )
    weights = {k: v.clone() for k, v in bridge.diffusion_model(model).state_dict().items()}
    before = probe(fam, model, fam.arch)
    config = small_config(fam.arch, steps=2, **({"targets": list(fam.targets)} if fam.targets else {}))
    with bridge.training_session(model) as (dm, _device):
        result = loop.train(
            config, dm, data, run_dir=tmp_path / "run", forward=forward_with_conds(fam, model, fam.arch)
        )
    assert len(result.history.loss) == 2 and all(0 < loss < 50 for loss in result.history.loss)
    assert sorted(result.lora) == sorted(targets(fam, model)) and result.lora
    assert any(np.abs(w.B).max() > 0 for w in result.lora.values())
    after = bridge.diffusion_model(model).state_dict()
    assert all(torch.equal(after[k], v) for k, v in weights.items())
    assert torch.equal(probe(fam, model, fam.arch), before)


def random_lora(family, model, seed=0, rank=4):
    rng = np.random.default_rng(seed)
    layers = dict(bridge.diffusion_model(model).named_modules())
    return {
        path: lf.LoraWeights(
            A=rng.standard_normal((rank, layers[path].in_features)).astype(np.float32) * 0.1,
            B=rng.standard_normal((layers[path].out_features, rank)).astype(np.float32) * 0.1,
            alpha=float(rank),
        )
        for path in targets(family, model)
    }


@pytest.mark.parametrize("fmt", ["comfy", "kohya"])
def test_saved_lora_loads_through_comfy_with_no_unmatched_key(family, tmp_path, fmt):
    fam, model = family
    path = tmp_path / f"{fam.name}.safetensors"
    metadata = lf.build_metadata(arch_name=fam.arch, config={}, steps=1, trigger_words=[], title=fam.name)
    lf.save_lora(path, random_lora(fam, model), arch=fam.arch, fmt=fmt, metadata=metadata)
    tensors = bridge.load_lora_file(path)
    assert bridge.unmatched_lora_keys(model, tensors) == []
    plain = probe(fam, model, fam.arch)
    mm.load_models_gpu([bridge.apply_lora(model, tensors, 1.0)], force_full_load=True)  # W + ΔW merged
    merged = probe(fam, model, fam.arch)
    mm.load_models_gpu([model], force_full_load=True)
    assert not torch.allclose(merged, plain, atol=1e-4)
    assert torch.equal(probe(fam, model, fam.arch), plain)


# ---------------------------------------------------------------- the arch files (Chroma, Lumina 2)


def cond(embedding: np.ndarray):
    """CONDITIONING as CLIPTextEncode gives one prompt of these encoders (unpadded, no pooled output; ComfyUI
    0.17's Flux.encode_adm reads the key)."""
    return [[torch.from_numpy(embedding)[None], {"pooled_output": None}]]


def test_forward_equals_comfy_sampling_per_caption(arch_family):
    fam, model = arch_family
    channels, _ = fam.latent
    embs = [caption(5, 0), caption(11, 1)]
    theirs = [comfy_sampling_calls(model, cond(e), (1, channels, 4, 4), seed=i) for i, e in enumerate(embs)]
    for run, emb in zip(theirs, embs, strict=True):
        args, _kwargs, output = run[0]
        ours, calls = our_call(model, fam.arch, args[0], args[1], [emb])
        same_call(calls[0], run[0])
        assert torch.equal(ours, output)
    # A batch of both (different lengths, different sigmas): one call per length, each row as ComfyUI computes it.
    x = torch.cat([theirs[0][0][0][0], theirs[1][1][0][0]])
    sigmas = torch.cat([theirs[0][0][0][1], theirs[1][1][0][1]])
    ours, calls = our_call(model, fam.arch, x, sigmas, embs)
    assert len(calls) == 2
    torch.testing.assert_close(ours[0:1], theirs[0][0][2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1:2], theirs[1][1][2], rtol=1e-5, atol=1e-5)


def test_shift_text_encoder_and_sampling_are_comfys(arch_family):
    import comfy.samplers
    import comfy.sd

    fam, model = arch_family
    arch = archs.get_arch(fam.arch)
    assert hasattr(comfy.sd.CLIPType, arch.clip_type)  # what headless training loads the encoder as
    assert arch.sampling.sampler in comfy.samplers.KSampler.SAMPLERS
    assert arch.sampling.scheduler in comfy.samplers.KSampler.SCHEDULERS
    t = torch.tensor([0.1, 0.3, 0.7])  # the static shift is the σ schedule ComfyUI samples this model with
    sigmas = model.get_model_object("model_sampling").sigma(t)
    torch.testing.assert_close(sigmas, arch.shift * t / (1 + (arch.shift - 1) * t), rtol=1e-5, atol=1e-6)
    channels, downscale = fam.latent
    assert (arch.latent_channels, arch.latent_downscale) == (channels, downscale)
    assert all(hasattr(bridge.diffusion_model(model), name) for name in arch.block_lists)


def test_diffusers_names_round_trip(arch_family):
    fam, model = arch_family
    arch = archs.get_arch(fam.arch)
    # Unsplit layers only: the fused ones split by the full-size model's head layout.
    lora = {p: w for p, w in random_lora(fam, model).items() if not any(r.split_sizes for r in _rules(arch, p))}
    tensors = lf.to_tensors(lora, "diffusers", fam.arch)
    assert len(tensors) >= 2 * len(lora) and all(k.startswith("transformer.") for k in tensors)
    back, found = lf.from_tensors(tensors, arch=fam.arch)
    assert found == "diffusers" and sorted(back) == sorted(lora)
    for path, weights in lora.items():
        assert np.array_equal(back[path].A, weights.A) and np.array_equal(back[path].B, weights.B)  # alpha = rank


def _rules(arch, path):
    import re

    return [rule for rule in arch.diffusers_rules if re.fullmatch(rule.comfy, path)]


# ---------------------------------------------------------------- conditioning beside the embedding, through the nodes

POOLED = {  # family → (tiny model, tiny text encoder, the conditioning its extra_conds reads beside the embedding)
    "sd35": (tp.sd35, tp.tiny_sd3_clip, ("pooled_output",)),
    "hidream": (tp.hidream, tp.tiny_hidream_clip, ("pooled_output", "conditioning_llama3")),
}


@pytest.fixture(scope="module", params=list(POOLED))
def pooled(request, tmp_path_factory, comfy_dirs):
    family = tf.FAMILIES[request.param]
    if not hasattr(comfy.supported_models, family.config_class):
        pytest.skip(f"this ComfyUI has no supported_models.{family.config_class}")
    build, make_clip, names = POOLED[request.param]
    model, clip = build(tmp_path_factory.mktemp(request.param)), make_clip()
    ds = node_runs.encoded_dataset(comfy_dirs, tc.tiny_vae(flux2=False), clip, f"ds_pooled_{request.param}")
    return family, model, clip, ds, names


def test_encode_captions_caches_the_conditioning_comfy_gives(pooled):
    _fam, _model, clip, ds, names = pooled
    data = ds.training_data()
    conds = data.conds(0)
    assert sorted(conds) == sorted(names) and sorted(data.empty_conds()) == sorted(names)
    _, theirs = tc.conditioning(clip, data.caption(0))[0]
    for name in names:  # CLIPTextEncode's tensor without its batch axis, as the cache's bf16 holds it
        np.testing.assert_array_equal(conds[name], theirs[name][0].to(torch.bfloat16).float().numpy())
    # An encoder that gives such conditioning has another identity than one of the embedding alone: caption
    # caches written before Kiln kept it are never read, they are encoded again.
    assert ds.text_identity != bridge.text_encoder(tc.tiny_zimage_clip())[1]


def test_forward_with_cached_conditioning_equals_comfy_sampling(pooled):
    _fam, model, _clip, ds, _names = pooled
    data = ds.training_data()
    context, conds = data.context(0), data.conds(0)
    cond = [[torch.from_numpy(context)[None], {k: torch.from_numpy(v)[None] for k, v in conds.items()}]]
    theirs = comfy_sampling_calls(model, cond, (1, 16, 4, 4))
    args, kwargs, output = theirs[0]
    assert kwargs["y"] is not None  # the pooled vector reaches the model as ComfyUI's `y`
    extras = {k: torch.from_numpy(v) for k, v in text_conds.stacked([conds], ["img0"]).items()}
    forward, dm = bridge.make_forward(model, "generic"), bridge.diffusion_model(model)
    with Calls(dm) as calls, torch.inference_mode():
        sigma = kwargs["transformer_options"]["sigmas"]  # the model's timestep is σ·1000 for these two
        ours = forward(dm, args[0], sigma, torch.from_numpy(context[None]), extras)
    same_call(calls[0], theirs[0])
    assert torch.equal(ours, output)


def test_train_lora_node_feeds_the_cached_conditioning(pooled, comfy_dirs):
    fam, model, _clip, ds, names = pooled
    dm = bridge.diffusion_model(model)
    with Calls(dm) as calls:
        result = node_runs.train(model, ds, steps=2, options={"targets": list(fam.targets), "run_name": fam.name})
    _trained, lora, state, loss_map, _images = result.result
    assert state.step == 2 and all(np.isfinite(loss_map["loss"]))
    assert any(np.abs(w.B).max() > 0 for w in bridge.lora_weights_from(lora).values())
    y = calls[0][1]["y"]  # each training call carries the pooled vector, one row per caption
    assert y is not None and y.shape == (calls[0][0][0].shape[0], tp.POOLED)
    if "conditioning_llama3" in names:
        llama = calls[0][1]["encoder_hidden_states_llama3"]  # [B, layers, tokens, width]
        assert llama.shape[0] == y.shape[0] and llama.shape[1] == tp.LLAMA_LAYERS


def test_train_lora_refuses_a_cache_without_the_conditioning(pooled, comfy_dirs):
    fam, model, _clip, _ds, names = pooled
    plain = node_runs.encoded_dataset(comfy_dirs, tc.tiny_vae(flux2=False), tc.tiny_zimage_clip(), f"plain_{fam.name}")
    with pytest.raises(ValueError, match=f"{names[0]}.*Encode Captions") as error:
        node_runs.train(model, plain, steps=1, options={"targets": list(fam.targets), "run_name": f"no_{fam.name}"})
    assert {"sd35": "SD 3.5", "hidream": "HiDream"}[fam.name] in str(error.value)
