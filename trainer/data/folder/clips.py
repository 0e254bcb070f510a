"""Clips in a dataset folder (mp4, webm, mov, mkv, gif): probed, checked and decoded with PyAV.

PyAV is imported here only, inside the functions, so an image-only dataset never needs it (ComfyUI requires
it, so inside ComfyUI it is there). Every failure comes out as an ImageProblem (the scan's and the encoder's
one problem type) with a code and a fix. The fast check demuxes every packet without decoding: it catches
unreadable files, a missing video stream, files that end early (fewer frames than the header or duration
says) and a variable frame rate; `deep` decodes every frame and catches damage inside the data too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..frames import MIN_FRAMES, FrameSettings, bucket_frames, timeline_length
from .images import CLIP_FORMATS, ImageProblem
from .report import Problem
from .walk import FolderFile

PYAV_FIX = 'install PyAV: pip install "av>=14.2" (ComfyUI already has it)'
REENCODE = "re-encode it, e.g. ffmpeg -i {name} -c:v libx264 -pix_fmt yuv420p -r 16 fixed.mp4"
VFR_TOLERANCE = 0.2  # a frame interval this far from the typical one (beyond a time-base tick) is variable


@dataclass(frozen=True)
class ClipInfo:
    """What a clip's stream says, as the scan's items need it (the same names as ImageInfo's)."""

    width: int
    height: int
    format: str  # the container, e.g. "MP4"
    frames: int
    fps: float
    codec: str
    mode: str = ""
    notes: tuple[str, ...] = ()


def _av():
    try:
        import av
    except ImportError as err:
        raise ImageProblem("clip_reader_missing", "reading clips needs PyAV, which is not installed", PYAV_FIX) from err
    return av


def probe_clip(path: Path, deep: bool = False) -> ClipInfo:
    """The clip's size, frame count and rate; raises ImageProblem when it cannot train as it is."""
    av, fix = _av(), REENCODE.format(name=path.name)
    try:
        container = av.open(str(path))
    except (av.error.FFmpegError, OSError, UnicodeDecodeError) as err:
        raise ImageProblem("unreadable_clip", f"cannot open as a video: {_reason(err)}", fix) from err
    with container:
        if not container.streams.video:
            raise ImageProblem("no_video_stream", "holds no video stream", "use a file with video in it")
        stream = container.streams.video[0]
        stamps, failure = _frame_stamps(container, stream, deep)
        width, height = stream.codec_context.width, stream.codec_context.height
        expected = _expected_frames(container, stream)
        rate, codec = stream.average_rate or stream.guessed_rate, stream.codec_context.name
        time_base = float(stream.time_base or 0)
    if failure is not None or (expected and len(stamps) < expected - 1):
        said = f"the file says {expected} frames" if expected else "reading stopped early"
        raise ImageProblem(
            "truncated_clip",
            f"ends early: {len(stamps)} frames read, {said}" + (f" ({failure})" if failure else ""),
            f"copy the whole file again, or {fix}",
        )
    if not stamps:
        raise ImageProblem("unreadable_clip", "no frame could be read", fix)
    if _variable_rate(stamps, time_base):
        raise ImageProblem(
            "variable_frame_rate", "a variable frame rate: its frames are not evenly spaced in time", fix
        )
    fps = _fps(stamps, time_base) or float(rate or 0)
    return ClipInfo(width, height, CLIP_FORMATS.get(path.suffix.lower(), "video"), len(stamps), fps, codec)


def _frame_stamps(container, stream, deep: bool) -> tuple[list[int], str | None]:
    """Each frame's time stamp (sorted), and why reading stopped early (None: it read to the end)."""
    av, stamps = _av(), []
    try:
        if deep:
            stamps = [frame.pts or 0 for frame in container.decode(stream)]
        else:
            stamps = [packet.pts or 0 for packet in container.demux(stream) if packet.size]
    except av.error.FFmpegError as err:
        return sorted(stamps), _reason(err)
    return sorted(stamps), None


def _expected_frames(container, stream) -> int:
    """The frame count the header promises (mp4's sample table, else the duration × rate); 0 when unknown."""
    if stream.frames:
        return int(stream.frames)
    rate = stream.average_rate or stream.guessed_rate
    if container.duration and rate:
        return int(container.duration / 1_000_000 * float(rate) + 0.5)
    return 0


def _variable_rate(stamps: list[int], time_base: float) -> bool:
    gaps = np.diff(np.asarray(stamps, dtype=np.float64))
    if len(gaps) < 2:
        return False
    typical = float(np.median(gaps))
    # One tick of slack: a 24 fps WebM's millisecond stamps alternate 41 and 42.
    return bool(np.any(np.abs(gaps - typical) > max(1.0, VFR_TOLERANCE * typical))) or typical <= 0


def _fps(stamps: list[int], time_base: float) -> float:
    if len(stamps) < 2 or time_base <= 0:
        return 0.0
    return round((len(stamps) - 1) / ((stamps[-1] - stamps[0]) * time_base), 3)


def _reason(err: Exception) -> str:
    return str(getattr(err, "strerror", None) or err).split(":")[0].strip() or type(err).__name__


def check_clip(
    file: FolderFile, deep: bool, min_side: int, min_area: int, frames: FrameSettings
) -> tuple[ClipInfo | None, str, list[Problem]]:
    """One clip, as check_image checks an image: (info or None when skipped, sha256 of the bytes, problems)."""
    digest = hashlib.sha256()
    try:
        with open(file.path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        info = probe_clip(file.path, deep)
    except OSError as err:
        return (
            None,
            digest.hexdigest(),
            [_skipped(file, "unreadable_clip", f"cannot read: {err.strerror}", "check its permissions")],
        )
    except ImageProblem as problem:
        return None, digest.hexdigest(), [_skipped(file, problem.code, problem.message, problem.fix)]
    sha256 = digest.hexdigest()
    if min(info.width, info.height) < min_side:
        return (
            None,
            sha256,
            [
                _skipped(
                    file,
                    "too_small",
                    f"{info.width}×{info.height} px: a side is under {min_side} px",
                    "use a larger version of the clip, or delete it",
                )
            ],
        )
    length = timeline_length(info.frames, info.fps, frames.fps)
    at = f"at {frames.fps:g} fps" if frames.fps > 0 else "at its own rate"
    if length < MIN_FRAMES:
        return (
            None,
            sha256,
            [
                _skipped(
                    file,
                    "clip_too_short",
                    f"{length} frames {at} ({info.frames} at {info.fps:g} fps): a clip needs {MIN_FRAMES}",
                    "use a longer clip, lower fps (0 keeps each clip's own), or save a single frame as an image",
                )
            ],
        )
    return info, sha256, _clip_notes(file.rel, info, length, at, min_area, frames)


def _clip_notes(rel: str, info: ClipInfo, length: int, at: str, min_area: int, frames: FrameSettings) -> list[Problem]:
    """What a usable clip is told: it trains fewer frames than asked, or at a lower resolution."""
    problems, count = [], bucket_frames(info.frames, info.fps, frames)
    if count < frames.frames and length < frames.frames:
        problems.append(
            Problem(
                "clip_short",
                rel,
                f"{length} frames {at}: trains {count} frames, not {frames.frames} (never more than the clip has)",
                "use a longer clip, or lower frames on Load Dataset (or in dataset.json) to train them all alike",
                "warning",
            )
        )
    if info.width * info.height < min_area:
        side = int(min_area**0.5)
        problems.append(
            Problem(
                "below_resolution",
                rel,
                f"{info.width}×{info.height} px is under {side}×{side}: it trains at a lower resolution (never upscaled)",
                "use a larger version, or accept it as a low-resolution sample",
                "warning",
            )
        )
    return problems


def _skipped(file: FolderFile, code: str, message: str, fix: str) -> Problem:
    return Problem(code, file.rel, message, fix, "skipped")


def read_frames(path: Path, indices) -> dict[int, np.ndarray]:
    """The frames at these indices (in decode order) as uint8 [H,W,3]; raises ImageProblem if the clip
    cannot be opened or ends before the last of them."""
    av, wanted = _av(), set(indices)
    last, out = max(wanted), {}
    try:
        with av.open(str(path)) as container:
            for index, frame in enumerate(container.decode(video=0)):
                if index in wanted:
                    out[index] = frame.to_ndarray(format="rgb24")
                if index >= last:
                    break
    except (av.error.FFmpegError, OSError) as err:
        raise ImageProblem(
            "truncated_clip", f"decoding failed at frame {len(out)}: {_reason(err)}", REENCODE.format(name=path.name)
        ) from err
    if len(out) < len(wanted):
        raise ImageProblem(
            "truncated_clip",
            f"ends before frame {last + 1}",
            f"copy the whole file again, or {REENCODE.format(name=path.name)}",
        )
    return out


def first_frame(path: Path) -> np.ndarray:
    """The clip's first frame, uint8 [H,W,3] (the gallery's thumbnail)."""
    return read_frames(path, [0])[0]


def thumbnail(root: Path, rel: str, sha256: str, folder: Path) -> str:
    """The clip's first frame as a JPEG in `folder` (named by the clip's content, so written once), as a path
    relative to root ('/'-separated, for ComfyUI's /view)."""
    from PIL import Image

    path = folder / f"{sha256[:32]}.jpg"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        image = Image.fromarray(first_frame(root / rel))
        image.thumbnail((512, 512))
        partial = path.with_suffix(".part")
        image.save(partial, "JPEG", quality=88)
        partial.replace(path)  # atomic: a reader never sees half a thumbnail
    return path.relative_to(root).as_posix()
