"""A video model's validation sample: a short clip saved as an animated WebP (Pillow), which every browser's <img>
plays, so the run folder and the dashboard show it as they show a PNG sample. `<run>/samples/step-NNNNNN-pK.webp`
sits where an image model's `.png` would (trainer/samples/plan.py names both)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_bytes

CLIP_SUFFIX = ".webp"
CLIP_FPS = 16  # Wan 2.1's frame rate (ComfyUI's Wan templates save at 16 fps); a sample is a preview
DESCRIPTION_TAG = 0x010E  # EXIF ImageDescription: the A1111 `parameters` line a PNG sample carries as text


def is_clip(images) -> bool:
    """Frames [T,H,W,3] with T > 1 (a video model's sample); one frame is an image and stays a PNG."""
    return np.ndim(images) == 4 and len(images) > 1


def frames_u8(images) -> np.ndarray:
    """IMAGE frames [T,H,W,3] in 0..1 (numpy or torch on the CPU) as uint8, rounded as SaveImage does."""
    return np.clip(255.0 * np.asarray(images, dtype=np.float32), 0, 255).astype(np.uint8)


def webp_bytes(images, *, fps: int = CLIP_FPS, max_px: int | None = None, description: str = "") -> bytes:
    """Frames [T,H,W,3] in 0..1 as an animated WebP that loops; each frame scaled to fit max_px (aspect kept)."""
    from PIL import Image

    pictures = [Image.fromarray(frame) for frame in frames_u8(images)]
    if max_px:
        for picture in pictures:
            picture.thumbnail((max_px, max_px))
    exif = Image.Exif()
    if description:
        exif[DESCRIPTION_TAG] = description
    buffer = io.BytesIO()
    pictures[0].save(
        buffer,
        format="WEBP",
        save_all=True,
        append_images=pictures[1:],
        duration=round(1000 / fps),
        loop=0,
        quality=90,
        exif=exif.tobytes() if description else b"",
    )
    return buffer.getvalue()


def save_clip(path: str | Path, images, *, fps: int = CLIP_FPS, description: str = "") -> Path:
    """The clip at `path` (an animated WebP), written atomically."""
    atomic_write_bytes(path, webp_bytes(images, fps=fps, description=description))
    return Path(path)
