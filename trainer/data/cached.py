"""The training data a Dataset's caches give the loop: latents and embeddings read on demand, held in an LRU
under a memory budget."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from . import DatasetError
from .cache import text_key
from .companions import VISION
from .text_conds import CONTEXT, others


class CachedData:
    """TrainingData over a Dataset's caches, with the latents and embeddings it read held in an LRU."""

    def __init__(self, dataset, memory_budget: int):  # dataset: a Dataset (dataset.py imports this module)
        self.dataset, self.cache = dataset, dataset.cache
        entries, items = dataset.plan.entries, dataset.report.items
        usable = set(dataset.usable_entries())
        repeats = [item.repeats * dataset.settings.repeats for item in items]
        self.buckets = {
            key: [n for n in indices if n in usable] for key, indices in dataset.plan.buckets(repeats).items()
        }
        self.buckets = {k: v for k, v in self.buckets.items() if v}
        self.entries, self.items = entries, items
        self.skipped = dataset.skipped
        self._memory: OrderedDict[str, np.ndarray] = OrderedDict()
        self._budget, self._held = memory_budget, 0

    def _read_all(self, kind: str, key: str, name: str, what: str) -> dict[str, np.ndarray]:
        if key in self._memory:
            self._memory.move_to_end(key)
            return self._memory[key]
        tensors = self.cache.get(kind, key)
        if tensors is None:
            raise DatasetError(
                f"the {what} for {name!r} is missing from the cache {self.cache.root} "
                "(deleted while training?): run the encode nodes again"
            )
        self._memory[key] = tensors
        self._held += sum(array.nbytes for array in tensors.values())
        while self._held > self._budget and len(self._memory) > 1:
            _, old = self._memory.popitem(last=False)
            self._held -= sum(array.nbytes for array in old.values())
        return tensors

    def _text(self, text: str, what: str) -> dict[str, np.ndarray]:
        return self._read_all("text", text_key(text, self.dataset.text_identity), text, what)

    def _entry(self, index: int) -> dict[str, np.ndarray]:
        entry = self.entries[index]
        return self._read_all("latents", self.dataset.entry_key(entry), self.items[entry.item].path, "latent")

    def latent(self, index: int) -> np.ndarray:
        return self._entry(index)["latent"]

    def mask(self, index: int) -> np.ndarray | None:
        """[1,h,w] in 0..1 on the latent grid, or None: the image has no mask."""
        return self._entry(index).get("mask")

    def controls(self, index: int) -> list[np.ndarray]:
        """The control images' raw VAE latents [C,h,w], in control-folder order (empty: not an edit item)."""
        tensors = self._entry(index)
        return [tensors[f"control.{n}"] for n in range(len(self.items[self.entries[index].item].controls))]

    def start(self, index: int) -> np.ndarray | None:
        """A clip's start image [C,t,h,w] (raw VAE latents; Encode Images' start_images), else None."""
        return self._entry(index).get("start")

    def clip_vision(self, index: int) -> np.ndarray | None:
        """A clip's start image's CLIP vision features [T,D] (Encode Images' clip_vision), else None."""
        return self._entry(index).get(VISION)

    def variants(self, index: int) -> int:
        return len(self.dataset.captions[self.entries[index].item])

    def _caption(self, index: int, variant: int) -> str:
        return self.dataset.captions[self.entries[index].item][variant]

    def context(self, index: int, variant: int = 0) -> np.ndarray:
        return self._text(self._caption(index, variant), "text embedding")[CONTEXT]

    def empty_context(self) -> np.ndarray:
        return self._text("", "empty-caption embedding")[CONTEXT]

    def conds(self, index: int, variant: int = 0) -> dict[str, np.ndarray]:
        """The caption's conditioning beside its embedding (SD 3.5's pooled output; {} for most encoders)."""
        return others(self._text(self._caption(index, variant), "text embedding"))

    def empty_conds(self) -> dict[str, np.ndarray]:
        return others(self._text("", "empty-caption embedding"))

    def name(self, index: int) -> str:
        return self.items[self.entries[index].item].path

    def _class_caption(self, index: int, variant: int) -> str | None:
        captions = self.dataset.preservation_captions()
        return captions[self.entries[index].item][variant] if captions else None

    def preservation_context(self, index: int, variant: int = 0) -> np.ndarray | None:
        """DOP: the embedding of the caption with the class word for the trigger word; None when off."""
        text = self._class_caption(index, variant)
        return None if text is None else self._text(text, "class-word caption embedding")[CONTEXT]

    def preservation_conds(self, index: int, variant: int = 0) -> dict[str, np.ndarray]:
        text = self._class_caption(index, variant)
        return {} if text is None else others(self._text(text, "class-word caption embedding"))

    def caption(self, index: int, variant: int = 0) -> str:
        return self.dataset.captions[self.entries[index].item][variant]
