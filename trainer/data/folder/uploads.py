"""Images uploaded into a dataset folder (the dataset editor's drag and drop), checked as the dataset
scan checks files (trainer/data/folder/images.py): the bytes are streamed to a hidden temp file in the folder
with a size cap, the whole image is decoded (its type read from its content, not its name; past
MAX_PIXELS or PIL's decompression-bomb limit it is refused before any pixel is decoded), and only then
is it renamed to its place, with the extension of what it really is. A refused upload leaves nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path, PurePosixPath

from ...atomic import fsync_dir
from .editing import EditError, check_component, free_name
from .images import ImageProblem, verify
from .scan import EXTENSION_OF

MAX_UPLOAD_BYTES = 100 * 2**20  # an 8192×8192 PNG stays under it; ComfyUI's own upload limit is 100 MB too
# ImageProblem code → HTTP status of the refusal.
UPLOAD_STATUS = {"too_large": 413, "not_an_image": 415, "unsupported_format": 415}


def upload_stem(filename: str) -> str:
    """A safe file stem from a client's file name: its last component, odd characters made '_'."""
    name = PurePosixPath(str(filename or "").replace("\\", "/")).name
    stem = re.sub(r'[\x00-\x1f\x7f/\\:*?"<>|]', "_", name.rsplit(".", 1)[0] if "." in name else name)
    stem = stem.strip(" .")[:100] or "image"
    return check_component(stem, "file name")


async def receive(folder: Path, filename: str, chunks: AsyncIterator[bytes], max_bytes: int = MAX_UPLOAD_BYTES) -> dict:
    """Stream one upload into `folder` (a checked dataset folder) and keep it if it is a usable image:
    {"path", "width", "height", "format"}; EditError(413/415/422) naming the file and the fix otherwise."""
    stem = upload_stem(filename)
    fd, tmp = tempfile.mkstemp(prefix=".upload-", suffix=".tmp", dir=folder)
    try:
        size = 0
        with os.fdopen(fd, "wb") as handle:
            async for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise EditError(
                        413,
                        f"{filename}: larger than {max_bytes // 2**20} MiB; downscale it "
                        "(training never needs more than 8192 px a side) and upload it again",
                    )
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        info = await asyncio.to_thread(_check, Path(tmp), filename)
        target = free_name(folder / f"{stem}.{EXTENSION_OF.get(info.format, 'jpg')}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
        fsync_dir(folder)
        return {"path": target.name, "width": info.width, "height": info.height, "format": info.format}
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _check(path: Path, filename: str):
    try:
        return verify(path)
    except ImageProblem as problem:
        raise EditError(
            UPLOAD_STATUS.get(problem.code, 422), f"{filename}: {problem.message}; {problem.fix}"
        ) from problem
