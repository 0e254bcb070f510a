"""Small real clips for the tests, written with PyAV (and Pillow for GIFs): each frame differs, so a test can
tell which frames were taken."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def frame(index: int, width: int, height: int) -> np.ndarray:
    """Frame `index`: its red level says which frame it is (10 per frame), a green bar grows across it."""
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[..., 0] = min(255, index * 10)
    pixels[:, : min(width, index * 4), 1] = 200
    return pixels


def write_clip(
    path: Path, codec: str = "libx264", frames: int = 20, fps: int = 8, size=(96, 64), pts=None, options=None
) -> Path:
    """A clip of `frames` frames; pts (in 1/fps units) gives each frame's time stamp (a variable rate)."""
    import av

    with av.open(str(path), "w", options=options or {}) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        stream.bit_rate = 4_000_000  # near-lossless: a test reads which frame it got from its red level
        for index in range(frames):
            video_frame = av.VideoFrame.from_ndarray(frame(index, *size), format="rgb24")
            if pts is not None:
                video_frame.pts = pts[index]
            for packet in stream.encode(video_frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_gif(path: Path, frames: int = 12, size=(96, 64), durations=None) -> Path:
    from PIL import Image

    images = [Image.fromarray(frame(index, *size)) for index in range(frames)]
    images[0].save(path, save_all=True, append_images=images[1:], duration=durations or 100, loop=0)
    return path


def truncate(path: Path, keep: float = 0.6) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path
