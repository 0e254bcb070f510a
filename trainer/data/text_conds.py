"""A caption's cache entry and the conditioning beside its embedding.

ComfyUI's text encoders give a prompt's cond tensor [T,D] and, for some families, more that the model's
extra_conds reads: SD 3.5's and HiDream's pooled CLIP vector (`pooled_output`, the model's `y`), HiDream's
Llama 3.1 layers (`conditioning_llama3`). A caption's cache entry holds them all under the names the
encoder gave them ({"context": [T,D], "pooled_output": [P], ...}, no batch axis); a batch stacks each one
per row and hands it to the model as an extra, as ComfyUI's sampler hands a prompt's conditioning.
"""

from __future__ import annotations

import numpy as np

from . import DatasetError

CONTEXT = "context"


def entry(encoded) -> dict[str, np.ndarray]:
    """An encoder's output as a cache entry: an embedding [T,D] alone, or a dict with "context" and the rest."""
    tensors = dict(encoded) if isinstance(encoded, dict) else {CONTEXT: encoded}
    if CONTEXT not in tensors:
        raise DatasetError(f"the text encoder gave {sorted(tensors)} without a {CONTEXT!r} embedding")
    return {key: np.asarray(value, dtype=np.float32) for key, value in tensors.items()}


def others(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An entry's conditioning beside the embedding."""
    return {key: value for key, value in tensors.items() if key != CONTEXT}


def read(data, method: str, *args) -> dict[str, np.ndarray]:
    """data.<method>(*args) where the training data keeps conditioning beside embeddings (cached data); {} where
    it keeps embeddings only (in-memory data: the demo, tests)."""
    reader = getattr(data, method, None)
    return reader(*args) if reader is not None else {}


def of_rows(data, rows, indices, variants, dropped) -> list[dict[str, np.ndarray]]:
    """Each of `rows`' captions' other conditioning (SD 3.5's pooled output): the empty caption's where its
    caption drops (`dropped[row]`), else its item's (`indices[row]`, caption variant `variants[row]`)."""
    return [
        read(data, "empty_conds") if dropped[row] else read(data, "conds", indices[row], variants[row]) for row in rows
    ]


def stacked(rows: list[dict[str, np.ndarray]], names: list[str]) -> dict[str, np.ndarray]:
    """Rows' conditioning → {key: [B,...]}, the model extras ComfyUI's extra_conds takes under those keys."""
    keys = {frozenset(row) for row in rows}
    if len(keys) != 1:
        raise DatasetError(
            f"the captions of one batch ({', '.join(names)}) were encoded with different conditioning "
            f"({' / '.join(sorted(str(sorted(k)) for k in keys))}); run Encode Captions again"
        )
    out = {}
    for key in sorted(keys.pop()):
        shapes = {row[key].shape for row in rows}
        if len(shapes) != 1:
            raise DatasetError(
                f"the captions of one batch ({', '.join(names)}) give {key} of shapes {sorted(shapes)}, which "
                "ComfyUI would not batch either; use batch_size 1"
            )
        out[key] = np.stack([row[key] for row in rows]).astype(np.float32, copy=False)
    return out
