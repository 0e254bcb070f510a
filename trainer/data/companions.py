"""Per-image companion files that follow the image through crop, bucket and cache.

Two kinds, found by name at scan time and attached to their image's Item:

    photo.png + photo.mask.png       a loss mask beside the image (white trains, black does not); without
                                     one, the image's alpha channel is its mask (a file wins: it is made on
                                     purpose, while alpha is often left over from a cut-out or an export)
    control/photo.png (+ control_2/photo.jpg, ...)
                                     edit datasets: the reference image(s) the target `photo.png` is made
                                     from, by its caption's instruction; same path below the dataset root,
                                     any image extension (ai-toolkit's control_path layout, kept inside the
                                     dataset folder so one folder is one dataset)

A companion is resized and cropped exactly as its image is (the entry's resize and offset; a control of
another size covers the same bucket, centred), then a mask is area-averaged to the latent grid and a control
VAE-encoded; both are stored in the image's latent cache entry, whose key carries their file hashes.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image

from .buckets import Entry
from .folder.images import IMAGE_EXTENSIONS, ImageProblem, load_mask, load_rgb, probe
from .folder.report import Item, Problem

MASK_SUFFIX = ".mask"
CONTROL_FOLDER = re.compile(r"^control(?:_([2-9]|[1-9]\d))?$")  # control, control_2, ... control_99


def is_mask(rel: str) -> bool:
    """`photo.mask.png`: a mask, never a training image."""
    name = rel.rsplit("/", 1)[-1]
    stem, _, suffix = name.rpartition(".")
    return bool(stem) and f".{suffix.lower()}" in IMAGE_EXTENSIONS and stem.lower().endswith(MASK_SUFFIX)


def control_slot(rel: str) -> int | None:
    """0 for control/…, 1 for control_2/…, …; None for a file outside the control folders."""
    top = rel.split("/", 1)[0]
    match = CONTROL_FOLDER.match(top) if "/" in rel else None
    return None if match is None else int(match.group(1) or 1) - 1


def reference_count(root: str | Path) -> int:
    """Control folders at a dataset's root: the reference images each target trains with (0: no edit set)."""
    root = Path(root) if root else None
    return (
        sum(1 for p in root.iterdir() if p.is_dir() and CONTROL_FOLDER.match(p.name))
        if root is not None and root.is_dir()
        else 0
    )


def is_companion(rel: str) -> bool:
    return is_mask(rel) or control_slot(rel) is not None


def _stem(rel: str) -> str:
    return rel.rsplit(".", 1)[0]


def attach(root: Path, items: list[Item], files: list[str]) -> tuple[list[Item], list[Problem]]:
    """Items with their masks and controls attached, and the problems found (a bad mask, a missing
    control: that image is skipped, never trained without what it was given)."""
    masks = {_stem(rel)[: -len(MASK_SUFFIX)]: rel for rel in files if is_mask(rel) and control_slot(rel) is None}
    slots: dict[int, dict[str, str]] = {}
    for rel in files:
        if (slot := control_slot(rel)) is not None and Path(rel).suffix.lower() in IMAGE_EXTENSIONS:
            slots.setdefault(slot, {})[_stem(rel.split("/", 1)[1])] = rel
    problems, kept, used = [], [], set()
    for item in items:
        stem = _stem(item.path)
        mask = masks.get(stem)
        item_problems = _check_mask(root, item, mask) if mask else []
        controls = []
        for slot in sorted(slots):
            rel = slots[slot].get(stem)
            if rel is None:
                folder = "control" if slot == 0 else f"control_{slot + 1}"
                item_problems.append(
                    Problem(
                        "control_missing",
                        item.path,
                        f"no control image {folder}/{stem}.*",
                        f"add the image this target is edited from as {folder}/{stem}.png, "
                        "or move the target out of this edit dataset",
                        "skipped",
                    )
                )
            else:
                controls.append(rel)
        used |= {mask, *controls}
        if any(p.severity == "skipped" for p in item_problems):
            problems += item_problems
            continue
        problems += item_problems
        hashes = [hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in [mask or "", *controls] if rel]
        kept.append(
            replace(
                item,
                mask_file=mask,
                controls=tuple(controls),
                companions_sha256=hashlib.sha256("\n".join([mask or "", *controls, *hashes]).encode()).hexdigest()
                if hashes
                else "",
            )
        )
    for rel in sorted(set(masks.values()) | {r for s in slots.values() for r in s.values()}):
        if rel not in used:
            problems.append(
                Problem(
                    "companion_orphan",
                    rel,
                    "a mask or control image with no training image of the same name",
                    "rename it to match its image, or delete it",
                    "warning",
                )
            )
    return kept, problems


def _check_mask(root: Path, item: Item, mask: str) -> list[Problem]:
    """A mask that cannot be read or does not match its image skips the image; an all-black one warns."""
    try:
        info = probe(root / mask)
        values = load_mask(root / mask)
    except ImageProblem as err:
        return [
            Problem(
                "mask_unreadable", mask, f"the mask of {item.path} cannot be read: {err.message}", err.fix, "skipped"
            )
        ]
    if (info.width, info.height) != (item.width, item.height):
        return [
            Problem(
                "mask_size",
                mask,
                f"{info.width}×{info.height} px, but its image {item.path} is {item.width}×{item.height}",
                f"export the mask at {item.width}×{item.height} (the image's size, upright) or delete it",
                "skipped",
            )
        ]
    if values is not None and float(values.max()) == 0.0:
        return [
            Problem(
                "mask_empty",
                mask,
                f"all black: {item.path} trains only at unmasked_weight",
                "paint the part that should train white, or delete the mask",
                "warning",
            )
        ]
    return []


# --- at encode time ------------------------------------------------------------------------------


def crop_mask(mask: np.ndarray, entry: Entry) -> np.ndarray:
    """The mask resized (Lanczos, as the image) and cropped at the entry's offset → float32 [H,W] in 0..1."""
    image = Image.fromarray(mask.astype(np.float32), mode="F")
    resized = image.resize(entry.resized, Image.Resampling.LANCZOS) if image.size != entry.resized else image
    x, y = entry.offset
    box = resized.crop((x, y, x + entry.bucket[0], y + entry.bucket[1]))
    return np.clip(np.asarray(box, dtype=np.float32), 0.0, 1.0)


def to_latent_grid(mask: np.ndarray, height: int, width: int) -> np.ndarray:
    """Area average of a [H,W] mask onto the latent grid → float32 [1,h,w]."""
    pooled = Image.fromarray(mask.astype(np.float32), mode="F").resize((width, height), Image.Resampling.BOX)
    return np.clip(np.asarray(pooled, dtype=np.float32), 0.0, 1.0)[None]


def control_entry(entry: Entry, size: tuple[int, int], target_size: tuple[int, int]) -> Entry:
    """Where a control of `size` (w, h) lands in its target's bucket: a control of the target's size is
    resized and cropped exactly as the target (pixel-aligned edits); another size covers the bucket, centred."""
    if tuple(size) == tuple(target_size):
        return entry
    (bw, bh), (w, h) = entry.bucket, size
    scale = max(bw / w, bh / h)
    resized = (max(bw, round(w * scale)), max(bh, round(h * scale)))
    return replace(entry, resized=resized, offset=((resized[0] - bw) // 2, (resized[1] - bh) // 2))


ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


def companions_key(item: Item) -> str:
    """The latent cache key's companion part: mask and control hashes, and whether the image's alpha may be
    its mask ("" for a plain opaque image, whose key is unchanged)."""
    alpha = not item.mask_file and (item.mode in ALPHA_MODES or any("alpha" in note for note in item.notes))
    return item.companions_sha256 + ("|alpha-mask" if alpha else "")


# A clip's cache entry key for its start image's CLIP vision features [T,D] (Encode Images' clip_vision).
VISION = "clip_vision"


@dataclass
class Sample:
    """One entry's pixels to encode: the image, its controls (each [H,W,3] in 0..1) and its mask [H,W]."""

    pixels: np.ndarray
    controls: tuple[np.ndarray, ...] = ()
    mask: np.ndarray | None = None
    start: np.ndarray | None = None  # a clip's start-image frames [T,H,W,3] (image-to-video: start_pixels)

    def stack(self) -> list[np.ndarray]:
        """What the VAE encodes for this sample, in the order `tensors` reads the latents back."""
        return [self.pixels, *self.controls, *([] if self.start is None else [self.start])]

    def tensors(self, latents: np.ndarray, vision: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The cache entry from this sample's latents (image first, then controls, then the start image) and its
        start image's CLIP vision features."""
        out = {"latent": latents[0]}
        if self.mask is not None:
            out["mask"] = to_latent_grid(self.mask, *latents[0].shape[-2:])
        out.update({f"control.{n}": latents[1 + n] for n in range(len(self.controls))})
        if self.start is not None:
            out["start"] = latents[-1]
        if vision is not None:
            out[VISION] = vision
        return out


def start_pixels(frames: np.ndarray) -> np.ndarray:
    """A clip's start image as WanImageToVideo encodes it: its first frame, then grey (0.5) for the rest of its
    length, one VAE call of the clip's frame count [T,H,W,3]."""
    out = np.full_like(frames, 0.5)
    out[0] = frames[0]
    return out


@lru_cache(maxsize=16)  # one image's mask and controls serve every resolution it trains at
def _decoded(path: Path, kind: str, content: str):
    """content: a hash of the files' bytes, so an edited file is never served from this cache."""
    return Image.fromarray(load_rgb(path)) if kind == "rgb" else load_mask(path, alpha=kind == "alpha")


def entry_sample(root: Path, item: Item, image: Image.Image, entry: Entry, crop) -> Sample:
    """The image cropped by `crop(image, entry)`, its controls and mask cropped the same way. Raises
    ImageProblem naming the companion file that cannot be decoded."""
    controls = []
    for rel in item.controls:
        control = _named(rel, lambda rel=rel: _decoded(root / rel, "rgb", item.companions_sha256))
        controls.append(crop(control, control_entry(entry, control.size, (item.width, item.height))))
    if item.mask_file:
        mask = _named(item.mask_file, lambda: _decoded(root / item.mask_file, "file", item.companions_sha256))
    else:
        alpha = (
            _decoded(root / item.path, "alpha", item.sha256) if companions_key(item).endswith("alpha-mask") else None
        )
        mask = None if alpha is None or float(alpha.min()) >= 1.0 else alpha
    return Sample(crop(image, entry), tuple(controls), None if mask is None else crop_mask(mask, entry))


def _named(rel: str, load):
    try:
        return load()
    except ImageProblem as err:
        raise ImageProblem(err.code, f"{rel}: {err.message}", err.fix) from err
