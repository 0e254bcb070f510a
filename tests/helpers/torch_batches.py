"""Fixed batches and small nets for the PyTorch backend's tests (tests/trainer/backends/torch_backend/)."""

from __future__ import annotations

import numpy as np
import torch

from trainer.archs import get_arch
from trainer.backends.base import Batch
from trainer.backends.torch_backend.backend import TorchBackend
from trainer.backends.torch_backend.lora import LoraSet
from trainer.estimate.common import VARIANTS, linear_layers


def fixed_batch(batch_size=2, seed=0, height=4, width=4) -> Batch:
    rng = np.random.default_rng(seed)
    return Batch(
        latents=rng.standard_normal((batch_size, 16, height, width)).astype(np.float32),
        noise=rng.standard_normal((batch_size, 16, height, width)).astype(np.float32),
        sigmas=rng.uniform(0.2, 0.8, batch_size).astype(np.float32),
        weights=np.ones(batch_size, np.float32),
        context=rng.standard_normal((batch_size, 8, 32)).astype(np.float32),
    )


def split(batch: Batch) -> list[Batch]:
    return [
        Batch(
            latents=batch.latents[i : i + 1],
            noise=batch.noise[i : i + 1],
            sigmas=batch.sigmas[i : i + 1],
            weights=batch.weights[i : i + 1],
            context=batch.context[i : i + 1],
        )
        for i in range(len(batch.sigmas))
    ]


class InPlaceBlock(torch.nn.Module):
    """Like ComfyUI's Flux2 blocks: adds into its own input tensor."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, scale=None):
        x += self.lin(x * 2.0) * scale  # autograd keeps x * 2, not x: only the checkpoint holds x
        return x


class InPlaceNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList([InPlaceBlock(), InPlaceBlock()])

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, scale=torch.tensor(0.5))
        return h


def with_lora(net: torch.nn.Module, targets: list[str]):
    """`net` frozen, with rank-2 LoRA branches on `targets` whose B is off zero (so every LoRA weight gets a
    gradient)."""

    net.requires_grad_(False)
    lora = LoraSet(net, targets, rank=2, alpha=2, dropout=0, seed=0)
    with torch.no_grad():
        for _, p in lora.named_parameters():
            p.add_(0.1)
    return net, lora


def inplace_net_with_lora():
    return with_lora(InPlaceNet(), ["inp", "lin"])


def gradients(make_model, make_config, **settings) -> torch.Tensor:
    backend = TorchBackend()
    backend.setup(make_model(), make_config(**settings), get_arch("demo"))
    backend.optimizer.step = lambda: None
    backend.optimizer.zero_grad = lambda set_to_none=True: None
    with torch.no_grad():
        for p in backend.params.values():
            p.add_(0.01)  # B off zero: every LoRA weight gets a gradient
    backend.step([fixed_batch()], 1e-3)
    grads = torch.cat([p.grad.flatten() for p in backend.params.values()])
    backend.teardown()
    return grads


class HeaderModel(torch.nn.Module):
    """A model as the estimator reads it: a variant's Linear weights, bf16 on the meta device."""

    def __init__(self, variant: str):
        super().__init__()
        self.weights = {
            f"{name}.weight": torch.empty(out, inp, dtype=torch.bfloat16, device="meta")
            for name, (inp, out) in linear_layers(VARIANTS[variant]).items()
        }

    def state_dict(self, *args, **kwargs):
        return self.weights

    def parameters(self, recurse=True):
        return iter(self.weights.values())
