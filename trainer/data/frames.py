"""Which frames of a clip train: its timeline at the target frame rate, the frame bucket (Wan's 4k+1) and
the windows taken from it (frame_extraction). Plain arithmetic on frame counts: nothing here reads a file.

A clip of n frames at `source` fps, resampled to `target` fps, is a timeline of positions 0..m-1, position j
showing source frame floor(j·source/target) (the frame on screen at time j/target; constant-rate clips
only, the scan skips the others). Each window is a tuple of source frame indices, `frames` long.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

MIN_FRAMES = 5  # the shortest clip that is a clip to Wan (1 + 4); a single frame is an image
DEFAULT_FRAMES = 33
DEFAULT_FPS = 16.0  # Wan 2.1's rate (musubi-tuner's default target_fps)
DEFAULT_WINDOWS = 3


@dataclass(frozen=True)
class FrameSettings:
    """How clips train; images ignore it. A setting left at its default takes dataset.json's value."""

    frames: int = DEFAULT_FRAMES  # target frame count, snapped down to 4k+1
    fps: float = DEFAULT_FPS  # resample to this rate; 0 = each clip's own
    extraction: str = "head"  # FRAME_EXTRACTION
    windows: int = DEFAULT_WINDOWS  # windows per clip when extraction is "windows"

    def with_meta(self, meta) -> FrameSettings:
        """dataset.json's frames, fps, frame_extraction, frame_windows where these are at their defaults."""
        defaults, values = FrameSettings(), {}
        for name, key in (
            ("frames", "frames"),
            ("fps", "fps"),
            ("extraction", "frame_extraction"),
            ("windows", "frame_windows"),
        ):
            given = getattr(meta, key, None)
            if given is not None and getattr(self, name) == getattr(defaults, name):
                values[name] = given
        return dataclasses.replace(self, **values)


def snap(count: int) -> int:
    """The largest 4k+1 not above count (Wan's VAE packs 4 frames into one latent frame after the first)."""
    return max(1, (count - 1) // 4 * 4 + 1)


def timeline_length(frames: int, source_fps: float, target_fps: float) -> int:
    """Positions of a clip of `frames` frames at `source_fps` seen at `target_fps` (0: its own rate)."""
    if target_fps <= 0 or source_fps <= 0:
        return frames
    return max(1, math.ceil(frames * target_fps / source_fps - 1e-9))


def bucket_frames(frames: int, source_fps: float, settings: FrameSettings) -> int:
    """A clip's frame bucket: the target count, never more frames than the clip has, as 4k+1."""
    return snap(min(snap(settings.frames), timeline_length(frames, source_fps, settings.fps)))


def _head(length: int, count: int, windows: int) -> list[list[int]]:
    return [list(range(count))]


def _uniform(length: int, count: int, windows: int) -> list[list[int]]:
    return [[round(i * (length - 1) / max(1, count - 1)) for i in range(count)]]


def _windows(length: int, count: int, windows: int) -> list[list[int]]:
    spare, starts = length - count, []
    for i in range(windows):
        start = round(i * spare / max(1, windows - 1)) if windows > 1 else 0
        if start not in starts:
            starts.append(start)
    return [list(range(start, start + count)) for start in starts]


# How the positions of each window are taken from a clip's timeline of `length` (count frames per window):
#   head:    the first `count` positions (musubi-tuner's "head")
#   uniform: `count` positions spread over the whole clip, first to last (ai-toolkit's num_frames sampling;
#            musubi-tuner has no equal: its "uniform" is our "windows")
#   windows: `windows` runs of `count` consecutive positions, their starts evenly spread from the first to the
#            last possible (musubi-tuner's "uniform" with frame_sample = windows; equal to its "chunk" when
#            windows × count is the clip's length, and to its "slide" with stride (length − count)/(windows − 1))
FRAME_EXTRACTION: dict[str, Callable[[int, int, int], list[list[int]]]] = {
    "head": _head,
    "uniform": _uniform,
    "windows": _windows,
}


def clip_windows(frames: int, source_fps: float, settings: FrameSettings) -> list[tuple[int, ...]]:
    """Each window of a clip as its source frame indices; every window has the clip's bucket_frames."""
    length = timeline_length(frames, source_fps, settings.fps)
    count = bucket_frames(frames, source_fps, settings)
    step = source_fps / settings.fps if settings.fps > 0 and source_fps > 0 else 1.0
    pick = FRAME_EXTRACTION[settings.extraction]
    return [
        tuple(min(frames - 1, int(position * step + 1e-9)) for position in window)
        for window in pick(length, count, settings.windows)
    ]
