"""Training data with regularisation images beside it (prior preservation: kohya's reg images, ai-toolkit's
`is_reg` datasets).

The regularisation set's items join the training set's index space after its last index, in buckets of
their own (`reg/<WxH>`). So one seeded BucketSampler plans both: each epoch draws every training image
(times its repeats) and every regularisation image (times reg_repeats) once, a batch never mixes the two,
and a run's cursor resumes both exactly. Why batches of their own rather than mixed rows (ai-toolkit mixes
its datasets in one loader): a batch is then all one kind, so its loss figure says which it was, a
regularisation batch never pays for differential output preservation's extra forward, and with batch
size 1 the two rules are the same anyway. Their loss is weighted by reg_weight (loop: preservation.py).
"""

from __future__ import annotations

import numpy as np

from . import DatasetError, TrainingData
from .text_conds import read

PREFIX = "reg/"  # bucket keys and image names of the regularisation set


class RegularisedData:
    """TrainingData over a training set and a regularisation set (indices from `offset` on)."""

    def __init__(self, main: TrainingData, reg: TrainingData):
        self.main, self.reg = main, reg
        self.offset = 1 + max((i for indices in main.buckets.values() for i in indices), default=-1)
        self.buckets = {
            **main.buckets,
            **{PREFIX + key: [i + self.offset for i in indices] for key, indices in reg.buckets.items()},
        }
        self.skipped = [*getattr(main, "skipped", []), *getattr(reg, "skipped", [])]

    @classmethod
    def of(cls, dataset, main: TrainingData, memory_budget: int) -> RegularisedData:
        """A Dataset's cached data with its regularisation Dataset's; both encoded by the same VAE and text
        encoder (the model sees one latent format and one embedding width)."""
        reg = dataset.regularisation
        for what, ours, theirs in (
            ("Encode Images (VAE)", dataset.latent_identity, reg.latent_identity),
            ("Encode Captions (text encoder)", dataset.text_identity, reg.text_identity),
        ):
            if theirs is not None and ours != theirs:
                raise DatasetError(
                    f"regularisation dataset {reg.report.root}: encoded by another {what} than the "
                    f"training dataset {dataset.report.root}; encode both with the model's own"
                )
        return cls(main, reg.training_data(memory_budget))

    def _source(self, index: int) -> tuple[TrainingData, int]:
        return (self.reg, index - self.offset) if index >= self.offset else (self.main, index)

    def is_regularisation(self, index: int) -> bool:
        return index >= self.offset

    def latent(self, index: int) -> np.ndarray:
        data, own = self._source(index)
        return data.latent(own)

    def mask(self, index: int) -> np.ndarray | None:
        data, own = self._source(index)
        return data.mask(own)

    def controls(self, index: int) -> list[np.ndarray]:
        data, own = self._source(index)
        return data.controls(own)

    def start(self, index: int) -> np.ndarray | None:
        data, own = self._source(index)
        read_start = getattr(data, "start", None)
        return read_start(own) if read_start is not None else None

    def clip_vision(self, index: int) -> np.ndarray | None:
        data, own = self._source(index)
        read_vision = getattr(data, "clip_vision", None)
        return read_vision(own) if read_vision is not None else None

    def variants(self, index: int) -> int:
        data, own = self._source(index)
        return data.variants(own)

    def context(self, index: int, variant: int = 0) -> np.ndarray:
        data, own = self._source(index)
        return data.context(own, variant)

    def empty_context(self) -> np.ndarray:
        return self.main.empty_context()

    def conds(self, index: int, variant: int = 0) -> dict[str, np.ndarray]:
        data, own = self._source(index)
        return read(data, "conds", own, variant)

    def empty_conds(self) -> dict[str, np.ndarray]:
        return read(self.main, "empty_conds")

    def name(self, index: int) -> str:
        data, own = self._source(index)
        return (PREFIX if data is self.reg else "") + data.name(own)

    def preservation_context(self, index: int, variant: int = 0) -> np.ndarray | None:
        """DOP's class-word caption: the training set's only (a regularisation image has no trigger word)."""
        if self.is_regularisation(index):
            return None
        read_context = getattr(self.main, "preservation_context", None)
        return read_context(index, variant) if read_context is not None else None

    def preservation_conds(self, index: int, variant: int = 0) -> dict[str, np.ndarray]:
        return {} if self.is_regularisation(index) else read(self.main, "preservation_conds", index, variant)


def regularisation_settings(cfg, settings):
    """A regularisation folder's DataSettings (headless): the training set's buckets and crop, reg_repeats, and
    captions of their own: no trigger word, prefix or suffix; an image without a .txt is the class word."""
    import dataclasses

    from .captions import CaptionSettings

    captions = CaptionSettings(
        default_caption=cfg.preservation_class,
        shuffle_tags=cfg.shuffle_tags,
        keep_tags=cfg.keep_tags,
        variants=cfg.caption_variants,
    )
    return dataclasses.replace(settings, repeats=cfg.reg_repeats, captions=captions)
