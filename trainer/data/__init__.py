"""Training data as the loop sees it: cached latents and text embeddings, grouped in buckets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import KilnError


class DatasetError(KilnError):
    """The dataset cannot train: the message names the folder, the problems and the fixes."""


class TrainingData(Protocol):
    buckets: dict[str, list[int]]  # bucket key ("WxH") -> item indices (repeats included)

    def latent(self, index: int) -> np.ndarray: ...  # [C,H,W] float32
    def variants(self, index: int) -> int: ...  # caption variants (shuffled tags) cached for the item
    def context(self, index: int, variant: int = 0) -> np.ndarray: ...  # [T,D] float32
    def empty_context(self) -> np.ndarray: ...  # [T,D]: the empty caption, for caption dropout
    def name(self, index: int) -> str: ...  # the image's file name, for messages
    def mask(self, index: int) -> np.ndarray | None: ...  # [1,H,W] loss mask in 0..1, None: unmasked
    def controls(self, index: int) -> list[np.ndarray]: ...  # edit items: raw control latents [C,h,w]


@dataclass
class InMemoryData:
    """Latents and embeddings held in memory (the demo, tests, small runs)."""

    latents: list[np.ndarray]
    contexts: list[np.ndarray]
    names: list[str]
    empty: np.ndarray
    buckets: dict[str, list[int]]
    masks: list[np.ndarray | None] | None = None  # per item [1,H,W], for masked training
    control_latents: list[list[np.ndarray]] | None = None  # per item, for edit training

    @classmethod
    def from_arrays(cls, latents, contexts, names, empty, repeats: int = 1) -> "InMemoryData":
        buckets: dict[str, list[int]] = {}
        for index, latent in enumerate(latents):
            key = f"{latent.shape[-1]}x{latent.shape[-2]}" + (f"x{latent.shape[1]}t" if latent.ndim == 4 else "")
            buckets.setdefault(key, []).extend([index] * repeats)
        return cls(list(latents), list(contexts), list(names), empty, buckets)

    def latent(self, index: int) -> np.ndarray:
        return self.latents[index]

    def variants(self, index: int) -> int:
        return 1

    def context(self, index: int, variant: int = 0) -> np.ndarray:
        return self.contexts[index]

    def empty_context(self) -> np.ndarray:
        return self.empty

    def name(self, index: int) -> str:
        return self.names[index]

    def mask(self, index: int) -> np.ndarray | None:
        return self.masks[index] if self.masks else None

    def controls(self, index: int) -> list[np.ndarray]:
        return self.control_latents[index] if self.control_latents else []


class MappedLatents:
    """TrainingData whose latents pass through `fn` as they are read (a model's latent format:
    caches hold raw VAE latents, so one cache serves every model that shares the VAE). Control latents
    stay raw: ComfyUI's extra_conds puts reference latents through the format itself."""

    def __init__(self, data: TrainingData, fn):
        self.data, self.fn = data, fn

    def __getattr__(self, name):
        return getattr(self.data, name)

    def latent(self, index: int) -> np.ndarray:
        return self.fn(self.data.latent(index))
