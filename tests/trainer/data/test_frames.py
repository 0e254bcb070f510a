"""Which frames of a clip train (frames.py), the frame buckets and windows in the bucket plan, and a clip's
latents cached per window and batched as [B,C,t,h,w]."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.helpers.clips import write_clip
from trainer.data.buckets import plan_buckets
from trainer.data.cache import latent_key
from trainer.data.dataset import Dataset, DataSettings
from trainer.data.frames import FrameSettings, bucket_frames, clip_windows, snap, timeline_length
from trainer.run.loop import latent_tokens


def test_frame_counts_snap_to_4k_plus_1_and_never_exceed_the_clip():
    assert [snap(n) for n in (1, 4, 5, 8, 9, 33, 34, 81, 84)] == [1, 1, 5, 5, 9, 33, 33, 81, 81]
    assert timeline_length(20, 8.0, 16.0) == 40 and timeline_length(48, 24.0, 16.0) == 32
    assert timeline_length(20, 8.0, 0) == 20  # 0: the clip's own rate
    assert bucket_frames(100, 16.0, FrameSettings(frames=33, fps=16)) == 33
    assert bucket_frames(100, 16.0, FrameSettings(frames=30, fps=16)) == 29  # the target snaps down too
    assert bucket_frames(20, 16.0, FrameSettings(frames=33, fps=16)) == 17


def test_head_uniform_and_windows_take_these_frames():
    own = dict(fps=0.0, frames=5)
    assert clip_windows(20, 16.0, FrameSettings(**own)) == [(0, 1, 2, 3, 4)]
    assert clip_windows(21, 16.0, FrameSettings(**own, extraction="uniform")) == [(0, 5, 10, 15, 20)]
    assert clip_windows(20, 16.0, FrameSettings(**own, extraction="windows", windows=3)) == [
        (0, 1, 2, 3, 4),
        (8, 9, 10, 11, 12),  # starts spread evenly over 0..15
        (15, 16, 17, 18, 19),
    ]
    # A clip only as long as one window gives one window, not three copies of it.
    assert clip_windows(5, 16.0, FrameSettings(**own, extraction="windows", windows=3)) == [(0, 1, 2, 3, 4)]
    # 24 fps read at 12 fps: every other frame.
    assert clip_windows(48, 24.0, FrameSettings(frames=5, fps=12)) == [(0, 2, 4, 6, 8)]


def test_windows_are_entries_of_their_own_and_images_keep_their_entries_and_keys():
    sizes, windows = [(96, 64), (96, 64)], [[], [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9)]]
    plan = plan_buckets(sizes, [64], 16, windows=windows)
    image, *clips = plan.entries
    assert image == plan_buckets(sizes[:1], [64], 16).entries[0] and image.frames == () and image.key == "64x48"
    assert [e.frames for e in clips] == windows[1] and {e.key for e in clips} == {"64x48x5f"}
    assert plan.buckets() == {"64x48": [0], "64x48x5f": [1, 2]}
    assert latent_key("ab", (64, 48), (72, 48), (4, 0), "vae") == latent_key(
        "ab", (64, 48), (72, 48), (4, 0), "vae", "", ()
    )
    keys = {latent_key("ab", (64, 48), (72, 48), (4, 0), "vae", "", e.frames) for e in clips}
    assert len(keys) == 2  # an item key includes the window


def fake_video_vae(seen):
    """A stand-in VAE: 8× smaller, a clip of T frames → (T-1)/4+1 latent frames, each the mean of its first frame."""

    def encode(pixels):
        seen.append(pixels.shape)
        if pixels.ndim == 4:
            return np.zeros((len(pixels), 4, pixels.shape[1] // 8, pixels.shape[2] // 8), np.float32)
        batch, frames, height, width, _ = pixels.shape
        out = np.zeros((batch, 4, (frames - 1) // 4 + 1, height // 8, width // 8), np.float32)
        for t in range(out.shape[2]):
            out[:, :, t] = pixels[:, 4 * t, ..., 0].mean(axis=(1, 2))[:, None, None, None]
        return out

    return encode


def test_clips_are_encoded_per_window_and_batch_as_5d(tmp_path):
    from PIL import Image

    write_clip(tmp_path / "a.mp4", codec="mpeg4", frames=20, fps=16)
    write_clip(tmp_path / "b.webm", codec="libvpx", frames=24, fps=16)
    Image.new("RGB", (96, 64), "white").save(tmp_path / "still.png")
    frames = FrameSettings(frames=9, fps=16, extraction="windows", windows=2)
    ds = Dataset.load(tmp_path, DataSettings(resolutions=(64,), divisor=16, frames=frames))
    assert [(ds.report.items[e.item].path, e.frames[:1], e.key) for e in ds.plan.entries] == [
        ("a.mp4", (0,), "64x48x9f"),
        ("a.mp4", (11,), "64x48x9f"),  # 20 frames: windows start at 0 and 20 - 9
        ("b.webm", (0,), "64x48x9f"),
        ("b.webm", (15,), "64x48x9f"),
        ("still.png", (), "64x48"),
    ]
    seen = []
    ds = ds.encode_images(fake_video_vae(seen), "fake-vae", batch_size=4)
    assert sorted(seen) == [(1, 48, 64, 3), (4, 9, 48, 64, 3)]  # one call per bucket: the clips stack
    data = ds.encode_captions(lambda text: np.zeros((2, 8), np.float32), "fake-text").training_data()
    latent = data.latent(1)  # a.mp4's second window: frames 11..19
    assert latent.shape == (4, 3, 6, 8)
    # Its latent frames start at source frames 11, 15 and 19 (red level 10 per frame, lossy).
    assert np.round(latent[0, :, 0, 0] * 255 / 10).tolist() == [11, 15, 19]
    batch = np.stack([data.latent(n) for n in data.buckets["64x48x9f"]])
    assert batch.shape == (4, 4, 3, 6, 8) and latent_tokens(batch.shape[1:], SimpleNamespace(patch=2)) == 3 * 3 * 4
    assert data.latent(4).shape == (4, 6, 8)  # the image stays [C,h,w]


@pytest.mark.parametrize("extraction", ["head", "uniform", "windows"])
def test_every_extraction_gives_windows_of_the_bucket_frames(extraction):
    settings = FrameSettings(frames=17, fps=16, extraction=extraction, windows=4)
    for length in (5, 9, 17, 18, 40, 100):
        windows = clip_windows(length, 16.0, settings)
        assert windows and all(len(w) == bucket_frames(length, 16.0, settings) for w in windows)
        assert all(0 <= i < length for w in windows for i in w) and all(list(w) == sorted(w) for w in windows)


def test_in_memory_clips_of_different_lengths_fall_in_different_buckets():
    """A batch stacks its rows: clips of 3 and 5 latent frames at one size never share a bucket; images keep theirs."""
    from trainer.data import InMemoryData

    latents = [np.zeros((4, 3, 6, 8), np.float32), np.zeros((4, 5, 6, 8), np.float32), np.zeros((4, 6, 8), np.float32)]
    context = np.zeros((2, 8), np.float32)
    data = InMemoryData.from_arrays(latents, [context] * 3, ["a.mp4", "b.mp4", "c.png"], context)
    assert data.buckets == {"8x6x3t": [0], "8x6x5t": [1], "8x6": [2]}


def test_start_images_are_each_clips_first_frame_then_grey_and_feed_an_i2v_batch(tmp_path):
    """Encode Images' start_images: each clip window's start image (its first frame, then grey: WanImageToVideo's
    pixels) encoded beside it under another key; an I2V arch's batch carries it with its mask, and an I2V run on
    clips without it is refused."""
    from trainer.archs import get_arch
    from trainer.config import ConfigError, from_dict
    from trainer.data.companion_batch import check
    from trainer.objective.flow import ObjectiveSettings
    from trainer.run.loop import build_batch

    write_clip(tmp_path / "a.mp4", codec="mpeg4", frames=20, fps=16)
    frames = FrameSettings(frames=9, fps=16, extraction="windows", windows=2)
    loaded = Dataset.load(tmp_path, DataSettings(resolutions=(64,), divisor=16, frames=frames))
    seen = []
    plain = loaded.encode_images(fake_video_vae(seen), "fake-vae")
    ds = loaded.encode_images(fake_video_vae(seen), "fake-vae", start_images=True)
    assert plain.entry_key(plain.plan.entries[0]) != ds.entry_key(ds.plan.entries[0])
    data = ds.encode_captions(lambda text: np.zeros((2, 8), np.float32), "fake-text").training_data()
    start, latent = data.start(1), data.latent(1)  # the second window: frames 11..19
    assert start.shape == latent.shape == (4, 3, 6, 8)
    assert np.array_equal(start[:, 0], latent[:, 0])  # the first latent frame: the window's first frame
    assert np.all(start[:, 1:] == 0.5)  # then grey (the stand-in VAE reads each latent frame's first frame)
    arch, rows = get_arch("wan22_i2v_low"), data.buckets["64x48x9f"]
    batch = build_batch(data, rows, np.random.default_rng(0), ObjectiveSettings(), arch, 0.0)
    assert np.array_equal(batch.extras["concat_latent_image"], np.stack([data.start(n) for n in rows]))
    mask = batch.extras["concat_mask"]  # WanImageToVideo's: 0 on the start frame's latent frame
    assert mask.shape == (2, 1, 3, 6, 8) and mask[:, :, 0].max() == 0 and mask[:, :, 1:].min() == 1
    t2v = build_batch(data, rows, np.random.default_rng(0), ObjectiveSettings(), get_arch("wan21_t2v"), 0.0)
    assert "concat_latent_image" not in t2v.extras
    cfg = from_dict({"arch": "wan22_i2v_low"})
    check(cfg, data, arch)
    without = plain.encode_captions(lambda text: np.zeros((2, 8), np.float32), "fake-text").training_data()
    with pytest.raises(ConfigError, match="start_images on in Kiln Encode Images"):
        check(cfg, without, arch)
