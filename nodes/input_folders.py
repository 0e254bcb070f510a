"""The dataset folder a node names: a folder under ComfyUI's input/ directory, or an absolute path."""

from __future__ import annotations

import os
from pathlib import Path

from ..trainer.errors import did_you_mean
from .comfy import bridge


def resolve_folder(folder: str, node: str = "Kiln Load Dataset") -> Path:
    """An absolute path, or a folder under ComfyUI's input/ directory."""
    text = (folder or "").strip()
    if not text:
        raise ValueError(
            f"{node}: set `folder` to a folder of images with .txt captions "
            "(a name under ComfyUI's input/ folder, or an absolute path)"
        )
    path = Path(os.path.expanduser(text))
    inputs, relative = Path(bridge.folders()["input"]), not path.is_absolute()
    if relative:
        path = inputs / path
    if not path.is_dir():
        hint = did_you_mean(text, input_folders(inputs)) if relative else ""
        raise ValueError(
            f"{node}: {path} is not a folder{hint}; put your images in {inputs / 'my_dataset'} or give an absolute path"
        )
    return path


def input_folders(inputs: Path) -> list[str]:
    """The folders under input/ and one level below ("people/anna"), for a "did you mean" (names only, no scan)."""
    found: list[str] = []
    if not inputs.is_dir():
        return found
    for child in sorted(p for p in inputs.iterdir() if p.is_dir() and not p.name.startswith(".")):
        found.append(child.name)
        found += [
            f"{child.name}/{g.name}" for g in sorted(child.iterdir()) if g.is_dir() and not g.name.startswith(".")
        ]
    return found
