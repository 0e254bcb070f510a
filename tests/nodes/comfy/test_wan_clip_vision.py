"""Wan 2.1 image-to-video with CLIP vision, on a tiny WAN21_I2V model (img_emb, in_dim 36) and a tiny CLIP vision
model, both built with ComfyUI's own classes:

  - Encode Images' clip_vision encodes each clip window's start frame as CLIP Vision Encode (crop none) does and
    caches its penultimate hidden states beside the start latent (bitwise);
  - the training forward, fed the batch's clip_vision_output beside the start image, is bitwise the call ComfyUI's
    sampler makes for WanImageToVideo(start_image, clip_vision_output) conditioning;
  - Train LoRA trains it on such a cache (image keys and values among the targets) and refuses it on a cache
    without the features, naming the fix; headless training refuses it before loading anything.
"""

from __future__ import annotations

from helpers import comfy_env
import numpy as np
import pytest

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()

from helpers.bridge_calls import Calls, comfy_sampling_calls, random_lora, same_call, small_config  # noqa: E402
from helpers.clips import write_clip  # noqa: E402
from helpers.tiny_wan import caption, cond, load, tiny_clip_vision, tiny_wan_vae, write_wan_file  # noqa: E402
import torch  # noqa: E402

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.nodes.dataset_nodes as dn
import kiln_pack.trainer.archs as archs
from kiln_pack.trainer.backends.torch_backend.device_batch import extras_on_device
from kiln_pack.trainer.config import ConfigError
from kiln_pack.trainer.data.companion_batch import CLIP_VISION, start_extras
from kiln_pack.trainer.data.companions import start_pixels
from kiln_pack.trainer.data.encoding import clip_samples

ARCH = "wan21_i2v"


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wanclip")
    model = load(write_wan_file(folder / "i2v.safetensors", model_type="i2v", in_dim=36))
    return model, tiny_wan_vae(), tiny_clip_vision(folder)


def out(result, index=0):
    return result.result[index] if hasattr(result, "result") else result[index]


def clip_vision_encode(clip_vision, image: np.ndarray):
    """ComfyUI's CLIP Vision Encode node with the crop of its Wan image-to-video templates."""
    from nodes import CLIPVisionEncode

    with torch.inference_mode():
        return CLIPVisionEncode().encode(clip_vision, torch.from_numpy(image), "none")[0]


def test_image_attention_is_trained_and_loads_with_no_unmatched_key(parts):
    model = parts[0]
    lora = random_lora(model, ARCH)
    assert {"blocks.0.cross_attn.k_img", "blocks.0.cross_attn.v_img"} <= set(lora)
    assert archs.get_arch(ARCH).clip_vision and not archs.get_arch("wan22_i2v_low").clip_vision


def test_forward_with_clip_vision_is_the_samplers_of_wanimagetovideo(parts):
    """Kiln's start image and CLIP vision features for a clip (through Encode Images' encoders, onto the device as
    a training batch's extras) reach the model bitwise as ComfyUI's sampler gives WanImageToVideo's conds with
    CLIP Vision Encode's output: clip_fea among the model's inputs."""
    from comfy_extras.nodes_wan import WanImageToVideo

    model, vae, clip_vision = parts
    emb, length = caption(6, 9), 5
    clip = np.random.default_rng(7).random((length, 32, 32, 3), dtype=np.float32)
    start = bridge.vae_encoder(vae)[0](start_pixels(clip)[None])[0]
    encode_vision, _identity = bridge.clip_vision_encoder(clip_vision)
    features = encode_vision(clip[:1])[0]  # what Encode Images caches as "clip_vision"
    arch = archs.get_arch(ARCH)
    extras = start_extras([start], arch, [features])
    assert extras[CLIP_VISION].shape[0] == 1 and extras[CLIP_VISION].shape[-1] == 1280
    # bf16: a dtype no tensor of the model's call has here, so only an fp32 extra keeps the features bitwise
    extras = extras_on_device(extras, torch.device("cpu"), torch.bfloat16)
    extras["num_tokens"] = torch.tensor([len(emb)])
    vision = clip_vision_encode(clip_vision, clip[:1])
    with torch.inference_mode():  # as ComfyUI runs a node
        node = WanImageToVideo.execute(
            cond(emb),
            cond(emb),
            vae,
            32,
            32,
            length,
            1,
            start_image=torch.from_numpy(clip[:1]),
            clip_vision_output=vision,
        )
    positive, _negative, latent = node.result if hasattr(node, "result") else node
    run = comfy_sampling_calls(model, positive, tuple(latent["samples"].shape), seed=3)
    context = torch.from_numpy(arch.collate_context([emb]))
    dm, forward = bridge.diffusion_model(model), bridge.make_forward(model, ARCH)
    for args, kwargs, output in run:
        assert "clip_fea" in kwargs
        with Calls(dm) as calls, torch.inference_mode():
            ours = forward(dm, args[0][:, :16], kwargs["transformer_options"]["sigmas"], context, dict(extras))
        same_call(calls[0], (args, kwargs, output))
        assert torch.equal(ours, output)
    without = {k: v for k, v in extras.items() if k != CLIP_VISION}
    with torch.inference_mode():
        plain = forward(dm, args[0][:, :16], kwargs["transformer_options"]["sigmas"], context, without)
    assert not torch.equal(plain, output)  # the features change the output: they went in


def encoded_clip(comfy_dirs, parts, name: str, **inputs):
    folder = comfy_dirs / "input" / name
    folder.mkdir(parents=True)
    write_clip(folder / "a.mp4", codec="mpeg4", frames=20, fps=16, size=(64, 64))
    (folder / "a.txt").write_text("a clip", encoding="utf-8")
    loaded = out(dn.KilnLoadDataset.execute(name, "", "", "", "64", 1, 0.0, frames=5, fps=16.0))
    encoded = out(dn.KilnEncodeImages.execute(loaded, parts[1], 1, **inputs))
    return folder, encoded


def test_encode_images_caches_clip_vision_encodes_of_each_start_frame(comfy_dirs, parts):
    folder, encoded = encoded_clip(comfy_dirs, parts, "wanclip_cache", clip_vision=parts[2])
    schema = [i.id for i in dn.KilnEncodeImages.define_schema().inputs]
    assert schema[-2:] == ["start_images", "clip_vision"]  # the new input last
    entry = encoded.plan.entries[0]
    cached = encoded.cache.get("latents", encoded.entry_key(entry))
    assert {"latent", "start", "clip_vision"} <= set(cached)  # start images come with the features
    ((_, sample),) = clip_samples(folder / "a.mp4", [(0, entry)])
    want = clip_vision_encode(parts[2], sample.pixels[:1]).penultimate_hidden_states[0]
    assert torch.equal(torch.from_numpy(cached["clip_vision"]), want.float())
    other = out(dn.KilnEncodeImages.execute(encoded, parts[1], 1, clip_vision=tiny_clip_vision(folder, seed=1)))
    assert other.entry_key(entry) != encoded.entry_key(entry)  # another CLIP vision model: encoded again


def test_train_lora_trains_wan21_i2v_on_the_features_and_refuses_a_cache_without(comfy_dirs, parts, tmp_path):
    from kiln_pack.nodes.comfy import training

    model = parts[0]
    _, with_vision = encoded_clip(comfy_dirs, parts, "wanclip_train", clip_vision=parts[2])
    _, start_only = encoded_clip(comfy_dirs, parts, "wanclip_start", start_images=True)
    text = (lambda text: caption(4, len(text)), "fake-umt5")
    seen = {}

    def run(cfg, module, data, **front):
        from kiln_pack.trainer.run import loop

        seen["result"] = loop.train(cfg, module, data, run_dir=tmp_path / "run", **front)

    cfg = small_config(ARCH, steps=2)
    with pytest.raises(ConfigError, match="clip_vision input"):
        training.train(cfg, model, start_only.encode_captions(*text), run=run)
    training.train(cfg, model, with_vision.encode_captions(*text), run=run)
    result = seen["result"]
    assert len(result.history.loss) == 2 and all(np.isfinite(loss) for loss in result.history.loss)
    assert np.abs(result.lora["blocks.0.cross_attn.k_img"].B).max() > 0  # the image keys trained
