"""nodes/comfy/ against a real ComfyUI (COMFYUI_PATH) on tiny seeded models; skipped without one.

What is checked: arch detection from ComfyUI's own model classes; that the training forward hands
the diffusion model exactly what ComfyUI's sampler hands it for the same prompt (bitwise), also for
a Z-Image batch of captions of different lengths; a few real training steps through trainer.run.loop
inside a training session leave the model bitwise as it was; the LORA_MODEL we emit loads through
ComfyUI's own LoRA loader with every key matched and equals our LoRA side branches; the training
adapter merge is undone by loading the plain model; validation sampling; VAE/CLIP encoders;
progress, interrupts, LOSS_MAP, folders.
"""

from __future__ import annotations

import contextlib

from helpers import comfy_env
import numpy as np
import pytest

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()  # skips this whole module without COMFYUI_PATH

import comfy.model_management as mm  # noqa: E402
import comfy.sample  # noqa: E402
import node_helpers  # noqa: E402
from helpers import tiny_comfy as tc  # noqa: E402
import torch  # noqa: E402

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.trainer.archs as archs
import kiln_pack.trainer.data as data_module
import kiln_pack.trainer.run.loop as loop
from kiln_pack.trainer.backends.torch_backend.backend import TorchBackend
import kiln_pack.nodes.comfy.session as bridge_session
from helpers.bridge_calls import comfy_sampling_calls, embedding, our_call, random_lora, same_call, small_config


# ---------------------------------------------------------------- fixtures (built once)


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    return tc.tiny_flux2(tmp_path_factory.mktemp("klein"))


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    return tc.tiny_flux2(tmp_path_factory.mktemp("dev"), dev=True, seed=1)


@pytest.fixture(scope="module")
def zimage():
    return tc.tiny_zimage()


@pytest.fixture(scope="module")
def klein_clip():
    return tc.tiny_klein_clip()


@pytest.fixture(scope="module")
def zimage_clip():
    return tc.tiny_zimage_clip()


@pytest.fixture(scope="module")
def flux2_vae():
    return tc.tiny_vae(flux2=True)


@pytest.fixture(scope="module")
def flux_vae():
    return tc.tiny_vae(flux2=False)


# ---------------------------------------------------------------- helpers


def model_output(model, arch_name, x, sigma, emb):
    return our_call(model, arch_name, x, sigma, [emb])[0]


# ---------------------------------------------------------------- detection


def test_detect_arch(klein, dev, zimage):
    assert bridge.detect_arch(klein) == "flux2_klein"
    assert bridge.detect_arch(dev) == "flux2_dev"
    assert bridge.detect_arch(zimage) == "zimage"
    assert bridge.detect_arch(zimage, adapter=True) == "zimage_turbo"  # Turbo: the model with an adapter
    assert bridge.detect_arch(klein, adapter=True) == "flux2_klein"  # no Flux2 arch merges one
    assert bridge.matching_archs(zimage) == ["zimage_turbo", "zimage"]
    assert bridge.matching_archs(klein) == ["flux2_klein"] and bridge.matching_archs(dev) == ["flux2_dev"]
    for name in ("flux2_klein", "flux2_dev", "zimage", "zimage_turbo", "qwen_image", "generic"):
        assert name in archs.ARCHS
    assert isinstance(bridge.diffusion_model(klein), torch.nn.Module)


# ---------------------------------------------------------------- the forward is ComfyUI's own call


@pytest.mark.parametrize("which", ["klein", "dev"])
def test_flux2_forward_equals_comfy_sampling(which, klein, dev, klein_clip):
    model, name = (klein, "flux2_klein") if which == "klein" else (dev, "flux2_dev")
    cond = tc.conditioning(klein_clip, "a red fox in the snow")
    if name == "flux2_dev":  # what FluxGuidance does; the arch trains Dev at guidance 1.0
        cond = node_helpers.conditioning_set_values(cond, {"guidance": 1.0})
    emb = embedding(klein_clip, "a red fox in the snow")
    assert emb.shape == (512, tc.FLUX2_CONTEXT_DIM)  # Klein pads every prompt to 512 tokens
    steps = 2 if name == "flux2_klein" else 1  # Klein's 512 tokens make each call slow on a CPU
    theirs = comfy_sampling_calls(model, cond, (1, 128, 2, 3), steps=steps)
    assert len(theirs) == steps
    for args, _, output in theirs:
        ours, calls = our_call(model, name, args[0], args[1], [emb])
        same_call(calls[0], (args, _, output))
        assert torch.equal(ours, output)


def test_zimage_forward_equals_comfy_sampling_per_caption(zimage, zimage_clip):
    texts = ["a cat", "a small watercolour painting of a lighthouse on a cliff at dawn"]
    embs = [embedding(zimage_clip, t) for t in texts]
    assert embs[0].shape[0] != embs[1].shape[0]
    theirs = [
        comfy_sampling_calls(zimage, tc.conditioning(zimage_clip, t), (1, 16, 4, 4), seed=i)
        for i, t in enumerate(texts)
    ]
    # One caption: bitwise the call ComfyUI makes (num_tokens = caption length, no mask).
    for run, emb in zip(theirs, embs, strict=True):
        args, kwargs, output = run[0]
        assert kwargs["num_tokens"] == emb.shape[0] and "attention_mask" not in kwargs
        ours, calls = our_call(zimage, "zimage", args[0], args[1], [emb])
        same_call(calls[0], run[0])
        assert torch.equal(ours, output)
        generic, calls = our_call(zimage, "generic", args[0], args[1], [emb])  # extra_conds alone
        same_call(calls[0], run[0])
        assert torch.equal(generic, output)
    # A batch of both (different lengths, different sigmas): each row as ComfyUI computes it alone.
    x = torch.cat([theirs[0][0][0][0], theirs[1][1][0][0]])
    sigmas = torch.cat([theirs[0][0][0][1], theirs[1][1][0][1]])
    ours, calls = our_call(zimage, "zimage", x, sigmas, embs)
    assert len(calls) == 2  # one call per caption length, each trimmed to its own tokens
    torch.testing.assert_close(ours[0:1], theirs[0][0][2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1:2], theirs[1][1][2], rtol=1e-5, atol=1e-5)


def test_timestep_and_velocity_convention(klein, zimage):
    for model in (klein, zimage):
        sampling = model.get_model_object("model_sampling")
        sigma = torch.tensor([0.25, 0.8])
        assert torch.equal(sampling.timestep(sigma), sigma)  # multiplier 1: the model gets sigma
        x, v = torch.randn(2, 3, 2, 2), torch.randn(2, 3, 2, 2)
        denoised = sampling.calculate_denoised(sigma, v, x)
        torch.testing.assert_close(denoised, x - sigma.view(-1, 1, 1, 1) * v)  # x0 = x_t - sigma * v


# ---------------------------------------------------------------- training in a session


def training_data(model, vae, clip, texts, size):
    encode_image, _ = bridge.vae_encoder(vae)
    encode, _ = bridge.text_encoder(clip)
    encode_text = lambda text: encode(text)["context"]  # these encoders give no other conditioning
    rng = np.random.default_rng(0)
    pixels = rng.random((len(texts), size, size, 3), dtype=np.float32)
    latents = bridge.latents_in(model, encode_image(pixels))
    return data_module.InMemoryData.from_arrays(
        list(latents), [encode_text(t) for t in texts], [f"img{i}.png" for i in range(len(texts))], encode_text("")
    )


@pytest.mark.parametrize("which", ["klein", "zimage"])
def test_training_steps_leave_model_unchanged(
    which, tmp_path, klein, zimage, klein_clip, zimage_clip, flux2_vae, flux_vae
):
    model, arch_name, vae, clip = (
        (klein, "flux2_klein", flux2_vae, klein_clip) if which == "klein" else (zimage, "zimage", flux_vae, zimage_clip)
    )
    texts = ["a cat", "a long caption about a dog running on a beach at sunset", "moss"]
    data = training_data(model, vae, clip, texts, 32)
    probe_x = torch.from_numpy(data.latent(0)[None])
    probe = lambda: model_output(model, arch_name, probe_x, torch.tensor([0.6]), data.context(0))  # noqa: E731
    before = probe()
    in_training, grad = mm.in_training, torch.is_grad_enabled()
    flags = [p.requires_grad for p in bridge.diffusion_model(model).parameters()]
    with bridge.training_session(model) as (dm, device):
        assert mm.in_training and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        assert device == model.load_device and dm is bridge.diffusion_model(model)
        assert not any(p.is_inference() for p in dm.parameters())
        result = loop.train(
            small_config(arch_name, steps=2),
            dm,
            data,
            run_dir=tmp_path / "run",
            forward=bridge.make_forward(model, arch_name),
        )
    assert (mm.in_training, torch.is_grad_enabled()) == (in_training, grad)
    assert len(result.history.loss) == 2 and all(np.isfinite(result.history.loss))
    assert all(0 < loss < 50 for loss in result.history.loss)
    assert any(np.abs(w.B).max() > 0 for w in result.lora.values())  # it learned something
    assert [p.requires_grad for p in bridge.diffusion_model(model).parameters()] == flags
    assert torch.equal(probe(), before)  # LoRA branches gone, weights bitwise as before


@pytest.mark.parametrize("checkpointing", [True, False])
def test_trains_on_a_comfy_quantized_fp8_base(checkpointing, tmp_path, klein, klein_clip, flux2_vae):
    """ComfyUI loads fp8-quantized checkpoints (comfy_quant weights) into its mixed-precision Linear, which is
    no torch.nn.Linear and holds comfy-kitchen QuantizedTensor weights: the LoRA targets are found all the
    same, training runs (with and without checkpointing: no storage for a saved quantized weight), the
    model comes back bitwise, and the LoRA loads on it through ComfyUI's loader with every key matched."""
    import comfy.sd

    path = tc.write_flux2_file(tmp_path / "tiny_flux2_fp8.safetensors", quantized=True)
    with torch.inference_mode():
        model = comfy.sd.load_diffusion_model(str(path))
    qkv = bridge.diffusion_model(model).double_blocks[0].img_attn.qkv
    assert not isinstance(qkv, torch.nn.Linear) and qkv.quant_format == "float8_e4m3fn"
    data = training_data(model, flux2_vae, klein_clip, ["a cat", "a dog on a long walk by the sea"], 32)
    probe_x = torch.from_numpy(data.latent(0)[None])
    probe = lambda: model_output(model, "flux2_klein", probe_x, torch.tensor([0.6]), data.context(0))  # noqa: E731
    before = probe()
    comfys = qkv._full_precision_mm
    with bridge.training_session(model) as (dm, _):
        # Kiln dequantizes for training (ComfyUI's fp8 training path was 1.25-2.1x slower on an H100)
        assert qkv._full_precision_mm is True
        result = loop.train(
            small_config("flux2_klein", steps=2, gradient_checkpointing=checkpointing),
            dm,
            data,
            run_dir=tmp_path / "run",
            forward=bridge.make_forward(model, "flux2_klein"),
        )
    assert qkv._full_precision_mm == comfys
    assert all(np.isfinite(result.history.loss)) and any(np.abs(w.B).max() > 0 for w in result.lora.values())
    assert set(result.lora) == set(random_lora(klein, "flux2_klein"))  # the same targets as a bf16/fp32 file
    assert torch.equal(probe(), before)
    assert bridge.unmatched_lora_keys(model, bridge.lora_model_from(result.lora, "flux2_klein")) == []


def test_a_quantized_base_loads_again_in_a_later_prompt(tmp_path, klein_clip, flux2_vae):
    """A session in a prompt gives the training model's weights back as inference tensors, as ComfyUI's loader
    made them: ComfyUI's quantized Linear re-wraps each weight it moves, under inference mode, and refused the
    normal weights a session had left ("Cannot set version_counter for inference tensor") when a later prompt
    unloaded and loaded the trained fp8 model again."""
    import comfy.sd

    path = tc.write_flux2_file(tmp_path / "tiny_flux2_fp8.safetensors", quantized=True)
    with torch.inference_mode():
        model = comfy.sd.load_diffusion_model(str(path))
    data = training_data(model, flux2_vae, klein_clip, ["a cat", "a dog"], 32)
    probe_x = torch.from_numpy(data.latent(0)[None])
    with torch.inference_mode(), bridge.training_session(model) as (dm, _):  # the Train node, in a prompt
        assert not any(p.is_inference() for p in dm.parameters())
        loop.train(
            small_config("flux2_klein", steps=1),
            dm,
            data,
            run_dir=tmp_path / "run",
            forward=bridge.make_forward(model, "flux2_klein"),
        )
    assert all(p.is_inference() for p in bridge.diffusion_model(model).parameters())
    before = model_output(model, "flux2_klein", probe_x, torch.tensor([0.6]), data.context(0))
    with torch.inference_mode():  # a later prompt
        mm.unload_all_models()
        mm.load_models_gpu([model], force_full_load=True)
    assert torch.equal(model_output(model, "flux2_klein", probe_x, torch.tensor([0.6]), data.context(0)), before)


# ---------------------------------------------------------------- LoRAs through ComfyUI's loader


def test_lora_model_loads_through_comfy_and_matches_side_branches(klein, klein_clip):
    weights = random_lora(klein, "flux2_klein")
    lora_model = bridge.lora_model_from(weights, "flux2_klein")
    assert all(k.startswith("diffusion_model.") for k in lora_model)
    assert all(torch.is_tensor(v) and v.is_contiguous() for v in lora_model.values())
    assert bridge.unmatched_lora_keys(klein, lora_model) == []
    patched = bridge.apply_lora(klein, lora_model, 1.0)
    back = bridge.lora_weights_from(lora_model)
    assert set(back) == set(weights) and all(np.array_equal(back[k].B, weights[k].B) for k in weights)

    emb = embedding(klein_clip, "a lighthouse")
    x, sigma = torch.randn(1, 128, 2, 3, generator=torch.Generator().manual_seed(0)), torch.tensor([0.5])
    base = model_output(klein, "flux2_klein", x, sigma, emb)
    mm.load_models_gpu([patched], force_full_load=True)  # ComfyUI merges W + ΔW into the weights
    with_patches = model_output(klein, "flux2_klein", x, sigma, emb)
    mm.load_models_gpu([klein], force_full_load=True)
    assert torch.equal(model_output(klein, "flux2_klein", x, sigma, emb), base)
    assert not torch.allclose(with_patches, base, atol=1e-3)

    # The same LoRA as our trainer's side branches: equal to ComfyUI's merged weights.
    backend = TorchBackend()
    cfg = small_config("flux2_klein", rank=4, alpha=4.0)
    with bridge.training_session(klein) as (dm, _):
        backend.setup(dm, cfg, archs.get_arch("flux2_klein"), bridge.make_forward(klein, "flux2_klein"))
        try:
            backend.load_lora_state(weights)
            with torch.no_grad():
                branches = model_output(klein, "flux2_klein", x, sigma, emb)
        finally:
            backend.teardown()
    torch.testing.assert_close(branches, with_patches, rtol=1e-4, atol=1e-4)


def test_apply_lora_reports_unmatched_keys(klein):
    lora_model = bridge.lora_model_from(random_lora(klein, "flux2_klein"), "flux2_klein")
    lora_model["diffusion_model.no_such_block.lora_A.weight"] = torch.zeros(4, 8)
    lora_model["diffusion_model.no_such_block.lora_B.weight"] = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="2 of .* LoRA keys match nothing"):
        bridge.apply_lora(klein, lora_model, 1.0)
    assert bridge.unmatched_lora_keys(klein, lora_model) == [
        f"diffusion_model.no_such_block.lora_{ab}.weight" for ab in "AB"
    ]
    assert bridge.apply_lora(klein, lora_model, 1.0, strict=False) is not klein


def test_negate_lora_undoes_it(zimage, zimage_clip):
    lora_model = bridge.lora_model_from(random_lora(zimage, "zimage", seed=7), "zimage")
    emb = embedding(zimage_clip, "a dog")
    x, sigma = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(2)), torch.tensor([0.4])
    base = model_output(zimage, "zimage", x, sigma, emb)
    both = bridge.apply_lora(bridge.apply_lora(zimage, lora_model, 0.5), bridge.negate_lora(lora_model, 0.5), 1.0)
    mm.load_models_gpu([both], force_full_load=True)
    torch.testing.assert_close(model_output(zimage, "zimage", x, sigma, emb), base, rtol=1e-5, atol=1e-5)
    mm.load_models_gpu([zimage], force_full_load=True)
    assert torch.equal(model_output(zimage, "zimage", x, sigma, emb), base)
    with pytest.raises(ValueError, match="cannot negate"):
        bridge.negate_lora({"diffusion_model.x.hada_w1_a": torch.zeros(2, 2)})


def test_lora_model_through_comfy_nodes(tmp_path, klein):
    import folder_paths
    from comfy_extras import nodes_train

    lora_model = bridge.lora_model_from(random_lora(klein, "flux2_klein", seed=2), "flux2_klein")
    loaded = nodes_train.LoraModelLoader.execute(klein, lora_model, 1.0).result[0]
    assert set(loaded.patches) and loaded is not klein
    previous = folder_paths.get_output_directory()
    folder_paths.set_output_directory(str(tmp_path))
    try:
        nodes_train.SaveLoRA.execute(lora_model, "loras/kiln_test", steps=3)
    finally:
        folder_paths.set_output_directory(previous)
    saved = list((tmp_path / "loras").glob("kiln_test_3_steps_*.safetensors"))
    assert len(saved) == 1
    again = bridge.load_lora_file(saved[0])
    assert set(again) == set(lora_model) and all(torch.equal(again[k], lora_model[k]) for k in again)


def test_training_adapter_merge_then_plain_model(zimage, zimage_clip):
    adapter = bridge.lora_model_from(random_lora(zimage, "zimage", seed=5), "zimage", dtype=torch.bfloat16)
    merged = bridge.training_adapter_merged(zimage, adapter)
    emb = embedding(zimage_clip, "a cat")
    x, sigma = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0.7])
    base = model_output(zimage, "zimage", x, sigma, emb)
    with bridge.training_session(merged):
        with torch.no_grad():
            trained_on = model_output(merged, "zimage", x, sigma, emb)
    assert not torch.allclose(trained_on, base, atol=1e-3)
    mm.load_models_gpu([zimage], force_full_load=True)  # the plain model: adapter unpatched exactly
    assert torch.equal(model_output(zimage, "zimage", x, sigma, emb), base)


def test_a_streamed_run_samples_without_the_training_adapter(zimage, zimage_clip, flux_vae):
    """The training adapter merged into another clone and blocks streamed: a sample on the plain model would have
    ComfyUI re-patch the weights the stream holds in its ring. It is drawn on the training model with the adapter
    taken out by live −ΔW branches: the plain model's sample (up to the merged weights' rounding), not the
    adapter's, and the modules get their own forwards back."""
    from kiln_pack.trainer.backends.torch_backend import streaming
    from kiln_pack.trainer.backends.torch_backend.checkpointing import find_blocks

    adapter = bridge.lora_model_from(random_lora(zimage, "zimage", seed=5), "zimage", dtype=torch.bfloat16)
    merged = bridge.training_adapter_merged(zimage, adapter)
    cond = tc.conditioning(zimage_clip, "a cat")
    sample = bridge.Sample(cond, cond, flux_vae, 1, 1, 1.0, "euler", "simple", 32, 32)
    cfg = small_config("zimage")
    drawn = lambda on: on(1)[0]  # noqa: E731
    plain = drawn(bridge.validation(cfg, zimage, [sample], lambda *a: None))
    with bridge.training_session(merged) as (dm, _device):
        with_adapter = drawn(bridge.validation(cfg, merged, [sample], lambda *a: None))
        blocks = find_blocks(dm, archs.get_arch("zimage").block_lists)
        stream = streaming.for_blocks(blocks, [0, len(blocks) - 1], "cpu")
        stream.hook()
        try:
            assert streaming.streams(dm)
            validate = bridge.validation(cfg, zimage, [sample], lambda *a: None)
            got = [drawn(validate) for _ in range(2)]
        finally:
            stream.remove()
        assert not streaming.streams(dm)
        assert not any("forward" in m.__dict__ for m in dm.modules())
    assert np.abs(with_adapter - plain).max() > 1e-3  # the adapter changes the sample
    for image in got:
        np.testing.assert_allclose(image, plain, atol=2e-3)
        assert np.abs(image - plain).max() < np.abs(with_adapter - plain).max() / 4


# ---------------------------------------------------------------- sampling, encoders, plumbing


def test_sample_returns_image_with_lora_installed(klein, klein_clip, flux2_vae):
    cond = tc.conditioning(klein_clip, "a cat")
    backend = TorchBackend()
    with bridge.training_session(klein) as (dm, _):
        backend.setup(dm, small_config("flux2_klein"), archs.get_arch("flux2_klein"))
        try:
            backend.load_lora_state(random_lora(klein, "flux2_klein", rank=4))
            image = bridge.sample(
                klein,
                cond,
                cond,
                flux2_vae,
                seed=1,
                steps=2,
                cfg=1.0,
                sampler_name="euler",
                scheduler="simple",
                width=48,
                height=32,
            )  # reloads the session's model after
            assert mm.in_training  # restored after sampling
            assert not any(p.is_inference() for p in dm.parameters())
        finally:
            backend.teardown()
    assert image.shape == (1, 32, 48, 3) and torch.isfinite(image).all()
    assert 0.0 <= image.min() and image.max() <= 1.0


def _prompt_model():
    """A small model as a prompt leaves it: built and loaded by ComfyUI's model management under inference
    mode (a VAE's or a text encoder's place in ComfyUI's loaded models)."""
    import comfy.model_patcher

    with torch.inference_mode():
        module = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.GroupNorm(2, 8))
        patcher = comfy.model_patcher.ModelPatcher(
            module, load_device=torch.device("cpu"), offload_device=torch.device("cpu")
        )
        mm.load_models_gpu([patcher])
    return patcher, module


def _moved_outside_inference_mode(module):
    """What ComfyUI's eviction or load does to a prompt's module while a session has inference mode off,
    a device move (Module._apply) run on the CPU."""
    module._apply(lambda t: t.clone())


def _usable_in_a_prompt(module) -> bool:
    with torch.inference_mode():
        try:
            for p in module.parameters():
                torch.mm(p.reshape(p.shape[0], -1), p.reshape(p.shape[0], -1).t())  # reads the version, as a view does
            return all(p.is_inference() for p in module.parameters())
        except RuntimeError:
            return False


def test_a_session_mends_the_prompt_models_comfy_moved(klein, klein_clip, flux2_vae):
    """ComfyUI moves the other models of the prompt when a session loads its model (evicting them) and when a
    validation sample loads the sampler's model and the VAE, all with inference mode off. Moved so, a prompt's
    weights keep Parameters without a version counter, and a later prompt's VAE Decode failed on them (ComfyUI
    0.33, H100). The session mends them back to inference tensors after each; the training model keeps its normal
    weights, and the other prompt model its values."""
    patcher, module = _prompt_model()
    values = [p.detach().clone() for p in module.parameters()]
    _moved_outside_inference_mode(module)
    assert not _usable_in_a_prompt(module)  # the trap (below) as a session leaves it, unmended
    cond = tc.conditioning(klein_clip, "a cat")
    backend = TorchBackend()
    with bridge.training_session(klein) as (dm, _):
        assert _usable_in_a_prompt(module)  # mended after the session's load
        assert not any(bridge_session._inference(p) for p in dm.parameters())
        backend.setup(dm, small_config("flux2_klein"), archs.get_arch("flux2_klein"))
        try:
            mm.load_models_gpu([patcher])  # still one of ComfyUI's loaded models
            _moved_outside_inference_mode(module)
            bridge.sample(
                klein,
                cond,
                cond,
                flux2_vae,
                seed=1,
                steps=1,
                cfg=1.0,
                sampler_name="euler",
                scheduler="simple",
                width=32,
                height=32,
            )
            assert _usable_in_a_prompt(module)  # mended after the validation sample
            assert not any(bridge_session._inference(p) for p in dm.parameters())  # the training model untouched
        finally:
            backend.teardown()
    assert all(torch.equal(p, v) for p, v in zip(module.parameters(), values))
    assert all(p.requires_grad for p in module.parameters())  # as the module made them


def test_the_training_model_stays_loaded_while_a_sample_is_taken(klein):
    """A sample's loads ask ComfyUI to free memory (the VAE's); unloading the training model then would move weights
    Kiln placed (a streamed block's point into its GPU ring) and cost a whole reload. Inside sampling() ComfyUI's
    free_memory keeps it; outside, the same call unloads it (the control)."""
    loaded = lambda: any(entry.model is klein for entry in mm.current_loaded_models)  # noqa: E731
    with bridge.training_session(klein) as (_dm, device):
        assert loaded()
        mm.free_memory(1e30, device)
        assert not loaded()  # the control: free_memory unloads what it may
        bridge_session.reload_for_training(klein)
        with bridge_session.sampling():
            mm.free_memory(1e30, device)
            assert loaded()
        assert mm.free_memory is bridge_session._FREE_MEMORY  # ComfyUI's own again


def test_a_prompts_weights_moved_outside_inference_mode_lose_their_version():
    """The trap behind the test above, in torch alone: a module built in a prompt (inference mode) and moved
    outside it keeps its Parameter objects with `.data` swapped (Module._apply): they say they are not
    inference tensors but have no version counter, and ops that read it fail, even back in inference mode.
    Moved inside inference mode, they stay inference tensors, which every op in a prompt accepts."""
    with torch.inference_mode():
        outside, inside = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    outside.to(torch.float64)
    with torch.inference_mode():
        inside.to(torch.float64)
    assert not outside.weight.is_inference() and bridge_session._inference(outside.weight)
    with pytest.raises(RuntimeError, match="version counter"), torch.inference_mode():
        torch.mm(outside.weight.view(4, 4), outside.weight.t())
    with torch.inference_mode():
        assert inside.weight.is_inference()
        assert torch.mm(inside.weight.view(4, 4), inside.weight.t()).shape == (4, 4)


@contextlib.contextmanager
def fused_rope_calls():
    """Names of the comfy-kitchen RoPE kernels called in the block: the path ComfyUI's sampler takes
    with in_training off (0.33: Flux apply_rope, Z-Image's fused rms_rope; 0.17: Flux apply_rope1 via the
    alias flux/math.py binds at import). Training takes ComfyUI's autograd-safe path instead."""
    import comfy.ldm.flux.math as flux_math
    import comfy.quant_ops

    kitchen = getattr(comfy.quant_ops, "ck", None)
    targets = [
        (kitchen, name)
        for name in ("apply_rope", "apply_rope1", "rms_rope", "rms_rope1")
        if kitchen is not None and hasattr(kitchen, name)
    ]
    targets += [(flux_math, name) for name in ("q_apply_rope", "q_apply_rope1") if hasattr(flux_math, name)]
    calls, originals = [], []
    for owner, name in targets:
        original = getattr(owner, name)
        originals.append((owner, name, original))

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(owner, name, spy)
    try:
        yield calls
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


@pytest.mark.parametrize("which", ["klein", "zimage"])
def test_validation_and_training_take_comfys_own_paths(
    which, klein, zimage, klein_clip, zimage_clip, flux2_vae, flux_vae
):
    """Validation samples inside a run are bitwise what ComfyUI's sampler draws outside it (the same fused
    kernels, in_training off); the training forward takes the path ComfyUI's own trainer takes
    (in_training on: no fused kernel, autograd-safe) and agrees with the sampler's model output."""
    model, arch_name, vae, clip, shape = (
        (klein, "flux2_klein", flux2_vae, klein_clip, (1, 128, 2, 3))
        if which == "klein"
        else (zimage, "zimage", flux_vae, zimage_clip, (1, 16, 4, 6))
    )
    cond, emb = tc.conditioning(clip, "a cat on a roof"), embedding(clip, "a cat on a roof")
    settings = dict(seed=1, steps=2, cfg=1.0, sampler_name="euler", scheduler="simple", width=48, height=32)
    with fused_rope_calls() as sampler_kernels, torch.inference_mode():  # ComfyUI's KSampler + VAE Decode
        fmt = model.get_model_object("latent_format")
        down = getattr(fmt, "spacial_downscale_ratio", 8)
        latent = comfy.sample.fix_empty_latent_channels(
            model, torch.zeros([1, fmt.latent_channels, 32 // down, 48 // down])
        )
        samples = comfy.sample.sample(
            model,
            comfy.sample.prepare_noise(latent, 1),
            2,
            1.0,
            "euler",
            "simple",
            cond,
            cond,
            latent,
            denoise=1.0,
            disable_pbar=True,
            seed=1,
        )
        reference = vae.decode(samples)
    theirs = comfy_sampling_calls(model, cond, shape)[0]
    with bridge.training_session(model) as (dm, _):
        with fused_rope_calls() as validation_kernels:
            image = bridge.sample(model, cond, cond, vae, **settings)
        with fused_rope_calls() as training_kernels:
            ours, calls = our_call(model, arch_name, theirs[0][0], theirs[0][1], [emb], grad=True)
    assert torch.equal(image, reference.reshape(-1, *reference.shape[-3:])[..., :3])
    assert validation_kernels == sampler_kernels
    if which == "klein" or comfy_env.at_least("0.33"):
        assert sampler_kernels, "ComfyUI's sampler took no comfy-kitchen RoPE kernel"
    assert training_kernels == [] and ours.requires_grad
    same_call(calls[0], theirs)
    torch.testing.assert_close(ours.detach(), theirs[2], rtol=1e-5, atol=1e-5)


def test_a_session_calls_sdpa_without_comfys_kernel_order(klein, klein_clip, flux2_vae, monkeypatch):
    """From 0.2x ComfyUI runs every SDPA call on CUDA inside its own kernel order (flash first). In training
    that overrode Kiln's `attention` choice, and on an H100 with 0.33 a checkpointed Z-Image block's forward
    and its recompute ran different kernels (CheckpointError; bench/RESULTS.md). A session calls SDPA without
    it, sampling inside the session calls ComfyUI's own, and afterwards ComfyUI's is back. (On a CPU ComfyUI
    picks sub-quadratic attention, so the entry point is checked here, and the plain call's numbers.)"""
    import comfy.ops

    import kiln_pack.nodes.comfy.paths as comfy_paths

    seen = []

    def comfys(q, k, v, *args, **kwargs):
        seen.append(comfy.ops.scaled_dot_product_attention)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, *args, **kwargs)

    monkeypatch.setattr(comfy.ops, "scaled_dot_product_attention", comfys)
    monkeypatch.setattr(comfy_paths, "_COMFY_SDPA", comfys)
    sampled = []
    monkeypatch.setattr(
        comfy.sample,
        "sample",
        lambda *a, **k: (sampled.append(comfy.ops.scaled_dot_product_attention), torch.zeros(1, 128, 2, 3))[1],
    )
    with bridge.training_session(klein):
        assert comfy.ops.scaled_dot_product_attention is comfy_paths._training_sdpa
        cond = tc.conditioning(klein_clip, "a cat")
        bridge.sample(
            klein,
            cond,
            cond,
            flux2_vae,
            seed=0,
            steps=1,
            cfg=1.0,
            sampler_name="euler",
            scheduler="simple",
            width=48,
            height=32,
        )
        assert sampled == [comfys] and comfy.ops.scaled_dot_product_attention is comfy_paths._training_sdpa
    assert comfy.ops.scaled_dot_product_attention is comfys
    q, k, v = (torch.randn(1, 4, 16, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    assert torch.equal(comfy_paths._training_sdpa(q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v))
    if hasattr(comfy.ops, "repeat_kv_for_gqa"):  # grouped-query attention with a mask, expanded as ComfyUI does
        mask = torch.zeros(1, 1, 16, 16)
        got = comfy_paths._training_sdpa(q, k[:, :2], v[:, :2], attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(
            got,
            torch.nn.functional.scaled_dot_product_attention(
                q, k[:, :2].repeat_interleave(2, 1), v[:, :2].repeat_interleave(2, 1), attn_mask=mask
            ),
        )


def test_vae_encoder(flux2_vae, flux_vae, zimage, klein):
    pixels = np.random.default_rng(0).random((2, 32, 48, 3), dtype=np.float32)
    encode, identity = bridge.vae_encoder(flux2_vae)
    latents = encode(pixels)
    with torch.inference_mode():
        expected = flux2_vae.encode(torch.from_numpy(pixels)).float().numpy()
    assert latents.dtype == np.float32 and latents.shape == (2, 128, 2, 3)
    np.testing.assert_array_equal(latents, expected)
    assert identity == bridge.vae_encoder(flux2_vae)[1] != bridge.vae_encoder(flux_vae)[1]
    np.testing.assert_array_equal(bridge.latents_in(klein, latents), latents)  # Flux2: identity
    flux_latents = bridge.vae_encoder(flux_vae)[0](pixels)
    np.testing.assert_allclose(bridge.latents_in(zimage, flux_latents), (flux_latents - 0.1159) * 0.3611, rtol=1e-6)
    back = bridge.latents_in(zimage, bridge.latents_in(zimage, flux_latents), reverse=True)
    np.testing.assert_allclose(back, flux_latents, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="multiple of the VAE"):
        encode(pixels[:, :30])


def test_text_encoder(klein_clip, zimage_clip):
    encode, identity = bridge.text_encoder(zimage_clip)
    encoded = encode("a photo of a cat")
    assert list(encoded) == ["context"]  # no pooled output, and the attention mask is left out
    emb = encoded["context"]
    cond = tc.conditioning(zimage_clip, "a photo of a cat")
    np.testing.assert_array_equal(emb, cond[0][0][0].numpy())
    assert cond[0][1]["pooled_output"] is None and bool(cond[0][1]["attention_mask"].all())  # so only T counts
    assert emb.dtype == np.float32 and emb.shape[1] == tc.ZIMAGE_TE_HIDDEN
    assert encode("")["context"].shape[0] > 0  # the chat template makes the empty caption a few tokens
    assert identity == bridge.text_encoder(zimage_clip)[1] != bridge.text_encoder(klein_clip)[1]


def test_progress_interrupt_and_events(klein):
    bar = bridge.progress(3)
    bar.update(1, preview=torch.rand(2, 16, 16, 3))  # IMAGE previews become a PIL JPEG preview
    mm.interrupt_current_processing(True)
    with pytest.raises(bridge.Interrupted):
        bar.update(2)
    assert not mm.processing_interrupted()
    assert bridge.send_event("kiln.progress", {"step": 1}) is False  # no server in tests
    # In a session the stop button waits for the step boundary instead of breaking a forward.
    x, sigma = torch.randn(1, 128, 2, 2), torch.tensor([0.5])
    emb = np.zeros((512, tc.FLUX2_CONTEXT_DIM), np.float32)
    with bridge.training_session(klein):
        mm.interrupt_current_processing(True)
        model_output(klein, "flux2_klein", x, sigma, emb)  # runs through
        with pytest.raises(bridge.Interrupted):
            bar.update(3)
    mm.interrupt_current_processing(False)


def test_loss_map_feeds_comfy_loss_graph():
    from comfy_extras import nodes_train

    loss = bridge.loss_map([0.5, float("nan"), 0.25, 0.125])
    assert loss == {"loss": [0.5, 0.25, 0.125]}
    nodes_train.LossGraphNode.execute(loss, "kiln_loss_test")


def test_session_device_and_small_helpers(klein):
    with bridge.training_session(klein, "auto") as (_, device):
        assert device.type == "cpu"
    with bridge.training_session(klein, "cpu"):
        pass
    with pytest.raises(ValueError, match="ComfyUI loads this model on cpu"):
        with bridge.training_session(klein, "cuda"):
            pass
    assert not mm.in_training
    assert "euler" in bridge.sampler_names() and "simple" in bridge.scheduler_names()
    from PIL import Image

    picture = bridge.image_tensor(Image.new("RGB", (5, 3), (255, 0, 0)))
    assert picture.shape == (1, 3, 5, 3) and picture[0, 0, 0].tolist() == [1.0, 0.0, 0.0]
    assert bridge.cat_images([picture, torch.zeros(1, 4, 2, 3)]).shape == (2, 4, 5, 3)


def test_small_host_conds_go_to_the_gpu_once(monkeypatch):
    """Flux's guidance cond is a new host tensor at each call (torch.FloatTensor([g])): its device copy is
    made once and the same tensor handed back after (a step graph replays the copy it recorded; a pageable
    copy per call would wait for the GPU). "meta" stands for the GPU here. Large or CPU-bound conds, and the
    257th distinct value, are converted as ComfyUI does."""
    import kiln_pack.nodes.comfy.model as model

    monkeypatch.setattr(model, "_CONSTANTS", {})
    first = model._convert(torch.FloatTensor([1.0]), torch.bfloat16, "meta")
    assert first.device.type == "meta" and first.dtype == torch.bfloat16
    assert model._convert(torch.FloatTensor([1.0]), torch.bfloat16, "meta") is first
    assert model._convert(torch.FloatTensor([3.5]), torch.bfloat16, "meta") is not first  # its own value
    assert model._convert(torch.FloatTensor([1.0]), torch.float16, "meta") is not first  # its own dtype
    big = torch.zeros(65)
    assert model._convert(big, torch.bfloat16, "meta") is not model._convert(big, torch.bfloat16, "meta")
    kept = len(model._CONSTANTS)
    assert model._convert(torch.FloatTensor([7.0]), torch.float32, "cpu").tolist() == [7.0]
    assert len(model._CONSTANTS) == kept  # training on the CPU: nothing kept
    for value in range(300):
        model._convert(torch.FloatTensor([float(value)]), torch.float32, "meta")
    assert len(model._CONSTANTS) == 256


def test_folders_and_lora_listing(tmp_path):
    import folder_paths

    found = bridge.folders()
    assert set(found) == {"input", "output", "temp", "loras", "diffusion_models"}
    assert found["diffusion_models"] in folder_paths.get_folder_paths("diffusion_models")
    assert found["loras"] in folder_paths.get_folder_paths("loras")
    assert found["temp"] == folder_paths.get_temp_directory()
    folder_paths.add_model_folder_path("loras", str(tmp_path), is_default=True)
    assert bridge.folders()["loras"] == str(tmp_path)
    before = folder_paths.get_filename_list("loras")
    (tmp_path / "kiln_new.safetensors").write_bytes(b"")
    bridge.refresh_loras()
    assert "kiln_new.safetensors" in folder_paths.get_filename_list("loras")
    assert "kiln_new.safetensors" not in before
    assert "kiln_new.safetensors" in bridge.lora_names()
    assert bridge.lora_path("kiln_new.safetensors") == str(tmp_path / "kiln_new.safetensors")


def test_trainable_swaps_a_dynamic_patcher_for_its_delegate(klein):
    class Dynamic:
        def is_dynamic(self):
            return True

        def get_non_dynamic_delegate(self):
            return klein

    class Orphan(Dynamic):
        def get_non_dynamic_delegate(self):
            raise RuntimeError("Cannot create non-dynamic delegate: cached_patcher_init is not initialized.")

    assert bridge.trainable(klein) is klein
    assert bridge.trainable(Dynamic()) is klein
    with pytest.raises(RuntimeError, match="--disable-dynamic-vram"):
        bridge.trainable(Orphan())


def test_training_adapter_is_merged_in_fp32_even_where_comfy_would_use_fp16(zimage):
    """On CUDA ComfyUI sums W + ΔW in fp16; a session loads the adapter clone with fp32 sums instead."""
    adapter = bridge.lora_model_from(random_lora(zimage, "zimage", seed=6), "zimage")
    key = next(k for k in adapter if k.endswith(".lora_B.weight"))
    path = key[len("diffusion_model.") : -len(".lora_B.weight")]
    dm = bridge.diffusion_model(zimage)
    mm.load_models_gpu([zimage], force_full_load=True)
    weight = dict(dm.named_parameters())[path + ".weight"].detach().float().clone()
    down, up = adapter[key.replace("lora_B", "lora_A")].float(), adapter[key].float()
    alpha = float(adapter[key.replace("lora_B.weight", "alpha")])
    expected = weight + (alpha / down.shape[0]) * (up @ down)
    device = zimage.load_device
    mm.LORA_COMPUTE_DTYPES[device] = torch.float16  # what CUDA sm>=8 would pick
    try:
        merged = bridge.training_adapter_merged(zimage, adapter)
        with bridge.training_session(merged):
            got = dict(bridge.diffusion_model(merged).named_parameters())[path + ".weight"].detach().float()
            torch.testing.assert_close(got.cpu(), expected.cpu(), rtol=1e-6, atol=1e-6)
        assert mm.LORA_COMPUTE_DTYPES[device] == torch.float16  # put back as it was
    finally:
        mm.LORA_COMPUTE_DTYPES.pop(device, None)
        mm.load_models_gpu([zimage], force_full_load=True)


def test_a_session_in_a_prompt_leaves_a_sharded_base_alone():
    """Qwen-Image sharded over two 24 GB H200 caps ran out of memory after its last step (session 33): the end
    of a session in a prompt copied every weight into an inference tensor, and FSDP2 keeps each DTensor shard
    it made, so every copy doubled the shards. Shards stay as they are; plain weights still become inference
    tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        module = torch.nn.Linear(4, 4)
        mesh = init_device_mesh("cpu", (1,))
        shard = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Replicate()]), requires_grad=False)
        module.weight = shard
        bridge_session._as_a_prompt_left_them(module)
        assert module.weight is shard  # the same shard FSDP2 holds, not a second copy
        assert module.bias.is_inference() and module.bias.requires_grad
    finally:
        torch.distributed.destroy_process_group()
