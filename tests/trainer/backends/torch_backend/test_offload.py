"""offload_activations (trainer/backends/torch_backend/offload.py): a checkpointed block's kept inputs wait on the
host. On the CPU a copy stands for the host's (OFFLOAD_FROM gains "cpu"): what moves is the block input, the
gradients are those of plain checkpointing, and a first block whose input requires no grad still trains."""

from __future__ import annotations

import pytest
import torch

from trainer.backends.torch_backend import offload
from trainer.backends.torch_backend.checkpointing import BlockCheckpointing


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.proj = torch.nn.Linear(width, width)
        self.scale = torch.nn.Linear(8, width)

    def forward(self, x, *, e, context_len: int = 0):  # keyword tensors and a plain value, as ComfyUI's blocks
        return x + self.proj(torch.nn.functional.gelu(self.norm(x))) * self.scale(e)[:, None] + context_len


class Model(torch.nn.Module):
    def __init__(self, width: int = 64, blocks: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(width, width).requires_grad_(False)  # frozen: the first block's input
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x, e):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x, e=e, context_len=1)
        return x


def grads(offloaded: bool, monkeypatch) -> tuple[dict, list]:
    model = Model()
    for name, p in model.blocks.named_parameters():
        p.requires_grad_(name.endswith("proj.weight"))  # the "LoRA": the rest frozen
    packed = []
    if offloaded:
        monkeypatch.setattr(offload, "OFFLOAD_FROM", ("cpu",))
        monkeypatch.setattr(offload, "OFFLOAD_MIN_BYTES", 4 * 64 * 32)  # the [2, 16, 64] fp32 hidden states
        original = offload._to_host
        monkeypatch.setattr(offload, "_to_host", lambda t: packed.append(tuple(t.shape)) or original(t))
    wrapped = BlockCheckpointing(model, ("blocks",), recompute=True, offload=offloaded)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    e = torch.randn(2, 8, generator=torch.Generator().manual_seed(2))
    model(x, e).square().mean().backward()
    wrapped.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, packed


def test_offloaded_blocks_train_as_checkpointed_ones(monkeypatch):
    plain, _ = grads(False, monkeypatch)
    moved, packed = grads(True, monkeypatch)
    assert sorted(plain) == sorted(moved) == [f"blocks.{i}.proj.weight" for i in range(3)]  # block 0 trains too
    for name in plain:
        torch.testing.assert_close(moved[name], plain[name], rtol=0, atol=0)
    assert packed.count((2, 16, 64)) == 3  # each block's input went to the "host"; e ([2, 8]) stayed


def test_offload_takes_no_checkpoint_budget():
    with pytest.raises(ValueError, match="no checkpoint_budget"):
        BlockCheckpointing(Model(), ("blocks",), recompute=True, offload=True, compile=True, budget=0.5)


def test_compiled_offloaded_blocks_train_as_checkpointed_ones(monkeypatch):
    """Compiled whole inside the reentrant checkpoint (aot_eager: the graphs torch.compile builds, no C++ build)."""
    from trainer.backends.torch_backend import checkpointing

    plain, _ = grads(False, monkeypatch)
    monkeypatch.setattr(checkpointing, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(offload, "OFFLOAD_FROM", ("cpu",))
    model = Model()
    for name, p in model.blocks.named_parameters():
        p.requires_grad_(name.endswith("proj.weight"))
    wrapped = BlockCheckpointing(model, ("blocks",), recompute=True, offload=True, compile=True, pure_blocks=True)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    e = torch.randn(2, 8, generator=torch.Generator().manual_seed(2))
    model(x, e).square().mean().backward()
    wrapped.remove()
    for name, grad in plain.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-5, atol=1e-6)
