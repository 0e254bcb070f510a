"""Clips through the dataset nodes in a real ComfyUI (COMFYUI_PATH): Load Dataset's clip inputs (added last, with
tooltips), and Encode Images encoding each clip window with ComfyUI's own Wan VAE (a tiny one built from
comfy/ldm/wan/vae.py's WanVAE), cached as [C,t,h,w] with t = (T-1)/4+1, images beside them as [C,h,w]."""

from __future__ import annotations

from helpers import comfy_env
import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()

from helpers import tiny_comfy as tc
from helpers.clips import write_clip
from helpers.tiny_wan import tiny_wan_vae

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.nodes.dataset_nodes as dn
from kiln_pack.trainer.data.encoding import clip_samples

CLIP_INPUTS = ["frames", "fps", "frame_extraction", "frame_windows"]


def out(result, index=0):
    return result.result[index] if hasattr(result, "result") else result[index]


def test_load_dataset_takes_the_clip_settings_last_each_with_a_tooltip():
    inputs = dn.KilnLoadDataset.define_schema().inputs
    names = [i.id for i in inputs]
    assert names[-len(CLIP_INPUTS) :] == CLIP_INPUTS and names.index("deep_check") == len(names) - 5
    for element in inputs[-len(CLIP_INPUTS) :]:
        assert element.tooltip and element.optional
    combo = inputs[names.index("frame_extraction")]
    assert list(combo.options) == ["head", "uniform", "windows"]


def test_encode_images_encodes_clips_with_comfys_wan_vae(comfy_dirs):
    folder = comfy_dirs / "input" / "clips"
    folder.mkdir(parents=True)
    write_clip(folder / "a.mp4", codec="mpeg4", frames=24, fps=16)
    write_clip(folder / "b.webm", codec="libvpx", frames=12, fps=16)
    Image.fromarray(np.full((64, 96, 3), 128, np.uint8)).save(folder / "still.png")
    (folder / "a.txt").write_text("a clip", encoding="utf-8")
    loaded = out(
        dn.KilnLoadDataset.execute(
            "clips", "", "", "", "64", 1, 0.0, frames=9, fps=16.0, frame_extraction="windows", frame_windows=2
        )
    )
    assert [(e.key, e.frames[:1]) for e in loaded.plan.entries] == [
        ("64x48x9f", (0,)),
        ("64x48x9f", (15,)),  # a.mp4: 24 frames, windows at 0 and 15
        ("64x48x9f", (0,)),
        ("64x48x9f", (3,)),  # b.webm: 12 frames, windows at 0 and 3
        ("64x48", ()),
    ]
    assert "64x48x9f" in loaded.report_text()
    vae = tiny_wan_vae()
    encoded = out(dn.KilnEncodeImages.execute(loaded, vae, 2))
    assert not encoded.encode_problems
    cache = encoded.cache
    latents = [cache.get("latents", encoded.entry_key(e))["latent"] for e in encoded.plan.entries]
    assert [tuple(latent.shape) for latent in latents] == [(16, 3, 6, 8)] * 4 + [(16, 6, 8)]
    # Exactly what ComfyUI's VAE gives for that window's pixels (VAEEncode's [T,H,W,C] → [1,C,t,h,w]).
    ((_, sample),) = clip_samples(folder / "a.mp4", [(1, encoded.plan.entries[1])])
    with torch.inference_mode():
        direct = vae.encode(torch.from_numpy(sample.pixels))
    assert tuple(direct.shape) == (1, 16, 3, 6, 8)
    np.testing.assert_allclose(latents[1], direct[0].float().numpy(), rtol=1e-5, atol=1e-5)


def test_an_image_vae_given_clips_is_named(comfy_dirs):
    folder = comfy_dirs / "input" / "clips_flux"
    folder.mkdir(parents=True)
    write_clip(folder / "a.mp4", codec="mpeg4", frames=12, fps=16)
    loaded = out(dn.KilnLoadDataset.execute("clips_flux", "", "", "", "64", 1, 0.0, frames=5))
    with pytest.raises(Exception, match=r"clips need a video VAE"):
        dn.KilnEncodeImages.execute(loaded, tc.tiny_vae(flux2=False))


def test_a_video_vae_encodes_a_batch_of_images_one_by_one():
    encode, _ = bridge.vae_encoder(tiny_wan_vae())
    rng = np.random.default_rng(0)
    pixels = rng.random((3, 48, 64, 3), dtype=np.float32)
    batch = encode(pixels)
    assert batch.shape == (3, 16, 6, 8)
    np.testing.assert_allclose(batch[1], encode(pixels[1:2])[0], rtol=1e-5, atol=1e-5)
