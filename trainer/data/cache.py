"""On-disk caches of VAE latents and text embeddings: safetensors files named by content keys.

A latent's key hashes the image's content hash, its bucket, resize and crop,
and the VAE's identity; a text embedding's key hashes the caption text and the
encoder's identity. Change the image, the caption or the encoder and the key
changes, so a stale entry is never read (it just ages out). Files are written
atomically; one that fails to read (a torn copy, a disk error) is deleted and
recomputed. Reads touch the file's mtime, so pruning to a size limit removes
the least recently used entries first.

    <cache>/latents/ab/abcdef….safetensors   {"latent": [C,h,w]} (+ "mask": [1,h,w] and "control.N":
                                             [C,h',w'] where the image has them; data/companions.py);
                                             a clip's window: {"latent": [C,t,h,w]}, t = (T-1)/4+1
    <cache>/text/ab/abcdef….safetensors      {"context": [T,D]} in bf16 (text encoders run in bf16,
                                             and Flux2 Klein's 512×7680 rows are 15 MB each in fp32),
                                             + the encoder's other conditioning ("pooled_output": [P], …;
                                             data/text_conds.py)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import safetensors_io

KINDS = ("latents", "text")
KEY = re.compile(r"[0-9a-f]{16,128}")


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, separators=(",", ":")).encode()).hexdigest()


def latent_key(image_sha256: str, bucket, resized, offset, vae_identity: str, companions: str = "", frames=()) -> str:
    """companions: what else the entry holds (a mask, control latents; data/companions.py), "" for none;
    frames: a clip's window (its source frame indices), () for an image. An entry of a plain image keeps
    the key it always had."""
    parts = ("latent", image_sha256, list(bucket), list(resized), list(offset), vae_identity)
    if frames:
        return _digest(*parts, companions, list(frames))
    return _digest(*parts, companions) if companions else _digest(*parts)


def text_key(caption: str, encoder_identity: str) -> str:
    return _digest("text", caption, encoder_identity)


@dataclass
class Usage:
    files: int
    bytes: int

    def __str__(self) -> str:
        return f"{self.files} files, {self.bytes / 2**20:.1f} MiB"


class Cache:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, kind: str, key: str) -> Path:
        if kind not in KINDS:
            raise ValueError(f"cache kind must be one of {KINDS}, got {kind!r}")
        if not isinstance(key, str) or not KEY.fullmatch(key):
            raise ValueError(
                f"{self.root}: cache key {key!r} is not a hex digest; make keys with latent_key or "
                "text_key (a key is never a path)"
            )
        return self.root / kind / key[:2] / f"{key}.safetensors"

    def get(self, kind: str, key: str) -> dict[str, np.ndarray] | None:
        path = self.path(kind, key)
        if not path.is_file():
            return None
        try:
            tensors, _ = safetensors_io.read(path)
        except (safetensors_io.SafetensorsError, OSError, ValueError):
            path.unlink(missing_ok=True)  # torn or damaged: recompute rather than fail the run
            return None
        try:
            os.utime(path)
        except OSError:
            pass  # a read-only cache still serves hits
        return tensors

    def has(self, kind: str, key: str) -> bool:
        return self.path(kind, key).is_file()

    def put(
        self,
        kind: str,
        key: str,
        tensors: dict[str, np.ndarray],
        metadata: dict[str, str] | None = None,
        dtype: str = "F32",
    ) -> Path:
        path = self.path(kind, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        safetensors_io.write(
            path,
            {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
            metadata=metadata or {},
            dtype=dtype,
        )
        return path

    def files(self) -> list[Path]:
        """Cache entries; a linked fan-out folder is not followed, so pruning never deletes outside the cache."""
        return sorted(
            p
            for kind in KINDS
            if (self.root / kind).is_dir()
            for p in (self.root / kind).glob("*/*.safetensors")
            if not p.parent.is_symlink()
        )

    def usage(self) -> Usage:
        sizes = [p.stat().st_size for p in self.files()]
        return Usage(len(sizes), sum(sizes))

    def prune(self, max_bytes: int, keep: set[Path] | frozenset = frozenset()) -> Usage:
        """Delete least recently used entries (never those in `keep`) until the cache fits; returns what was removed."""
        entries = sorted(((p.stat().st_mtime, p.stat().st_size, p) for p in self.files()), key=lambda e: e[0])
        total = sum(size for _, size, _ in entries)
        removed = Usage(0, 0)
        for _, size, path in entries:
            if total <= max_bytes:
                break
            if path in keep:
                continue
            path.unlink(missing_ok=True)
            total -= size
            removed = Usage(removed.files + 1, removed.bytes + size)
        for kind in KINDS:  # drop emptied fan-out folders
            for folder in sorted((self.root / kind).glob("*")) if (self.root / kind).is_dir() else []:
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
        return removed

    def clear(self) -> Usage:
        return self.prune(0)
