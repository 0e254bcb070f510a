"""Gradient checkpointing over a model's block lists, by instance-forward override.

Each block's activations are dropped after forward and recomputed in backward;
only block inputs stay alive. Removal restores the block exactly.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def find_blocks(model: nn.Module, block_lists: tuple[str, ...]) -> list[nn.Module]:
    """The blocks named by the arch; with no names, every top-level ModuleList."""
    if not block_lists:
        lists = [child for child in model.children() if isinstance(child, nn.ModuleList)]
    else:
        lists = []
        for name in block_lists:
            found = getattr(model, name, None)
            if not isinstance(found, nn.ModuleList):
                raise ValueError(f"model has no block list {name!r} for gradient checkpointing; "
                                 f"its ModuleLists are {[n for n, c in model.named_children() if isinstance(c, nn.ModuleList)]}")
            lists.append(found)
    return [block for blocks in lists for block in blocks]


def _copy_floats(value):
    return value.clone() if torch.is_tensor(value) and value.is_floating_point() else value


def _wrapped(block_forward, recompute: bool):
    # ComfyUI's Flux2 blocks add into their own inputs (`img += ...`), which autograd (and the
    # checkpoint's recompute) still needs: a block under training works on copies (transient memory).
    def fresh_inputs(*args, **kwargs):
        return block_forward(*map(_copy_floats, args), **{k: _copy_floats(v) for k, v in kwargs.items()})

    def keep_residuals(*args, **kwargs):
        # No recompute: tensors autograd saves from the block's own inputs (e.g. a norm's input)
        # are copied when saved, because `x += ...` later in the block overwrites them. The
        # checkpointed path needs no copy: its recompute stops before the in-place add.
        args, kwargs = list(map(_copy_floats, args)), {k: _copy_floats(v) for k, v in kwargs.items()}
        inputs = {t.untyped_storage().data_ptr() for t in [*args, *kwargs.values()]
                  if torch.is_tensor(t) and t.is_floating_point()}

        def pack(t):
            return t.clone() if t.untyped_storage().data_ptr() in inputs else t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return block_forward(*args, **kwargs)

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return block_forward(*args, **kwargs)
        if not recompute:
            return keep_residuals(*args, **kwargs)
        return checkpoint(fresh_inputs, *args, use_reentrant=False, **kwargs)
    return forward


class BlockCheckpointing:
    """`recompute=False` keeps only the input copies: gradient checkpointing off, still safe for
    blocks that write into their inputs."""

    def __init__(self, model: nn.Module, block_lists: tuple[str, ...], recompute: bool = True):
        self.recompute = recompute
        self.blocks = find_blocks(model, block_lists)
        self.previous = []
        for block in self.blocks:
            self.previous.append(block.__dict__.get("forward"))
            block.forward = _wrapped(block.forward, recompute)

    def remove(self) -> None:
        for block, previous in zip(self.blocks, self.previous):
            if previous is None:
                block.__dict__.pop("forward", None)
            else:
                block.forward = previous
        self.blocks, self.previous = [], []
