"""Preservation: what keeps a LoRA from bleeding into everything its class can show.

Differential output preservation (DOP, ai-toolkit's `diff_output_preservation`): each training row's
caption also comes with the trigger word replaced by a class word ("ohwx, a man" → "person, a man").
On the same x_t and σ, the base model (LoRA off, no grad) predicts for that caption; that prediction is
the target of the LoRA's own prediction for it. The step's loss becomes

    mean_b w_b·|v_θ(x_t, c_b) − v|² + mean_b p_b·|v_θ(x_t, c'_b) − sg(v_0(x_t, c'_b))|²

with p_b = preservation_weight on training rows (0 on regularisation rows) and |·|² the per-sample mean.
The backend runs v_0 as one forward without grad and both v_θ terms as one forward of twice the batch
(the rows, then their class-word rows): one backward, one all-reduce under torchrun.

Prior preservation with regularisation images (data/regularised.py): their batches' loss weights are
multiplied by reg_weight. Nothing here draws random numbers, so a run's draws and resume are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..archs import Arch, get_arch
from ..config import ConfigError, TrainConfig
from ..data import text_conds


@dataclass
class Preservation:
    """A micro-batch's DOP inputs (Batch.preservation). Shapes: B rows, T/T' tokens, D width."""

    context: np.ndarray  # [B,T,D] the class-word captions, collated: the base model's forward
    extras: dict  # arch model_extras for those rows
    joint_context: np.ndarray  # [2B,T',D] the rows' captions, then their class-word captions
    joint_extras: dict
    weights: np.ndarray  # [B] float32: preservation_weight per row (0 on regularisation rows)


@dataclass(frozen=True)
class Settings:
    weight: float = 0.0  # preservation_weight; 0: no DOP
    reg_weight: float = 1.0


OFF = Settings()


def settings(cfg: TrainConfig, data) -> Settings:
    """The run's preservation settings, checked against what the data holds (class-word embeddings cached,
    a regularisation set when the config names one)."""
    has_reg = hasattr(data, "is_regularisation")
    if cfg.reg_dataset_dir and not has_reg:
        raise ConfigError(
            f"reg_dataset_dir {cfg.reg_dataset_dir!r}: the training data has no regularisation set; "
            "connect the encoded regularisation dataset to Train LoRA's reg_dataset input (headless: "
            "the folder is loaded for you)"
        )
    if has_reg and not cfg.reg_dataset_dir:
        raise ConfigError(
            "the training data has a regularisation set but reg_dataset_dir is empty; set it to the "
            "regularisation folder (the run's record and its resume check need it)"
        )
    if cfg.preservation_weight > 0:
        first = next(
            i for indices in data.buckets.values() for i in indices if not (has_reg and data.is_regularisation(i))
        )
        read = getattr(data, "preservation_context", None)
        if read is None or read(first) is None:
            raise ConfigError(
                f"preservation_weight {cfg.preservation_weight:g} needs the class-word captions "
                f"({cfg.preservation_class!r}) encoded: set preservation_class on Kiln Encode "
                "Captions (headless: in the config), or set preservation_weight to 0"
            )
    return Settings(weight=cfg.preservation_weight, reg_weight=cfg.reg_weight)


def complete(
    batch,
    data,
    indices: list[int],
    variants: list[int],
    contexts: list[np.ndarray],
    scale: float,
    arch: Arch,
    chosen: Settings,
    conds: list[dict] | None = None,
):
    """A Batch with the regularisation weight on its rows and, with DOP on, its Preservation inputs.
    `indices`, `variants`, `contexts` and `conds` (the captions' other conditioning; caption dropout applied)
    are this rank's rows; `scale` their loss scale under torchrun (1 alone)."""
    is_reg = getattr(data, "is_regularisation", None)
    reg = [bool(is_reg(i)) if is_reg is not None else False for i in indices]
    if any(reg):
        batch.weights = (batch.weights * np.where(reg, chosen.reg_weight, 1.0)).astype(np.float32)
    if chosen.weight <= 0 or all(reg):
        return batch
    kept = [
        contexts[row] if reg[row] else data.preservation_context(i, v)
        for row, (i, v) in enumerate(zip(indices, variants))
    ]
    conds = conds or [{} for _ in indices]
    kept_conds = [
        conds[row] if reg[row] else text_conds.read(data, "preservation_conds", i, v)
        for row, (i, v) in enumerate(zip(indices, variants))
    ]
    rows, lengths, names = len(indices), [c.shape[0] for c in kept], batch.items
    batch.preservation = Preservation(
        context=arch.collate_context(kept),
        extras={**arch.model_extras(rows, lengths), **text_conds.stacked(kept_conds, names)},
        joint_context=arch.collate_context(list(contexts) + kept),
        joint_extras={
            **arch.model_extras(2 * rows, [c.shape[0] for c in contexts] + lengths),
            **text_conds.stacked(list(conds) + kept_conds, names),
        },
        weights=(np.where(reg, 0.0, chosen.weight) * scale).astype(np.float32),
    )
    return batch


def encoded_datasets(
    cfg: TrainConfig,
    settings,
    folder: str | Path,
    image_encoder: tuple,
    text_encoder: tuple,
    cache_dir: str | Path | None = None,
):
    """A headless run's Dataset (`train`, the demo) with latents and captions cached: DOP's class-word captions
    too (when on), and the regularisation folder beside it (when given), with its own repeats and captions.
    Each encoder is (function, identity), as Dataset.encode_images / encode_captions take them."""
    from ..data.dataset import Dataset
    from ..data.regularised import regularisation_settings

    dataset = Dataset.load(folder, settings, cache_dir=cache_dir)
    if cfg.preservation_weight > 0:
        dataset = dataset.with_preservation(cfg.preservation_class)
    start = get_arch(cfg.arch).start_image  # image-to-video: each clip's start image (data/companion_batch.py)
    dataset = dataset.encode_images(*image_encoder, start_images=start).encode_captions(*text_encoder)
    if not cfg.reg_dataset_dir:
        return dataset
    reg = Dataset.load(cfg.reg_dataset_dir, regularisation_settings(cfg, settings), cache_dir=cache_dir)
    reg = reg.encode_images(*image_encoder, start_images=start).encode_captions(*text_encoder)
    return dataset.with_regularisation(reg)
