"""base_quantize int8 on torch: the frozen base's block Linears stored in int8 and multiplied through
torch._int_mm (W8A8), on the CPU's own int8 matmul."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from trainer import config
from trainer.backends.torch_backend import int8
from trainer.backends.torch_backend.int8 import Int8Base, int8_linear, quantize_rows

CPU = torch.device("cpu")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_quantize_rows_rounds_each_value_within_half_a_step_and_uses_the_full_range():
    t = torch.randn(64, 96) * torch.logspace(-3, 2, 64)[:, None]  # rows of very different magnitude
    q, scale = quantize_rows(t)
    assert q.dtype == torch.int8 and scale.shape == (64, 1)
    assert torch.all((q.float() * scale - t).abs() <= scale / 2 * (1 + 1e-5))
    assert torch.all(q.abs().amax(dim=1) == 127)  # each row's absmax lands on ±127
    zero_q, zero_scale = quantize_rows(torch.zeros(2, 8))  # an all-zero row: no division by zero
    assert torch.all(zero_q == 0) and torch.all(torch.isfinite(zero_scale))


def test_the_int8_linear_matches_the_fp32_linear_forward_and_input_gradient():
    """Each operand is rounded to within half a step of its row's absmax/127. For Gaussian rows of K = 256 the
    absmax is under 4.5 sigma, so the rounding error's RMS is at most 4.5/127/sqrt(12) ~ 1.0 % of sigma per
    operand; two rounded operands give ~1.45 % relative error in the product (errors independent), bf16's
    output rounding adds <= 0.4 %. Bound: 3 %; and the error is not zero (it did quantize)."""
    torch.manual_seed(0)
    weight = torch.randn(128, 256)
    q, scale = quantize_rows(weight)
    x = torch.randn(4, 40, 256, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = int8_linear(x, q, scale.reshape(-1), None)
    y_ref = x_ref @ weight.t()
    assert y.dtype == torch.float32 and y.shape == y_ref.shape
    assert 1e-4 < _relative(y, y_ref) < 0.03
    grad = torch.randn_like(y_ref)
    y.backward(grad)
    y_ref.backward(grad)
    assert 1e-4 < _relative(x.grad, x_ref.grad) < 0.03
    with torch.autocast("cpu", dtype=torch.bfloat16):  # under autocast: bf16 out, same bound
        y_bf16 = int8_linear(x.detach(), q, scale.reshape(-1), None)
    assert y_bf16.dtype == torch.bfloat16 and _relative(y_bf16, y_ref) < 0.03


def test_a_product_torch_int_mm_refuses_takes_the_dequantized_weight_and_is_counted(monkeypatch):
    torch.manual_seed(0)
    weight = torch.randn(24, 40)
    q, scale = quantize_rows(weight)
    x = torch.randn(8, 40, requires_grad=True)
    assert int8.int_mm_fits(16, 64, 64, torch.device("cuda")) is False  # CUDA: M > 16, K and N multiples of 8
    assert int8.int_mm_fits(17, 64, 60, torch.device("cuda")) is False
    assert int8.int_mm_fits(17, 64, 64, torch.device("cuda")) and int8.int_mm_fits(1, 3, 5, CPU)
    exact = int8_linear(x, q, scale.reshape(-1), None)
    monkeypatch.setattr(int8, "int_mm_fits", lambda *a: False)
    before = int8.FALLBACKS["calls"]
    y = int8_linear(x, q, scale.reshape(-1), None)
    y.sum().backward()
    assert int8.FALLBACKS["calls"] == before + 2  # forward and backward
    dequantized = q.float() * scale
    assert torch.allclose(y, x @ dequantized.t(), atol=1e-5)
    assert torch.allclose(x.grad, torch.ones(8, 24) @ dequantized, atol=1e-5)
    assert _relative(y, exact) < 0.03


def _blocks_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    block = lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))  # noqa: E731
    return nn.Sequential(nn.ModuleList([block(), block()]), nn.Linear(32, 32))


def test_install_halves_the_weights_and_remove_gives_every_linear_back_bitwise():
    model = _blocks_model().to(torch.bfloat16)
    model.requires_grad_(False)
    weights = {name: p for name, p in model.named_parameters()}
    before = {name: p.detach().clone() for name, p in weights.items()}
    x = torch.randn(20, 32, dtype=torch.bfloat16)
    reference = model[0][0](x)
    base = Int8Base(list(model[0]), CPU)
    assert len(base.replaced) == 4 and base.freed == 2 * (2 * 32 * 64) * 2
    assert all(model[0][i][j].weight.dtype == torch.int8 for i in (0, 1) for j in (0, 2))
    assert model[1].weight.dtype == torch.bfloat16  # outside the blocks: as it was
    with torch.no_grad():  # sampling takes the int8 path too (the bf16 weight is off the device)
        assert _relative(model[0][0](x), reference) < 0.03
    base.remove()
    assert all(weights[name] is p for name, p in model.named_parameters())  # the same Parameters
    assert all(torch.equal(p, before[name]) and p.dtype == before[name].dtype for name, p in model.named_parameters())
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert torch.equal(model[0][0](x), reference)


def test_lora_branches_wrap_the_int8_forward_and_only_they_get_gradients():
    from trainer.backends.torch_backend.lora import LoraSet

    model = _blocks_model()
    model.requires_grad_(False)
    base = Int8Base(list(model[0]), CPU)
    lora = LoraSet(model, ["0.0.0", "0.0.2", "0.1.0", "0.1.2"], rank=4, alpha=4.0, dropout=0.0, seed=0)
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p)  # a non-zero B, so A gets a gradient too
    x = torch.randn(20, 32, requires_grad=True)
    out = model[0][1](model[0][0](x))
    out.square().mean().backward()
    trained = dict(lora.named_parameters())
    assert trained and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained.values())
    assert x.grad is not None and x.grad.abs().sum() > 0  # the activation gradient flows through the int8 base
    frozen = [p for p in model.parameters() if all(p is not q for q in trained.values())]
    assert all(p.grad is None for p in frozen)
    lora.remove()
    base.remove()


def test_the_backend_on_an_int8_base_overfits_one_fixed_batch(make_model, make_config):
    from trainer.archs import get_arch
    from trainer.backends.torch_backend.backend import TorchBackend

    from helpers.torch_batches import fixed_batch

    backend = TorchBackend()
    cfg = make_config(rank=8, alpha=8.0, learning_rate=3e-2, max_grad_norm=0.0, base_quantize="int8")
    backend.setup(make_model(), cfg, get_arch("demo"))
    assert isinstance(backend.fp8, Int8Base) and backend.fp8.replaced
    batch = fixed_batch()
    losses = backend.scalars([backend.step([batch], 3e-2).loss for _ in range(50)])
    assert losses[-1] <= 0.5 * losses[0], (losses[0], losses[-1])
    backend.teardown()


def test_a_run_with_an_int8_base_saves_a_lora_that_loads_and_gives_the_model_back(
    tmp_path, make_model, make_data, make_config
):
    from trainer.lora.files import load_lora
    from trainer.run.loop import train

    cfg = make_config(steps=6, checkpoint_every=6, gradient_checkpointing=True, base_quantize="int8")
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train(cfg, model, make_data(), run_dir=tmp_path / "int8")
    assert np.all(np.isfinite(result.history.loss))
    assert all(torch.equal(v, before[k]) and v.dtype == before[k].dtype for k, v in model.state_dict().items())
    assert all("forward" not in m.__dict__ for m in model.modules())
    loaded, _ = load_lora(result.checkpoint / "lora.safetensors", arch="demo")
    assert len(loaded) == len(result.lora) and any(np.abs(w.B).sum() > 0 for w in result.lora.values())


@pytest.mark.parametrize("checkpointing", [True, False])
def test_an_int8_base_streamed_trains_the_same_lora_as_resident(
    tmp_path, make_model, make_data, make_config, checkpointing
):
    from trainer.run.loop import train

    results = []
    for stream in (0, 2):
        cfg = make_config(steps=4, base_quantize="int8", stream_blocks=stream, gradient_checkpointing=checkpointing)
        model = make_model()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        results.append(train(cfg, model, make_data(), run_dir=tmp_path / f"s{stream}"))
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for key, weights in results[0].lora.items():
        other = results[1].lora[key]
        assert np.array_equal(weights.A, other.A) and np.array_equal(weights.B, other.B), key
    assert any(np.abs(w.B).sum() > 0 for w in results[0].lora.values())


def test_the_streamer_streams_the_int8_weights():
    from trainer.backends.torch_backend.streaming import frozen_weights

    model = _blocks_model()
    model.requires_grad_(False)
    base = Int8Base(list(model[0]), CPU)
    assert {p.dtype for _, p in frozen_weights(model[0][0])} == {torch.int8, torch.float32}  # int8 weights, biases
    base.remove()


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"base_quantize": "int4"}, "PyTorch takes auto, none or int8"),
        ({"base_quantize": "int8", "fp8_compute": True}, "pick one"),
        ({"base_quantize": "int8", "adapter": "dora"}, "adapter 'dora' reads the base weight"),
    ],
)
def test_the_config_refuses_what_the_int8_base_cannot_do(settings, words):
    with pytest.raises(config.ConfigError, match=words):
        config.from_dict({"arch": "zimage", **settings})


def test_int8_is_taken_on_torch_and_fp8_auto_yields_to_it(monkeypatch):
    from trainer.backends.torch_backend import levers

    cfg = config.from_dict({"arch": "zimage", "base_quantize": "int8"})
    assert cfg.base_quantize == "int8" and cfg.fp8_compute == "auto"
    stored = nn.Sequential(nn.Linear(32, 32)).to(torch.float8_e4m3fn)
    assert levers.fp8_compute(stored, cfg, torch.device("cuda")) == (False, "")
    model = _blocks_model().requires_grad_(False)
    base, note = levers.int8_base(cfg, CPU, list(model[0]))
    assert isinstance(base, Int8Base) and "int8" in note and levers.base_dtype(model) == "int8"
    base.remove()
    assert levers.int8_base(config.from_dict({"arch": "zimage"}), CPU, list(model[0])) == (None, "")


def test_the_estimate_counts_an_int8_base_at_a_byte_a_weight():
    from trainer.estimate.torch_step import estimate

    bf16 = estimate("zimage", resolution=1024)
    fp8 = estimate("zimage", resolution=1024, base_dtype="fp8")
    quantized = estimate("zimage", resolution=1024, base_dtype="int8")
    # the block Linears at a byte each (+ scales); the rest (embedders, final layer) stays bf16
    assert fp8.weights < quantized.weights < 1.01 * fp8.weights < bf16.weights
    assert quantized.total < bf16.total


def test_the_estimate_command_takes_int8_from_a_torch_config(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "run.toml"
    path.write_text('arch = "zimage"\nbase_quantize = "int8"\nresolutions = [1024]\n')
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "estimate", str(path), "--variant", "zimage"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "base int8" in result.stdout


def test_a_quantized_checkpoints_linear_is_left_to_its_own_forward(caplog):
    """ComfyUI's mixed-precision Linear (comfy_quant checkpoints) is a plain Module with a quantized weight: the
    int8 base leaves it (and its forward) as it is, and says so."""

    class MixedPrecisionLinear(nn.Module):  # the shape of comfy.ops.mixed_precision_ops().Linear
        def __init__(self):
            super().__init__()
            self.in_features, self.out_features = 32, 32
            self.weight = nn.Parameter(torch.randn(32, 32).to(torch.float8_e4m3fn), requires_grad=False)

        def forward(self, x):
            return x @ self.weight.to(x.dtype).t()

    block = nn.Sequential(MixedPrecisionLinear(), nn.Linear(32, 32)).requires_grad_(False)
    stored = block[0].weight.detach().clone()
    with caplog.at_level("INFO", logger="kiln"):
        base = Int8Base([block], CPU)
    assert [m for m, *_ in base.replaced] == [block[1]]
    assert block[0].weight.dtype == torch.float8_e4m3fn and "forward" not in block[0].__dict__
    assert "1 stay as they are" in caplog.text
    base.remove()
    assert torch.equal(block[0].weight.view(torch.uint8), stored.view(torch.uint8))
