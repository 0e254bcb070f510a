"""Qwen-Image, a family added by one arch file (trainer/archs/qwen_image.py): the same checks the other
families have, on a tiny model built with ComfyUI's own classes.

  - detection: ComfyUI's QwenImage model trains as `qwen_image`;
  - the training forward is bitwise the call ComfyUI's sampler makes (one caption), and a batch of
    captions of different lengths runs as one call per length, each row as ComfyUI computes it alone;
  - Kiln caches image latents [C,h,w]: the frame axis of the Wan 2.1 latent format is put back around
    process_in and the model call;
  - training steps in a session learn and leave the model bitwise as it was;
  - every LoRA format Kiln writes loads through ComfyUI's loader with zero unmatched keys;
  - the diffusers export renames nothing (ComfyUI's names are diffusers' own) and round-trips;
  - the estimate knows the full-size model.
"""

from __future__ import annotations

from helpers import comfy_env
import numpy as np
import pytest

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()  # skips this whole module without COMFYUI_PATH

import comfy.model_management as mm  # noqa: E402
from helpers import tiny_comfy as tc  # noqa: E402
import torch  # noqa: E402
from helpers.bridge_calls import comfy_sampling_calls, our_call, random_lora, same_call, small_config  # noqa: E402

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.trainer.archs as archs
import kiln_pack.trainer.data as data_module
import kiln_pack.trainer.lora.files as lf
import kiln_pack.trainer.run.loop as loop
from kiln_pack.trainer.backends.torch_backend.backend import TorchBackend

CONTEXT_DIM = tc.QWEN_CONTEXT_DIM


@pytest.fixture(scope="module")
def qwen():
    return tc.tiny_qwen_image()


def caption(tokens: int, seed: int) -> np.ndarray:
    """A caption embedding [T, D] as Qwen2.5-VL gives one prompt (no padding, no zero rows)."""
    return np.random.default_rng(seed).standard_normal((tokens, CONTEXT_DIM)).astype(np.float32)


def cond(embedding: np.ndarray):
    """CONDITIONING as CLIPTextEncode gives it for one Qwen-Image prompt (the all-ones mask dropped)."""
    return [[torch.from_numpy(embedding)[None], {}]]


def test_detected_as_qwen_image(qwen):
    assert bridge.detect_arch(qwen) == "qwen_image" and bridge.matching_archs(qwen) == ["qwen_image"]
    assert archs.guess_arch(random_lora(qwen, "qwen_image")) == "qwen_image"


def test_forward_equals_comfy_sampling_per_caption(qwen):
    embs = [caption(5, 0), caption(11, 1)]
    theirs = [comfy_sampling_calls(qwen, cond(e), (1, 16, 1, 4, 4), seed=i) for i, e in enumerate(embs)]
    for run, emb in zip(theirs, embs, strict=True):
        args, kwargs, output = run[0]
        assert args[0].shape == (1, 16, 1, 4, 4) and "attention_mask" not in kwargs
        ours, calls = our_call(qwen, "qwen_image", args[0][:, :, 0], args[1], [emb])  # cached latents: no frame axis
        same_call(calls[0], run[0])
        assert torch.equal(ours, output[:, :, 0])
    # A batch of both (different lengths, different sigmas): each row as ComfyUI computes it alone.
    x = torch.cat([theirs[0][0][0][0], theirs[1][1][0][0]])[:, :, 0]
    sigmas = torch.cat([theirs[0][0][0][1], theirs[1][1][0][1]])
    ours, calls = our_call(qwen, "qwen_image", x, sigmas, embs)
    assert len(calls) == 2  # one call per caption length, each trimmed to its own tokens
    torch.testing.assert_close(ours[0:1], theirs[0][0][2][:, :, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1:2], theirs[1][1][2][:, :, 0], rtol=1e-5, atol=1e-5)


def test_image_latents_pass_the_video_latent_format_as_one_frame(qwen):
    raw = np.random.default_rng(2).standard_normal((2, 16, 4, 6)).astype(np.float32)
    fmt = qwen.get_model_object("latent_format")
    assert fmt.latent_dimensions == 3
    expected = fmt.process_in(torch.from_numpy(raw)[:, :, None])[:, :, 0]
    mapped = bridge.latents_in(qwen, raw)
    assert mapped.shape == raw.shape and np.array_equal(mapped, expected.numpy())
    assert np.array_equal(bridge.latents_in(qwen, raw[1]), mapped[1])  # one cached item [C,h,w]
    np.testing.assert_allclose(bridge.latents_in(qwen, mapped, reverse=True), raw, rtol=1e-5, atol=1e-5)


def test_training_steps_learn_and_leave_model_unchanged(qwen, tmp_path):
    rng = np.random.default_rng(0)
    latents = [bridge.latents_in(qwen, rng.standard_normal((16, 4, 4)).astype(np.float32)) for _ in range(3)]
    data = data_module.InMemoryData.from_arrays(
        latents, [caption(n, n) for n in (4, 9, 4)], [f"img{i}.png" for i in range(3)], caption(1, 99)
    )
    probe_x, probe_sigma = torch.from_numpy(latents[0][None]), torch.tensor([0.6])
    before = our_call(qwen, "qwen_image", probe_x, probe_sigma, [caption(4, 4)])[0]
    with bridge.training_session(qwen) as (dm, _device):
        result = loop.train(
            small_config("qwen_image", steps=2),
            dm,
            data,
            run_dir=tmp_path / "run",
            forward=bridge.make_forward(qwen, "qwen_image"),
        )
    assert len(result.history.loss) == 2 and all(0 < loss < 50 for loss in result.history.loss)
    assert sorted(result.lora) == sorted(random_lora(qwen, "qwen_image"))  # the arch's default targets
    assert any(np.abs(w.B).max() > 0 for w in result.lora.values())
    assert torch.equal(our_call(qwen, "qwen_image", probe_x, probe_sigma, [caption(4, 4)])[0], before)


@pytest.mark.parametrize("fmt", list(lf.FORMATS))
def test_every_format_loads_through_comfy_with_no_unmatched_key(qwen, tmp_path, fmt):
    lora = random_lora(qwen, "qwen_image")
    path = tmp_path / f"qwen_{fmt}.safetensors"
    lf.save_lora(
        path,
        lora,
        arch="qwen_image",
        fmt=fmt,
        metadata=lf.build_metadata(arch_name="qwen_image", config={}, steps=1, trigger_words=[], title="qwen"),
    )
    tensors = bridge.load_lora_file(path)
    assert bridge.unmatched_lora_keys(qwen, tensors) == []
    x, sigma, emb = torch.randn(1, 16, 4, 4), torch.tensor([0.5]), caption(6, 6)
    plain = our_call(qwen, "qwen_image", x, sigma, [emb])[0]
    mm.load_models_gpu([bridge.apply_lora(qwen, tensors, 1.0)], force_full_load=True)  # W + ΔW merged
    merged = our_call(qwen, "qwen_image", x, sigma, [emb])[0]
    mm.load_models_gpu([qwen], force_full_load=True)
    assert torch.equal(our_call(qwen, "qwen_image", x, sigma, [emb])[0], plain)
    # ComfyUI's merged weights act as Kiln's side branches with the file's (bf16-rounded) weights.
    backend, saved = TorchBackend(), lf.load_lora(path)[0]
    with bridge.training_session(qwen) as (dm, _):
        backend.setup(
            dm, small_config("qwen_image"), archs.get_arch("qwen_image"), bridge.make_forward(qwen, "qwen_image")
        )
        try:
            backend.load_lora_state(saved)
            with torch.no_grad():
                branches = our_call(qwen, "qwen_image", x, sigma, [emb])[0]
        finally:
            backend.teardown()
    assert not torch.allclose(merged, plain, atol=1e-3)
    torch.testing.assert_close(branches, merged, rtol=1e-4, atol=1e-4)


def test_diffusers_names_are_comfys_own_and_round_trip(qwen):
    lora = random_lora(qwen, "qwen_image")
    tensors = lf.to_tensors(lora, "diffusers", "qwen_image")
    assert sorted(k for k in tensors if k.endswith(".lora_A.weight")) == sorted(
        f"transformer.{path}.lora_A.weight" for path in lora
    )
    back, found = lf.from_tensors(tensors, arch="qwen_image")
    assert found == "diffusers"
    assert sorted(back) == sorted(lora)
    for path, weights in lora.items():
        assert np.array_equal(back[path].A, weights.A) and np.array_equal(back[path].B, weights.B)
    layers = [n for n, m in bridge.diffusion_model(qwen).named_modules() if isinstance(m, torch.nn.Linear)]
    every = {n: lf.LoraWeights(np.ones((1, 1), np.float32), np.ones((1, 1), np.float32), 1.0) for n in layers}
    assert len(lf.to_tensors(every, "diffusers", "qwen_image")) == 2 * len(layers)  # every Linear has a name (A, B)


def test_text_encoder_type_shift_and_metadata(qwen):
    import comfy.sd

    arch = archs.get_arch("qwen_image")
    assert hasattr(comfy.sd.CLIPType, arch.clip_type)  # what headless training loads the encoder as
    t = torch.tensor([0.1, 0.3, 0.7])  # the static shift is the sigma schedule ComfyUI samples with
    sigmas = qwen.get_model_object("model_sampling").sigma(t)
    torch.testing.assert_close(sigmas, arch.shift * t / (1 + (arch.shift - 1) * t), rtol=1e-5, atol=1e-6)
    metadata = lf.build_metadata(arch_name="qwen_image", config={}, steps=1, trigger_words=[], title="t")
    assert metadata["modelspec.architecture"] == "Qwen-Image/lora"
