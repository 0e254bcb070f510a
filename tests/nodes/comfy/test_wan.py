"""Wan 2.1 / 2.2, a video family added by one arch file (trainer/archs/wan.py): the checks the other families
have, on tiny models ComfyUI itself detects (a ComfyUI-format file through comfy.sd.load_diffusion_model):

  - detection: Wan 2.1 T2V and its Wan 2.2 A14B experts, Wan 2.1 I2V (and its experts), Wan 2.2 TI2V 5B;
  - the training forward is bitwise the call ComfyUI's sampler makes, on one frame (Kiln's cached image
    [C,h,w]) and on a clip [B,C,t,h,w];
  - training steps on clips and on still images in a session learn and leave the model bitwise as it was;
  - the comfy and kohya files load through ComfyUI's loader with zero unmatched keys (ComfyUI has no diffusers
    names for Wan);
  - the diffusers export loads into diffusers' WanTransformer3DModel (load_lora_adapter, no unexpected key)
    and gives ComfyUI's output with the LoRA;
  - text encoder type, shift and the experts' σ ranges.
"""

from __future__ import annotations

from helpers import comfy_env
import numpy as np
import pytest

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()  # skips this whole module without COMFYUI_PATH

import comfy.model_management as mm  # noqa: E402
from helpers.tiny_wan import DIM, FFN, LAYERS, TEXT_DIM, caption, cond, load, write_wan_file  # noqa: E402
import torch  # noqa: E402
from helpers.bridge_calls import (  # noqa: E402
    Calls,
    comfy_sampling_calls,
    our_call,
    random_lora,
    same_call,
    small_config,
)

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.trainer.archs as archs
import kiln_pack.trainer.data as data_module
import kiln_pack.trainer.lora.files as lf
import kiln_pack.trainer.run.loop as loop


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan")
    return {
        "t2v": load(write_wan_file(folder / "t2v.safetensors")),
        "i2v": load(write_wan_file(folder / "i2v.safetensors", model_type="i2v", in_dim=36)),
        # Wan 2.2 A14B image-to-video: the start image concatenated (in_dim 36), no CLIP-vision layers
        "i2v22": load(write_wan_file(folder / "i2v22.safetensors", in_dim=36)),
        "ti2v": load(write_wan_file(folder / "ti2v.safetensors", in_dim=48, out_dim=48)),
    }


@pytest.fixture(scope="module")
def wan(models):
    return models["t2v"]


def test_each_variant_is_detected(models):
    assert bridge.matching_archs(models["t2v"]) == ["wan21_t2v", "wan22_t2v_high", "wan22_t2v_low"]
    assert bridge.detect_arch(models["t2v"]) == "wan21_t2v"  # the experts are the same model: chosen by name
    assert bridge.matching_archs(models["i2v"]) == ["wan21_i2v"]
    # ComfyUI loads Wan 2.2's I2V experts as WAN21_T2V (no img_emb); the patch embedding's width tells them apart
    assert type(models["i2v22"].model.model_config).__name__ == "WAN21_T2V"
    assert bridge.matching_archs(models["i2v22"]) == ["wan22_i2v_high", "wan22_i2v_low"]
    assert bridge.matching_archs(models["ti2v"]) == ["wan22_ti2v_5b"]
    for model, arch in ((models["t2v"], "wan21_t2v"), (models["ti2v"], "wan22_ti2v_5b")):
        fmt = model.get_model_object("latent_format")
        assert fmt.latent_channels == archs.get_arch(arch).latent_channels
        assert archs.guess_arch(random_lora(model, arch)) == "wan21_t2v"
    assert archs.guess_arch(random_lora(models["i2v"], "wan21_i2v")) == "wan21_i2v"


@pytest.mark.parametrize(
    "kind,arch",
    [("t2v", "wan21_t2v"), ("ti2v", "wan22_ti2v_5b"), ("i2v", "wan21_i2v"), ("i2v22", "wan22_i2v_low")],
)
@pytest.mark.parametrize("frames", [1, 3])
def test_forward_equals_comfy_sampling(models, kind, arch, frames):
    model, emb = models[kind], caption(7, frames)
    channels = archs.get_arch(arch).latent_channels
    run = comfy_sampling_calls(model, cond(emb), (1, channels, frames, 4, 4), seed=frames)
    for args, kwargs, output in run:
        assert args[0].shape[2] == frames
        x = args[0][:, :channels]  # I2V: ComfyUI concatenates its (zero, no start image) image channels
        sigma = kwargs["transformer_options"]["sigmas"]  # the model's timestep is σ·1000 (ModelSamplingSD3)
        if frames == 1:  # Kiln's cached image latent [C,h,w]: no frame axis
            ours, calls = our_call(model, arch, x[:, :, 0], sigma, [emb])
            assert torch.equal(ours, output[:, :, 0])
        else:
            ours, calls = our_call(model, arch, x, sigma, [emb])
            assert torch.equal(ours, output)
        same_call(calls[0], (args, kwargs, output))


def test_i2v_start_image_conditioning_passes_through_as_comfy_gives_it(models):
    """WanImageToVideo's conds (concat_latent_image: the VAE latent of the start frame then grey frames;
    concat_mask: 0 on the start frame's latent frame), given as model extras, reach the model bitwise as
    ComfyUI's sampler gives them. What Kiln does not yet make is those latents from a clip (the data side)."""
    model, emb, frames = models["i2v"], caption(5, 8), 3
    rng = np.random.default_rng(4)
    image = torch.from_numpy(rng.standard_normal((1, 16, frames, 4, 4)).astype(np.float32))
    mask = torch.ones(1, 1, frames, 4, 4)
    mask[:, :, :1] = 0.0
    positive = [[cond(emb)[0][0], {"concat_latent_image": image, "concat_mask": mask}]]
    run = comfy_sampling_calls(model, positive, (1, 16, frames, 4, 4), seed=2)
    arch = archs.get_arch("wan21_i2v")
    context = torch.from_numpy(arch.collate_context([emb]))
    extras = {"num_tokens": torch.tensor([len(emb)]), "concat_latent_image": image, "concat_mask": mask}
    dm, forward = bridge.diffusion_model(model), bridge.make_forward(model, "wan21_i2v")
    for args, kwargs, output in run:
        with Calls(dm) as calls, torch.inference_mode():
            ours = forward(dm, args[0][:, :16], kwargs["transformer_options"]["sigmas"], context, extras)
        assert not torch.equal(args[0][:, 16:20], torch.zeros_like(args[0][:, 16:20]))  # the mask went in
        same_call(calls[0], (args, kwargs, output))
        assert torch.equal(ours, output)


def test_i2v_start_image_from_a_clips_first_frame_is_wanimagetovideos(models):
    """Kiln's start image for a clip (its first frame then grey, through the VAE encoder Encode Images uses, fed by
    the training batch's start_extras) reaches the model bitwise as ComfyUI's sampler gives WanImageToVideo's conds
    for that first frame (the clip already at its bucket's size, so the node's resize keeps it). Wan 2.1 I2V's CLIP
    vision beside it: test_wan_clip_vision.py."""
    from comfy_extras.nodes_wan import WanImageToVideo
    from helpers.tiny_wan import tiny_wan_vae

    from kiln_pack.trainer.data.companion_batch import start_extras
    from kiln_pack.trainer.data.companions import start_pixels

    model, vae, emb, length = models["i2v22"], tiny_wan_vae(), caption(6, 9), 5
    clip = np.random.default_rng(7).random((length, 32, 32, 3), dtype=np.float32)
    encode, _identity = bridge.vae_encoder(vae)
    start = encode(start_pixels(clip)[None])[0]  # [16, 2, 4, 4]: what Encode Images caches as "start"
    arch = archs.get_arch("wan22_i2v_low")
    extras = {k: torch.from_numpy(v) for k, v in start_extras([start], arch).items()}
    extras["num_tokens"] = torch.tensor([len(emb)])
    with torch.inference_mode():  # as ComfyUI runs a node
        node = WanImageToVideo.execute(
            cond(emb), cond(emb), vae, 32, 32, length, 1, start_image=torch.from_numpy(clip[:1])
        )
    positive, _negative, latent = node.result if hasattr(node, "result") else node
    run = comfy_sampling_calls(model, positive, tuple(latent["samples"].shape), seed=3)
    context = torch.from_numpy(arch.collate_context([emb]))
    dm, forward = bridge.diffusion_model(model), bridge.make_forward(model, arch.name)
    for args, kwargs, output in run:
        with Calls(dm) as calls, torch.inference_mode():
            ours = forward(dm, args[0][:, :16], kwargs["transformer_options"]["sigmas"], context, extras)
        same_call(calls[0], (args, kwargs, output))
        assert torch.equal(ours, output)


def test_i2v_samples_without_wanimagetovideos_conditioning_say_what_to_wire():
    """An image-to-video model's samples read the start image from WanImageToVideo's conditioning (ComfyUI's
    sampler, concat_latent_image); fed the text encoder's instead, the run says once what to wire."""
    from types import SimpleNamespace

    from comfy_extras.nodes_wan import WanImageToVideo
    from helpers.tiny_wan import tiny_wan_vae

    from kiln_pack.nodes.comfy.training import start_image_note

    emb = caption(6, 9)
    with torch.inference_mode():
        node = WanImageToVideo.execute(
            cond(emb), cond(emb), tiny_wan_vae(), 32, 32, 5, 1, start_image=torch.rand(1, 32, 32, 3)
        )
    positive, negative, _latent = node.result if hasattr(node, "result") else node
    wired, plain = SimpleNamespace(positive=positive), SimpleNamespace(positive=cond(emb))
    assert start_image_note("wan22_i2v_low", [wired]) == start_image_note("wan21_t2v", [plain]) == ""
    note = start_image_note("wan21_i2v", [wired, plain])
    assert "no start image" in note and "WanImageToVideo" in note and "Validation Settings" in note


@pytest.mark.parametrize("frames", [3, None])
def test_training_steps_learn_and_leave_model_unchanged(wan, tmp_path, frames):
    """Clips [C,t,h,w] and still images [C,h,w] (a video model trained on images) alike."""
    rng = np.random.default_rng(0)
    shape = (16, frames, 4, 4) if frames else (16, 4, 4)
    raw = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    latents = [bridge.item_latent_in(wan, r) for r in raw]  # as the node's training maps the cache
    data = data_module.InMemoryData.from_arrays(
        latents, [caption(n, n) for n in (4, 9, 4)], [f"clip{i}.mp4" for i in range(3)], caption(1, 99)
    )
    probe_x, probe_sigma = torch.from_numpy(latents[0][None]), torch.tensor([0.6])
    before = our_call(wan, "wan21_t2v", probe_x, probe_sigma, [caption(4, 4)])[0]
    with bridge.training_session(wan) as (dm, _device):
        result = loop.train(
            small_config("wan21_t2v", steps=2),
            dm,
            data,
            run_dir=tmp_path / "run",
            forward=bridge.make_forward(wan, "wan21_t2v"),
        )
    assert len(result.history.loss) == 2 and all(0 < loss < 50 for loss in result.history.loss)
    assert sorted(result.lora) == sorted(random_lora(wan, "wan21_t2v"))  # the arch's default targets
    assert any(np.abs(w.B).max() > 0 for w in result.lora.values())
    assert torch.equal(our_call(wan, "wan21_t2v", probe_x, probe_sigma, [caption(4, 4)])[0], before)


def test_the_node_path_maps_a_cached_clip_as_one_item(wan):
    """nodes/comfy/training.py maps each cached latent into the model's format: a clip [C,t,h,w] as one clip (not
    as a batch of C images), an image [C,h,w] as one frame; the statistics of Wan's format per channel."""
    from kiln_pack.nodes.comfy import training

    rng = np.random.default_rng(1)
    raw = [rng.standard_normal((16, 3, 4, 4)).astype(np.float32), rng.standard_normal((16, 4, 4)).astype(np.float32)]
    data = data_module.InMemoryData.from_arrays(raw, [caption(4, 0)] * 2, ["a.mp4", "b.png"], caption(1, 9))
    dataset = type("Encoded", (), {"settings": type("S", (), {"divisor": 16})(), "training_data": lambda self: data})()
    seen = {}

    def run(cfg, model, mapped, **front):
        seen["latents"] = [mapped.latent(i) for i in range(2)]

    cfg = small_config("wan21_t2v", steps=1)
    training.train(cfg, wan, dataset, run=lambda *a, **k: run(*a, **k), setup=None)
    fmt = wan.get_model_object("latent_format")
    for got, item in zip(seen["latents"], raw):
        frames = torch.from_numpy(item if item.ndim == 4 else item[:, None])[None]
        want = fmt.process_in(frames)[0].numpy()
        assert got.shape == item.shape
        np.testing.assert_array_equal(got, want if item.ndim == 4 else want[:, 0])


# ComfyUI (0.17, 0.33) maps no diffusers names onto Wan (comfy/lora.py model_lora_keys_unet): the diffusers
# export is diffusers' file (test below); the comfy and kohya files are ComfyUI's.
COMFY_FORMATS = [fmt for fmt in lf.FORMATS if fmt != "diffusers"]


def save(tmp_path, lora, arch, fmt, dtype="bf16"):
    path = tmp_path / f"wan_{fmt}.safetensors"
    metadata = lf.build_metadata(arch_name=arch, config={}, steps=1, trigger_words=[], title="wan")
    lf.save_lora(path, lora, arch=arch, fmt=fmt, dtype=dtype, metadata=metadata)
    return path


def test_comfy_reads_no_diffusers_wan_names(wan, tmp_path):
    tensors = bridge.load_lora_file(save(tmp_path, random_lora(wan, "wan21_t2v"), "wan21_t2v", "diffusers"))
    assert len(bridge.unmatched_lora_keys(wan, tensors)) == len(tensors)  # when ComfyUI learns them, list it


@pytest.mark.parametrize("fmt", COMFY_FORMATS)
@pytest.mark.parametrize("kind,arch", [("t2v", "wan21_t2v"), ("i2v", "wan21_i2v"), ("i2v22", "wan22_i2v_high")])
def test_every_comfy_format_loads_through_comfy_with_no_unmatched_key(models, tmp_path, fmt, kind, arch):
    model = models[kind]
    tensors = bridge.load_lora_file(save(tmp_path, random_lora(model, arch), arch, fmt))
    assert bridge.unmatched_lora_keys(model, tensors) == []
    x, sigma, emb = torch.randn(1, 16, 2, 4, 4), torch.tensor([0.5]), caption(6, 6)
    plain = our_call(model, arch, x, sigma, [emb])[0]
    mm.load_models_gpu([bridge.apply_lora(model, tensors, 1.0)], force_full_load=True)  # W + ΔW merged
    merged = our_call(model, arch, x, sigma, [emb])[0]
    mm.load_models_gpu([model], force_full_load=True)
    assert not torch.allclose(merged, plain, atol=1e-3)
    assert torch.equal(our_call(model, arch, x, sigma, [emb])[0], plain)


def test_diffusers_export_loads_in_wan_transformer_and_matches_comfy(wan, tmp_path):
    pytest.importorskip("peft", reason="diffusers loads LoRAs through peft (the `test` extra installs it)")
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    dm = bridge.diffusion_model(wan)
    base = {k: v.detach().clone() for k, v in dm.state_dict().items()}
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=DIM // 128,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=FFN,
        num_layers=LAYERS,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
    )
    model.load_state_dict(convert_wan_transformer_to_diffusers(dict(base)), strict=True)
    lora = random_lora(wan, "wan21_t2v", seed=3)
    path = save(tmp_path, lora, "wan21_t2v", "diffusers", dtype="fp32")
    rng = torch.Generator().manual_seed(5)
    x, context = torch.randn(1, 16, 2, 4, 4, generator=rng), torch.randn(1, 8, TEXT_DIM, generator=rng)

    def diffusers_out():
        with torch.no_grad():
            return model(x, torch.tensor([600.0]), context, return_dict=False)[0]

    def comfy_out(weights):
        with torch.inference_mode():
            return torch.func.functional_call(dm, weights, (x, torch.tensor([600.0]), context), strict=True)

    torch.testing.assert_close(diffusers_out(), comfy_out(base), rtol=1e-4, atol=1e-4)  # same model
    model.load_lora_adapter(str(path), prefix="transformer")
    patched = dict(base)
    for name, w in lora.items():
        patched[f"{name}.weight"] = base[f"{name}.weight"] + torch.from_numpy(w.B @ w.A) * w.scale
    with_lora = comfy_out(patched)
    assert not torch.allclose(with_lora, comfy_out(base), atol=1e-3)
    torch.testing.assert_close(diffusers_out(), with_lora, rtol=1e-4, atol=1e-4)


def test_text_encoder_shift_and_expert_sigma_ranges(wan):
    import comfy.sd

    t = torch.tensor([0.1, 0.3, 0.7])
    sigmas = wan.get_model_object("model_sampling").sigma(t * 1000)  # SD3 shift 8 on timesteps σ·1000
    for name in ("wan21_t2v", "wan21_i2v", "wan22_ti2v_5b", "wan22_t2v_high", "wan22_i2v_low"):
        arch = archs.get_arch(name)
        assert hasattr(comfy.sd.CLIPType, arch.clip_type)
        assert arch.shift_mode == "static"
        torch.testing.assert_close(sigmas, arch.shift * t / (1 + (arch.shift - 1) * t), rtol=1e-5, atol=1e-6)
    assert archs.get_arch("wan22_t2v_high").sigma_range == (0.875, 1.0)
    assert archs.get_arch("wan22_t2v_low").sigma_range == (0.0, 0.875)
    assert archs.get_arch("wan22_i2v_high").sigma_range == (0.9, 1.0)
    assert archs.get_arch("wan21_t2v").sigma_range == (0.0, 1.0)


def test_ti2v_5b_samples_with_the_shift_of_comfys_template(models):
    """The TI2V 5B's samples: Kiln samples the model as ComfyUI loads it, whose shift is the one ComfyUI's
    video_wan2_2_5B_ti2v template sets with ModelSamplingSD3 (8), and the one the arch trains with."""
    import json

    arch, t = archs.get_arch("wan22_ti2v_5b"), torch.tensor([0.1, 0.3, 0.7])
    sigmas = models["ti2v"].get_model_object("model_sampling").sigma(t * 1000)
    torch.testing.assert_close(sigmas, arch.shift * t / (1 + (arch.shift - 1) * t), rtol=1e-5, atol=1e-6)
    assert arch.shift == 8.0
    assert (arch.sampling.steps, arch.sampling.cfg, arch.sampling.sampler) == (20, 5.0, "uni_pc")
    nodes = json.loads(_template("video_wan2_2_5B_ti2v.json").read_text())["nodes"]
    assert [n["widgets_values"][0] for n in nodes if n["type"] == "ModelSamplingSD3"] == [arch.shift]
    sampler = next(n["widgets_values"] for n in nodes if n["type"] == "KSampler")
    assert (sampler[2], sampler[3], sampler[4], sampler[5]) == (
        arch.sampling.steps,
        arch.sampling.cfg,
        arch.sampling.sampler,
        arch.sampling.scheduler,
    )


def _template(name: str):
    """A workflow template as the tree's requirements install it: comfyui-workflow-templates ships them in
    comfyui_workflow_templates_media_video (0.17's 0.9.x) or comfyui_workflow_templates_json (0.33's 0.11.x)."""
    import importlib
    from pathlib import Path

    looked = []
    for package in ("comfyui_workflow_templates_json", "comfyui_workflow_templates_media_video"):
        try:
            folder = Path(importlib.import_module(package).__file__).parent / "templates"
        except ImportError:
            continue
        looked.append(str(folder))
        if (folder / name).is_file():
            return folder / name
    raise AssertionError(f"{name} is in no templates package of this tree (looked in {looked})")
