"""LoRA injection on torch Linear layers: side branch, init, removal, target errors."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from trainer.backends.torch_backend.lora import LoraSet, linear_layers
from trainer.lora.targets import TargetError, init_lora_A, matches, select_targets


class CastLinear(nn.Linear):
    """Mimics ComfyUI's cast-on-forward Linear: weights cast to the input's dtype inside its own forward."""

    calls = 0

    def forward(self, x):
        CastLinear.calls += 1
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Module()
        self.attn.qkv = CastLinear(8, 24)
        self.attn.proj = nn.Linear(8, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x):
        q, k, v = self.attn.qkv(x).chunk(3, -1)
        return x + self.attn.proj(q * k.sigmoid() + v) + self.mlp(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _randomise_B(lora: LoraSet):
    with torch.no_grad():
        for branch in lora.branches().values():
            branch.lora_B.normal_(0, 0.1)


def test_pattern_kinds():
    assert matches("blocks.0.attn.qkv", "blocks.0.attn.qkv")  # exact
    assert matches("blocks.0.attn.qkv", "attn.qkv")  # dotted suffix
    assert not matches("blocks.0.xattn.qkv", "attn.qkv")  # suffix respects dots
    assert matches("blocks.10.attn.qkv", r"re:blocks\.1\d\.attn\.qkv")  # regex, full match
    assert not matches("blocks.1.attn.qkv", r"re:blocks\.1\d\.attn\.qkv")


def test_no_match_error_names_patterns_and_sample_modules():
    with pytest.raises(TargetError) as err:
        LoraSet(Net(), ["attn.qkvv"], rank=2, alpha=2, dropout=0, seed=0)
    message = str(err.value)
    assert "attn.qkvv" in message and "blocks.0.attn.qkv" in message and "re:" in message


def test_every_pattern_must_match():
    with pytest.raises(TargetError, match="typo_layer"):
        select_targets(["a.qkv", "a.proj"], ["qkv", "typo_layer"])


def test_step_zero_equals_base_model_and_subclass_forward_runs():
    net, x = Net(), torch.randn(3, 5, 8)
    before = net(x)
    CastLinear.calls = 0
    LoraSet(net, ["attn.qkv", "attn.proj", "mlp.0", "mlp.2"], rank=4, alpha=8, dropout=0.0, seed=1)
    assert torch.equal(net(x), before)  # B = 0: bit-identical output
    assert CastLinear.calls == 2  # the subclass's own forward still runs


def test_lora_adds_scaled_low_rank_branch():
    net, x = Net(), torch.randn(2, 8)
    lora = LoraSet(net, ["blocks.0.attn.proj"], rank=4, alpha=2, dropout=0.0, seed=1)
    _randomise_B(lora)
    branch = lora.branches()["blocks.0.attn.proj"]
    layer = net.blocks[0].attn.proj
    expected = F.linear(x, layer.weight, layer.bias) + (x @ branch.lora_A.T @ branch.lora_B.T) * (2 / 4)
    assert torch.allclose(layer(x), expected, atol=1e-6)
    assert branch.scale == 0.5


def test_A_is_kaiming_uniform_seeded_per_path_and_B_zero():
    net = Net()
    lora = LoraSet(net, ["mlp.0"], rank=64, alpha=64, dropout=0.0, seed=3)
    branch = lora.branches()["blocks.1.mlp.0"]
    bound = 1 / math.sqrt(8)
    assert branch.lora_A.abs().max() <= bound and branch.lora_A.abs().max() > 0.9 * bound
    assert torch.count_nonzero(branch.lora_B) == 0
    assert np.array_equal(branch.lora_A.detach().numpy(), init_lora_A(3, "blocks.1.mlp.0", 64, 8))
    assert not np.array_equal(init_lora_A(3, "blocks.0.mlp.0", 64, 8), init_lora_A(3, "blocks.1.mlp.0", 64, 8))
    assert branch.lora_A.dtype == torch.float32 and branch.lora_A.requires_grad


def test_exact_trainable_parameter_count():
    lora = LoraSet(Net(), ["attn.qkv", "mlp.2"], rank=3, alpha=3, dropout=0, seed=0)
    assert lora.parameter_count() == 2 * (3 * (8 + 24) + 3 * (16 + 8))
    assert len(lora.named_parameters()) == 8


def test_remove_leaves_model_exactly_as_before():
    net, x = Net(), torch.randn(4, 8)
    before_out = net(x)
    before_keys = list(net.state_dict())
    lora = LoraSet(net, ["attn.qkv", "mlp.0"], rank=2, alpha=2, dropout=0.1, seed=0)
    _randomise_B(lora)
    assert list(net.state_dict()) == before_keys  # LoRA never shows up in the model's state_dict
    lora.remove()
    assert all("forward" not in m.__dict__ for m in net.modules())
    assert torch.equal(net(x), before_out)


def test_dropout_acts_on_branch_only():
    net, x = Net(), torch.randn(64, 8)
    lora = LoraSet(net, ["attn.proj"], rank=4, alpha=4, dropout=0.5, seed=0)
    _randomise_B(lora)
    layer, branch = net.blocks[0].attn.proj, lora.branches()["blocks.0.attn.proj"]
    base = F.linear(x, layer.weight, layer.bias)
    branch.train()
    a, b = layer(x), layer(x)
    assert not torch.equal(a, b)  # dropout is live in training
    branch.eval()
    assert torch.allclose(layer(x) - base, (x @ branch.lora_A.T @ branch.lora_B.T), atol=1e-6)


def test_linear_layers_include_modules_that_compute_a_linear_without_being_one():
    """ComfyUI's mixed-precision Linear (its quantized fp8 checkpoints load into it) is a plain nn.Module
    with in_features, out_features and a 2-D weight: a LoRA target like nn.Linear. A module whose sizes do
    not match its weight, or whose weight is not 2-D, is not."""

    class LinearLike(torch.nn.Module):
        def __init__(self, fan_in, out, shape=None):
            super().__init__()
            self.in_features, self.out_features = fan_in, out
            self.weight = torch.nn.Parameter(torch.randn(*(shape or (out, fan_in))), requires_grad=False)

        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight)

    model = torch.nn.Module()
    model.plain, model.like = torch.nn.Linear(4, 3), LinearLike(4, 5)
    model.wrong, model.conv = LinearLike(4, 5, shape=(4, 5)), LinearLike(4, 5, shape=(5, 4, 1))
    assert list(linear_layers(model)) == ["plain", "like"]
    lora = LoraSet(model, ["like"], rank=2, alpha=2.0, dropout=0.0, seed=0)
    x = torch.randn(2, 4)
    base = torch.nn.functional.linear(x, model.like.weight)
    assert torch.equal(model.like(x), base)  # B = 0: step 0 is the base
    lora.branches()["like"].lora_B.data.fill_(0.1)
    assert not torch.allclose(model.like(x), base)
    lora.remove()
    assert torch.equal(model.like(x), base)


def _grads_under_autocast(net, lora, x, *, step_weights: bool):
    for p in dict(lora.named_parameters()).values():
        p.grad = None
    with lora.step_weights(torch.bfloat16) if step_weights else contextlib.nullcontext():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net(x)
        out.float().square().mean().backward()
    return out.detach(), {name: p.grad for name, p in lora.named_parameters()}


@pytest.mark.parametrize("alpha", [4, 12])  # scale 1 (the default alpha = rank) and 3
def test_step_weights_train_as_the_per_use_cast_does(alpha):
    net, x = Net(), torch.randn(3, 5, 8)
    lora = LoraSet(net, ["attn.qkv", "attn.proj", "mlp.0", "mlp.2"], rank=4, alpha=alpha, dropout=0.0, seed=1)
    _randomise_B(lora)
    out_use, grads_use = _grads_under_autocast(net, lora, x, step_weights=False)
    out_step, grads_step = _grads_under_autocast(net, lora, x, step_weights=True)
    if alpha == 4:  # scale 1: the same casts of the same masters, the same products
        assert torch.equal(out_step, out_use)
        assert all(torch.equal(grads_step[k], grads_use[k]) for k in grads_use)
    else:  # the scale folded into A before the cast: bf16 rounding apart
        assert torch.allclose(out_step.float(), out_use.float(), rtol=2e-2, atol=2e-2)
        for key, grad in grads_use.items():  # bf16 products: a relative error of a few parts in 1,000
            assert (grads_step[key] - grad).norm() <= 2e-2 * grad.norm(), key
    assert all(
        g.dtype == torch.float32 and g.shape == p.shape
        for (_, p), g in zip(lora.named_parameters(), grads_step.values())
    )
    assert all(branch.step_weights is None for branch in lora.branches().values())  # gone after the block


def test_step_weights_are_the_compute_dtype_within_the_block_only():
    net = Net()
    lora = LoraSet(net, ["attn.qkv", "mlp.0"], rank=2, alpha=4, dropout=0.0, seed=0)
    branch = lora.branches()["blocks.0.attn.qkv"]
    with lora.step_weights(torch.bfloat16):
        A, B = branch.step_weights
        assert A.dtype == B.dtype == torch.bfloat16 and A.shape == branch.lora_A.shape
        assert torch.equal(A, (branch.lora_A * 2).to(torch.bfloat16))  # scale alpha/rank = 2 folded in
        assert A.data_ptr() != B.data_ptr() and A.grad_fn is not None
    assert branch.step_weights is None
    with pytest.raises(RuntimeError), lora.step_weights(torch.bfloat16):  # cleared on errors too
        raise RuntimeError("boom")
    assert branch.step_weights is None


def test_compiled_block_with_step_weights_compiles_once_and_matches_eager():
    import torch._dynamo

    torch._dynamo.reset()
    net, x = Net(), torch.randn(3, 5, 8)
    for block in net.blocks:  # CastLinear counts calls in a global, which a compiled block guards on
        block.attn.qkv.__class__ = nn.Linear
    lora = LoraSet(net, ["attn.qkv", "attn.proj", "mlp.0", "mlp.2"], rank=4, alpha=4, dropout=0.0, seed=1)
    _randomise_B(lora)
    _, eager = _grads_under_autocast(net, lora, x, step_weights=True)
    compiled = [torch.compile(block, backend="aot_eager") for block in net.blocks]
    originals = list(net.blocks)
    net.blocks = nn.ModuleList(compiled)
    torch._dynamo.utils.counters.clear()
    try:
        _grads_under_autocast(net, lora, x, step_weights=True)
        first = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # 2: block 0's input has no grad
        for _ in range(2):  # new step weights each time: new tensors, the same guards
            _, grads = _grads_under_autocast(net, lora, x, step_weights=True)
    finally:
        net.blocks = nn.ModuleList(originals)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == first == 2
    assert all(torch.allclose(grads[k], eager[k], rtol=1e-5, atol=1e-7) for k in eager)
