"""Wan 2.1 I2V's CLIP vision features: Encode Images' clip_vision encodes each clip window's start image (its first
frame) and caches the features beside the start latent, under a key naming the CLIP vision model; the batch feeds
them as WanImageToVideo's clip_vision_output to the arch that reads them; a run that needs them and lacks them
is refused, and features for a model that reads none are ignored with one log line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.clips import write_clip
from tests.trainer.data.test_frames import fake_video_vae
from trainer.archs import get_arch
from trainer.backends.torch_backend.device_batch import extras_on_device
from trainer.config import ConfigError, from_dict
from trainer.data.companion_batch import CLIP_VISION, check
from trainer.data.dataset import Dataset, DataSettings
from trainer.data.frames import FrameSettings
from trainer.objective.flow import ObjectiveSettings
from trainer.run.loop import build_batch


def fake_clip_vision(seen: list):
    """A stand-in CLIP vision encoder: images [B,H,W,3] → [B,3,5], token t of each row the image's mean red
    level plus t (so a test can tell which frame went in)."""

    def encode(images):
        seen.append(images.shape)
        red = images[..., 0].mean(axis=(1, 2))
        return (red[:, None, None] + np.arange(3, dtype=np.float32)[None, :, None] + np.zeros((1, 1, 5))).astype(
            np.float32
        )

    return encode


def encoded(tmp_path, **kwargs):
    write_clip(tmp_path / "a.mp4", codec="mpeg4", frames=20, fps=16)
    frames = FrameSettings(frames=9, fps=16, extraction="windows", windows=2)
    loaded = Dataset.load(tmp_path, DataSettings(resolutions=(64,), divisor=16, frames=frames))
    return loaded, loaded.encode_images(fake_video_vae([]), "fake-vae", **kwargs)


def training_data(ds):
    return ds.encode_captions(lambda text: np.zeros((2, 8), np.float32), "fake-text").training_data()


def test_each_windows_start_image_is_encoded_and_cached_under_the_models_identity(tmp_path):
    seen = []
    loaded, ds = encoded(tmp_path, clip_vision=(fake_clip_vision(seen), "vision-a"))
    assert ds.start_images  # the features are the start image's: clip_vision encodes the start images too
    assert sum(s[0] for s in seen) == 2 and {s[1:] for s in seen} == {(48, 64, 3)}  # one start frame per window
    data = training_data(ds)
    for n in (0, 1):
        start, vision = data.start(n), data.clip_vision(n)
        assert start is not None and vision.shape == (3, 5)
        # the window's first frame went in: the stand-in VAE's first latent frame is that frame's red mean too
        assert np.allclose(vision[0, 0], start[0, 0, 0, 0], atol=1e-6)
    assert data.clip_vision(0)[0, 0] != data.clip_vision(1)[0, 0]  # two windows, two start frames
    start_only = loaded.encode_images(fake_video_vae([]), "fake-vae", start_images=True)
    assert training_data(start_only).clip_vision(0) is None
    keys = {d.entry_key(d.plan.entries[0]) for d in (ds, start_only)}
    other = loaded.encode_images(fake_video_vae([]), "fake-vae", clip_vision=(fake_clip_vision(seen), "vision-b"))
    keys.add(other.entry_key(other.plan.entries[0]))
    assert len(keys) == 3 and sum(s[0] for s in seen) == 4  # another CLIP vision model: another key, encoded again
    again = loaded.encode_images(fake_video_vae([]), "fake-vae", clip_vision=(fake_clip_vision(seen), "vision-a"))
    assert (
        sum(s[0] for s in seen) == 4 and again.entry_key(again.plan.entries[0]) in keys
    )  # the same model: read from the cache


def test_the_batch_feeds_them_to_wan21_i2v_only_and_fp32_to_the_device(tmp_path):
    _, ds = encoded(tmp_path, clip_vision=(fake_clip_vision([]), "vision-a"))
    data = training_data(ds)
    rows = data.buckets["64x48x9f"]
    batch = build_batch(data, rows, np.random.default_rng(0), ObjectiveSettings(), get_arch("wan21_i2v"), 0.0)
    assert np.array_equal(batch.extras[CLIP_VISION], np.stack([data.clip_vision(n) for n in rows]))
    assert "concat_latent_image" in batch.extras
    expert = build_batch(data, rows, np.random.default_rng(0), ObjectiveSettings(), get_arch("wan22_i2v_low"), 0.0)
    assert CLIP_VISION not in expert.extras and "concat_latent_image" in expert.extras
    on_device = extras_on_device(batch.extras, torch.device("cpu"), torch.bfloat16)
    assert on_device[CLIP_VISION].dtype == torch.float32  # cast once, at the model call, as ComfyUI casts its conds


def test_wan21_i2v_without_them_is_refused_and_others_ignore_them(tmp_path, caplog):
    loaded, ds = encoded(tmp_path, clip_vision=(fake_clip_vision([]), "vision-a"))
    with_vision = training_data(ds)
    start_only = training_data(loaded.encode_images(fake_video_vae([]), "fake-vae", start_images=True))
    check(from_dict({"arch": "wan21_i2v"}), with_vision, get_arch("wan21_i2v"))
    for data in (start_only, training_data(loaded.encode_images(fake_video_vae([]), "fake-vae"))):
        with pytest.raises(ConfigError, match="clip_vision_h.safetensors to Kiln Encode Images' clip_vision input"):
            check(from_dict({"arch": "wan21_i2v"}), data, get_arch("wan21_i2v"))
    caplog.set_level("INFO", logger="kiln")
    check(from_dict({"arch": "wan22_i2v_low"}), start_only, get_arch("wan22_i2v_low"))
    assert not [r for r in caplog.records if r.name == "kiln"]
    check(from_dict({"arch": "wan22_i2v_low"}), with_vision, get_arch("wan22_i2v_low"))
    lines = [r.getMessage() for r in caplog.records if r.name == "kiln"]
    assert len(lines) == 1 and "ignored" in lines[0]
