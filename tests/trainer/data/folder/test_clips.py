"""Clips in a dataset folder: real small clips written with PyAV (and Pillow for a GIF), scanned and checked."""

from __future__ import annotations

import json

import pytest

from tests.helpers.clips import truncate, write_clip, write_gif
from trainer.data.folder.clips import first_frame, probe_clip, read_frames
from trainer.data.folder.scan import scan
from trainer.data.frames import FrameSettings


def codes(report, severity):
    """file → code of each problem of this severity (a missing caption aside: these clips have none)."""
    return {p.file: p.code for p in report.of(severity) if p.code != "caption_missing"}


def test_every_container_is_read_with_its_frames_rate_and_caption(tmp_path):
    write_clip(tmp_path / "h264.mp4")
    write_clip(tmp_path / "mpeg4.mov", "mpeg4")
    write_clip(tmp_path / "vp8.webm", "libvpx", frames=12)
    write_clip(tmp_path / "vp9.webm", "libvpx-vp9", frames=16, fps=24)
    write_clip(tmp_path / "x.mkv")
    write_gif(tmp_path / "anim.gif", frames=12, durations=100)
    (tmp_path / "h264.txt").write_text("a red square grows a green bar")
    report = scan(tmp_path, resolutions=[64])
    got = {i.path: (i.frames, i.fps, i.image_format, i.width, i.height) for i in report.items}
    assert got == {
        "anim.gif": (12, 10.0, "GIF", 96, 64),
        "h264.mp4": (20, 8.0, "MP4", 96, 64),
        "mpeg4.mov": (20, 8.0, "QuickTime", 96, 64),
        "vp8.webm": (12, 8.0, "WebM", 96, 64),
        "vp9.webm": (16, 24.0, "WebM", 96, 64),
        "x.mkv": (20, 8.0, "Matroska", 96, 64),
    }
    assert next(i for i in report.items if i.path == "h264.mp4").caption == "a red square grows a green bar"
    assert all(item.is_clip for item in report.items) and report.ok


@pytest.mark.parametrize("deep", [False, True])
def test_clips_that_cannot_train_are_named_with_a_fix(tmp_path, deep):
    truncate(write_clip(tmp_path / "cut.mp4", frames=30, options={"movflags": "faststart"}))
    truncate(write_clip(tmp_path / "cut.webm", "libvpx"))
    stamps = [0, 100, 150, 400, 450, 500, 900, 1000, 1100, 1120, 1300, 1400]
    write_clip(tmp_path / "vfr.mp4", frames=12, fps=1000, pts=stamps)
    write_gif(tmp_path / "vfr.gif", frames=8, durations=[100, 100, 300, 100, 40, 100, 100, 100])
    write_clip(tmp_path / "tiny.mp4", size=(32, 32))
    write_clip(tmp_path / "blink.mp4", frames=2)
    (tmp_path / "junk.mov").write_bytes(b"not a movie" * 20)
    write_clip(tmp_path / "good.mp4")
    report = scan(tmp_path, resolutions=[64], deep=deep)
    assert [i.path for i in report.items] == ["good.mp4"]
    assert codes(report, "skipped") == {
        "cut.mp4": "truncated_clip",
        "cut.webm": "truncated_clip",
        "vfr.mp4": "variable_frame_rate",
        "vfr.gif": "variable_frame_rate",
        "tiny.mp4": "too_small",
        "blink.mp4": "clip_too_short",
        "junk.mov": "unreadable_clip",
    }
    assert all(p.fix for p in report.skipped)
    assert "ffmpeg" in next(p.fix for p in report.skipped if p.code == "variable_frame_rate")


def test_a_clip_shorter_than_the_frame_count_trains_what_it_has_and_is_told(tmp_path):
    write_clip(tmp_path / "short.mp4", frames=10, fps=16)  # 10 frames: 9 train (4k+1)
    write_clip(tmp_path / "long.mp4", frames=40, fps=16)
    report = scan(tmp_path, resolutions=[64], frames=FrameSettings(frames=33, fps=16))
    assert codes(report, "warning") == {"short.mp4": "clip_short"}
    assert "trains 9 frames, not 33" in next(p.message for p in report.warnings if p.code == "clip_short")
    # Resampled to 8 fps, 40 frames are 20: too few for 33 too; at the clip's own rate it is long enough.
    assert codes(scan(tmp_path, resolutions=[64], frames=FrameSettings(fps=8)), "warning") == {
        "short.mp4": "clip_short",
        "long.mp4": "clip_short",
    }
    assert codes(scan(tmp_path, resolutions=[64], frames=FrameSettings(fps=0)), "warning") == {
        "short.mp4": "clip_short"
    }


def test_dataset_json_sets_the_frames_the_node_leaves_at_their_default(tmp_path):
    write_clip(tmp_path / "short.mp4", frames=10, fps=16)
    (tmp_path / "dataset.json").write_text(json.dumps({"frames": 9, "fps": 0}))
    assert codes(scan(tmp_path, resolutions=[64]), "warning") == {}  # 9 frames asked, 10 there
    report = scan(tmp_path, resolutions=[64], frames=FrameSettings(frames=17))  # the node's wins
    assert codes(report, "warning") == {"short.mp4": "clip_short"}
    (tmp_path / "dataset.json").write_text(json.dumps({"frames": 0, "frame_extraction": "middle"}))
    bad = scan(tmp_path, resolutions=[64])
    assert not bad.ok and {p.code for p in bad.fatal} == {"dataset_json_value"}
    assert any("'head', 'uniform', 'windows'" in p.message for p in bad.fatal)
    assert any("whole number 1..1025" in p.message for p in bad.fatal)


def test_frames_are_read_in_order_and_a_truncated_clip_fails_when_decoded(tmp_path):
    path = write_clip(tmp_path / "a.mp4", codec="mpeg4", frames=12)
    frames = read_frames(path, [0, 5, 11])
    assert sorted(frames) == [0, 5, 11] and frames[5].shape == (64, 96, 3)
    # The red level says which frame it is (10 per frame; lossy, so roughly).
    assert [round(float(frames[n][..., 0].mean()) / 10) for n in (0, 5, 11)] == [0, 5, 11]
    assert first_frame(path).shape == (64, 96, 3)
    with pytest.raises(Exception, match="ends before frame 40"):
        read_frames(path, [39])
    info = probe_clip(path)
    assert (info.frames, info.fps, info.codec) == (12, 8.0, "mpeg4")


def test_check_dataset_names_each_clip_it_cannot_use_and_counts_the_rest(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    write_clip(tmp_path / "good.mp4", frames=24, fps=16)
    truncate(write_clip(tmp_path / "cut.mp4", frames=30, options={"movflags": "faststart"}))
    write_clip(tmp_path / "blink.mp4", frames=2)
    root = Path(__file__).resolve().parents[4]
    run = [sys.executable, "-m", "trainer", "check-dataset", str(tmp_path), "--resolutions", "64", "--frames", "17"]
    result = subprocess.run(run, cwd=root, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "0 usable images and 1 clip (1.5 s)" in result.stdout
    assert "64x48x17f: 1 image: good.mp4" in result.stdout
    assert "[truncated_clip] cut.mp4: ends early" in result.stdout and "fix: copy the whole file again" in result.stdout
    assert "[clip_too_short] blink.mp4" in result.stdout
    result = subprocess.run([*run[:-1], "81"], cwd=root, capture_output=True, text=True, timeout=600)
    assert "[clip_short] good.mp4: 24 frames at 16 fps: trains 21 frames, not 81" in result.stdout


def test_the_gallery_shows_a_clips_first_frame_and_length_and_edits_its_caption(tmp_path):
    from PIL import Image

    from trainer.data.folder import editing

    folder = tmp_path / "set"
    folder.mkdir()
    write_clip(folder / "a.mp4", frames=24, fps=16)
    (folder / "broken.webm").write_bytes(b"\x1a\x45\xdf\xa3" + bytes(100))
    shown = editing.gallery(tmp_path, "set")
    clip, broken = sorted(shown["images"], key=lambda image: image["path"])
    assert (clip["frames"], clip["seconds"], clip["usable"]) == (24, 1.5, True)
    with Image.open(folder / clip["thumbnail"]) as thumb:
        assert thumb.format == "JPEG" and thumb.size == (96, 64)
        assert abs(thumb.getpixel((80, 32))[0] - 0) < 12  # frame 0: no red yet
    assert not broken["usable"] and broken["problems"][0]["code"] == "unreadable_clip"
    editing.set_caption(tmp_path, "set", "a.mp4", "a red square")
    assert (folder / "a.txt").read_text().strip() == "a red square"
