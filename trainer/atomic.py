"""Atomic file writes: temp file in the same folder, fsync, rename, fsync the folder.

A crash or a full disk leaves either the old file or the new one, never half of one.
Free space is checked before a write starts (`require_free_space`), so a full disk
gives an error that names the folder and the fix instead of a torn write.

Test-only crash hook: with KILN_FAULT set to a glob, `fault_point(label)` kills the
process (SIGKILL, as a power cut or the OOM killer would) where `label` matches.
Labels: "write:<path>" (the file's bytes are in its temp file, not yet renamed) and
"checkpoint:<step>:<stage>" (trainer/run/state.py). tests/trainer/run/test_kill.py drives it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import IO, Callable

FAULT_ENV = "KILN_FAULT"
SPARE_BYTES = 1 << 20  # headroom over a write's own size: file-system blocks, metadata, the folder entry


class NotEnoughSpace(RuntimeError):
    """The disk cannot hold a file or checkpoint; the message names the folder, the bytes and the fix."""


def fault_point(label: str) -> None:
    """SIGKILL this process here when KILN_FAULT matches `label` (tests only; unset, this does nothing)."""
    pattern = os.environ.get(FAULT_ENV)
    if pattern and fnmatch.fnmatchcase(label, pattern):
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))


def _size(count: int) -> str:
    """1,444 bytes; 52,428,800 bytes (50.0 MiB); 3,221,225,472 bytes (3.0 GiB)."""
    if count < 2**20:
        return f"{count:,} bytes"
    return (
        f"{count:,} bytes ({count / 2**30:.1f} GiB)" if count >= 2**30 else f"{count:,} bytes ({count / 2**20:.1f} MiB)"
    )


def require_free_space(folder: str | Path, needed: int, what: str, fix: str) -> None:
    """Raise NotEnoughSpace unless `folder`'s disk has `needed` bytes plus headroom free."""
    folder = Path(folder)
    probe = folder
    while not probe.exists() and probe.parent != probe:  # a folder not made yet: its disk is its parent's
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return  # no figure to check against (some network mounts): the write itself will say
    if free < needed + SPARE_BYTES:
        raise NotEnoughSpace(
            f"{folder}: {what} needs {_size(needed)} but the disk has {_size(free)} free "
            f"(and {SPARE_BYTES >> 20} MiB is kept spare); {fix}"
        )


def fsync_dir(folder: Path) -> None:
    """Make a rename durable (no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call write(file) on a temp file, then move it over `path` in one step."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; give a file name inside it (e.g. {path / 'lora.safetensors'})")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            # mkstemp makes the file 0600; give it the old file's mode, or the usual 0644.
            os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else 0o644)
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        fault_point(f"write:{path}")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write(path, lambda handle: handle.write(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
