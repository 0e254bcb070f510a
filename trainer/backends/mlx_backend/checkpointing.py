"""Per-block gradient checkpointing for MLX models, with `mlx.nn.utils.checkpoint` (never `mx.checkpoint`).

`mx.checkpoint(module)` silently gives the module's own parameters (the LoRA weights inside a
block) zero gradients; `nn.utils.checkpoint` passes them as inputs of the checkpointed function
(REFERENCE.md, MLX trap 1). Python looks `__call__` up on the class, so each block gets a
one-off subclass whose `__call__` is the checkpointed one: module paths, parameters and the
model's own forward stay untouched, and removal gives the block its class back.
"""

from __future__ import annotations

import mlx.nn as nn

from ..base import checkpointed


def find_blocks(model: nn.Module, block_lists: tuple[str, ...]) -> list[nn.Module]:
    """The blocks named by the arch; with no names, every top-level list of modules."""
    if not block_lists:
        lists = [
            child
            for child in model.values()
            if isinstance(child, list) and child and all(isinstance(m, nn.Module) for m in child)
        ]
    else:
        lists = []
        for name in block_lists:
            found = model.get(name) if isinstance(model, dict) else None
            if not isinstance(found, list):
                available = [k for k, v in model.items() if isinstance(v, list)]
                raise ValueError(
                    f"model has no block list {name!r} for gradient checkpointing; its lists are {available}"
                )
            lists.append(found)
    return [block for blocks in lists for block in blocks]


def _checkpointed_class(block: nn.Module) -> type:
    original = type(block)
    recomputed = nn.utils.checkpoint(block, lambda *args, **kwargs: original.__call__(block, *args, **kwargs))

    def __call__(self, *args, **kwargs):
        return recomputed(*args, **kwargs)

    return type(
        original.__name__,
        (original,),
        {"__call__": __call__, "__module__": original.__module__, "__qualname__": original.__qualname__},
    )


class BlockCheckpointing:
    """Each block's activations are dropped after forward and recomputed in backward, but for the
    last `skip` blocks, which keep theirs (faster, more memory)."""

    def __init__(self, model: nn.Module, block_lists: tuple[str, ...], skip: int = 0):
        blocks = find_blocks(model, block_lists)
        self.blocks = [block for block, again in zip(blocks, checkpointed(len(blocks), True, skip)) if again]
        self.classes = [type(block) for block in self.blocks]
        for block in self.blocks:
            block.__class__ = _checkpointed_class(block)

    def remove(self) -> None:
        for block, original in zip(self.blocks, self.classes):
            block.__class__ = original
        self.blocks, self.classes = [], []
