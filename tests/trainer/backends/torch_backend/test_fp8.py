"""fp8_compute: the frozen base's block Linears in fp8 (torch._scaled_mm, per-row scales), on the CPU's own
_scaled_mm (the GPU's speed and loss are in bench/RESULTS.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from trainer import config as config
from trainer.backends.torch_backend.checkpointing import find_blocks
from trainer.backends.torch_backend.fp8 import (
    E4M3_MAX,
    Fp8Base,
    Fp8Weight,
    fp8_linear,
    fp8_products,
    quantize_rows,
)
from trainer.config import ConfigError
from trainer.estimate.common import get_dims, linear_layers
from trainer.estimate.torch_step import estimate
from trainer.run.loop import train


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_quantize_rows_uses_the_full_e4m3_range_of_each_row():
    t = torch.tensor([[1.0, -2.0, 0.5], [100.0, 3.0, -7.0], [0.0, 0.0, 0.0]])
    q, scale = quantize_rows(t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 1)
    assert torch.equal(q.float().abs().amax(dim=1)[:2], torch.tensor([E4M3_MAX, E4M3_MAX]))  # each row's max → 448
    assert torch.equal(q[2].float(), torch.zeros(3))  # a zero row stays zero
    assert torch.allclose(q.float() * scale, t, rtol=0.07)  # e4m3: 3 mantissa bits


def test_fp8_linear_matches_the_bf16_linear_forward_and_input_gradient():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen)
    bias = torch.randn(48, generator=gen)
    x = torch.randn(2, 10, 64, generator=gen, requires_grad=True)
    y = fp8_linear(x, Fp8Weight(weight), bias)
    reference = nn.functional.linear(x, weight, bias)
    assert y.shape == (2, 10, 48) and y.dtype == torch.bfloat16
    assert _relative(y, reference) < 0.05
    grad = torch.randn(2, 10, 48, generator=gen)
    (dx,) = torch.autograd.grad(y, x, grad)
    (dx_reference,) = torch.autograd.grad(reference, x, grad)
    assert dx.dtype == x.dtype and dx.shape == x.shape
    assert _relative(dx, dx_reference) < 0.05
    assert _relative(dx, dx_reference) > 0  # it really ran in fp8, not the bf16 fallback


@pytest.mark.parametrize("forward, backward", [(True, True), (True, False), (False, True)])
def test_fp8_saves_nothing_of_the_activation_for_backward(forward, backward):
    saved = []
    x = torch.randn(4, 32, requires_grad=True)
    base = torch.randn(16, 32)
    weight = Fp8Weight(base, forward=forward, backward=backward)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fp8_linear(x, weight, None).sum().backward()
    assert saved and all(t is None or t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for t in saved)
    kept = [t for t in saved if t is not None]
    weight_storage = base.untyped_storage().data_ptr()  # W itself, not a copy
    assert all(
        t.dtype == torch.float8_e4m3fn or t.shape[0] == 1 or t.untyped_storage().data_ptr() == weight_storage
        for t in kept
    )  # fp8 copies, [1, n] scales, W


def test_a_product_kept_in_bf16_is_the_bf16_product():
    assert fp8_products(3072, 9216) == fp8_products(9216, 3072) == (True, True)  # the measured policy: all fp8
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(16, 48, generator=gen)  # a down projection: forward in bf16, backward in fp8
    x = torch.randn(5, 48, generator=gen, requires_grad=True)
    weight = Fp8Weight(base, forward=False, backward=True)
    assert weight.rows is None and weight.cols is not None and weight.nbytes() == 48 * 16 + 4 * 48
    y = fp8_linear(x, weight, None)
    assert torch.equal(y, (x.to(torch.bfloat16) @ base.to(torch.bfloat16).t()))  # the bf16 product itself
    grad = torch.randn(5, 16, generator=gen)
    (dx,) = torch.autograd.grad(y, x, grad)
    exact = grad @ base
    assert 0 < _relative(dx, exact) < 0.05  # fp8, close


def test_install_and_remove_leave_every_linear_as_it_was(make_model):
    model = make_model()
    blocks = find_blocks(model, ())
    linears = [m for b in blocks for m in b.modules() if isinstance(m, nn.Linear)]
    before = [dict(m.__dict__) for m in linears]
    x = torch.randn(3, linears[0].in_features)
    plain = linears[0](x)
    fp8 = Fp8Base(blocks, torch.device("cpu"))
    assert len(fp8.replaced) == len(linears) and fp8.bytes > 0
    assert not torch.equal(linears[0](x), plain)  # grad on: the fp8 path
    with torch.no_grad():
        assert torch.equal(linears[0](x), plain)  # no grad (samples): the Linear's own forward
    fp8.remove()
    assert [dict(m.__dict__) for m in linears] == before
    assert torch.equal(linears[0](x), plain)


def test_a_run_with_fp8_compute_trains_close_to_bf16_and_resumes_exactly(tmp_path, make_model, make_data, make_config):
    settings = {
        "steps": 8,
        "mixed_precision": "bf16",
        "checkpoint_every": 4,
        "log_every": 1,
        "gradient_checkpointing": True,
    }
    plain = train(make_config(**settings), make_model(), make_data(), run_dir=tmp_path / "bf16")
    fp8 = train(make_config(**settings, fp8_compute=True), make_model(), make_data(), run_dir=tmp_path / "fp8")
    losses, reference = np.array(fp8.history.loss), np.array(plain.history.loss)
    assert np.all(np.isfinite(losses)) and not np.array_equal(losses, reference)
    assert np.allclose(losses, reference, rtol=0.05)
    for path, weights in fp8.lora.items():  # the LoRA learned the same thing, to fp8's rounding
        assert np.abs(weights.B).max() > 0
        assert _relative(torch.from_numpy(weights.B), torch.from_numpy(plain.lora[path].B)) < 0.2
    progress = []
    cfg = make_config(**settings, fp8_compute=True)
    stopped = train(
        cfg,
        make_model(),
        make_data(),
        run_dir=tmp_path / "resumed",
        on_step=progress.append,
        should_stop=lambda: len(progress) >= 3,
    )
    assert stopped.stopped
    resumed = train(cfg, make_model(), make_data(), run_dir=tmp_path / "resumed", resume=tmp_path / "resumed")
    assert resumed.history.loss == fp8.history.loss
    for path, weights in fp8.lora.items():
        assert np.array_equal(weights.B, resumed.lora[path].B)


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"backend": "mlx"}, "backend 'torch'"),
        ({"mixed_precision": "no"}, "mixed_precision 'bf16'"),
    ],
)
def test_fp8_compute_refuses_what_it_cannot_do(settings, words):
    with pytest.raises(ConfigError, match=words):
        config.from_dict({"arch": "zimage", "fp8_compute": True, **settings})


def test_estimate_counts_the_fp8_weight_copies():
    plain = estimate("zimage", resolution=1024)
    with_fp8 = estimate("zimage", resolution=1024, fp8_compute=True)
    layers = linear_layers(get_dims("zimage")).values()
    copies = 2 * sum(i * o for i, o in layers)  # both layouts of every Linear (fp8_products)
    assert with_fp8.weights - plain.weights == copies
    assert with_fp8.total - plain.total == copies
    stored = estimate("zimage", resolution=1024, base_dtype="fp8")  # the stored weights serve: no copies
    assert estimate("zimage", resolution=1024, base_dtype="fp8", fp8_compute=True).total == stored.total


def test_compiled_blocks_give_the_eager_fp8_gradients(make_model, make_config, monkeypatch):
    """Under torch.compile (aot_eager: the same graphs, no C++ build) the fp8 function traces into the
    blocks' graphs, checkpoint recompute included, and gives the eager fp8 gradients."""
    from torch._dynamo.utils import counters

    from trainer.backends.torch_backend import checkpointing

    from helpers.torch_batches import gradients

    settings = {"mixed_precision": "bf16", "fp8_compute": True, "gradient_checkpointing": True}
    eager = gradients(make_model, make_config, **settings, compile_blocks=False)
    monkeypatch.setattr(checkpointing, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = gradients(make_model, make_config, **settings, compile_blocks=True)
        assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"]
    finally:
        torch._dynamo.reset()
    assert torch.count_nonzero(eager) > 0.5 * eager.numel()
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-5)


def test_a_base_stored_in_fp8_multiplies_its_own_weight_forward_and_bf16_backward():
    """Load Diffusion Model's weight_dtype fp8_e4m3fn: the forward uses the stored weight (no copy, unit
    scales), the backward the stored weight cast to bf16, as ComfyUI's cast-per-use forward does."""
    gen = torch.Generator().manual_seed(2)
    layer = nn.Linear(64, 32)
    layer.weight = nn.Parameter(torch.randn(32, 64, generator=gen).to(torch.float8_e4m3fn), requires_grad=False)
    layer.forward = lambda x: nn.functional.linear(x, layer.weight.to(x.dtype), layer.bias.to(x.dtype))  # manual cast
    block = nn.Sequential(layer)
    fp8 = Fp8Base([block], torch.device("cpu"))
    assert len(fp8.replaced) == 1 and fp8.bytes == 4 * 32  # the unit scales only: no weight copy
    x = torch.randn(6, 64, generator=gen, requires_grad=True)
    y = layer(x)
    x8, x_scale = quantize_rows(x)
    expected = torch._scaled_mm(
        x8, layer.weight.t(), scale_a=x_scale, scale_b=torch.ones(1, 32), out_dtype=torch.bfloat16
    ) + layer.bias.to(torch.bfloat16)
    assert torch.equal(y, expected)
    grad = torch.randn(6, 32, generator=gen)
    (dx,) = torch.autograd.grad(y, x, grad)
    assert torch.equal(dx, (grad.to(torch.bfloat16) @ layer.weight.to(torch.bfloat16)).float())
    fp8.remove()


def test_a_base_stored_in_fp8_multiplies_in_fp8_backward_too_given_its_transposed_copy():
    """stored_backward: the backward multiplies the incoming gradient (per-row scales) by the stored e4m3
    values transposed (an exact copy, unit scales), instead of casting the weight to bf16 per use."""
    gen = torch.Generator().manual_seed(3)
    layer = nn.Linear(64, 32, bias=False)
    layer.weight = nn.Parameter(torch.randn(32, 64, generator=gen).to(torch.float8_e4m3fn), requires_grad=False)
    fp8 = Fp8Base([nn.Sequential(layer)], torch.device("cpu"), stored_backward=True)
    weight = layer.forward.__closure__ and next(
        c.cell_contents for c in layer.forward.__closure__ if isinstance(c.cell_contents, Fp8Weight)
    )
    assert torch.equal(weight.cols.float(), layer.weight.float().t()) and weight.cols.is_contiguous()
    assert fp8.bytes == 64 * 32 + 4 * (32 + 64)  # the copy (a byte each) and unit scales
    x = torch.randn(6, 64, generator=gen, requires_grad=True)
    grad = torch.randn(6, 32, generator=gen)
    (dx,) = torch.autograd.grad(layer(x), x, grad)
    g8, g_scale = quantize_rows(grad.to(torch.bfloat16))  # the bf16 output's gradient, as autograd hands it
    expected = torch._scaled_mm(
        g8, weight.cols.t(), scale_a=g_scale, scale_b=torch.ones(1, 64), out_dtype=torch.bfloat16
    ).float()
    assert torch.equal(dx, expected)
    assert _relative(dx, grad @ layer.weight.float()) < 0.05  # the gradient's own rounding only
    fp8.remove()
    assert "forward" not in layer.__dict__


def test_the_stored_backward_copy_is_made_only_where_it_costs_the_step_nothing():
    """levers.fp8_stored_backward: yes when the checkpoint budget with the copy resident is the one without
    (auto), or a set budget still fits; no for an unknown model, off CUDA, or with nothing stored in fp8."""
    from trainer.backends.torch_backend import levers

    from helpers.torch_batches import HeaderModel

    gib, gpu = levers.GIB, torch.device("cuda")
    model, auto = HeaderModel("flux2-klein-4b"), config.from_dict({"arch": "flux2_klein", "resolutions": [1024]})
    on, why = levers.fp8_stored_backward(model, auto, gpu, int(3.6 * gib), (70 * gib, 80 * gib))  # Klein on an H100
    assert on and "its backward in fp8 too (a transposed copy of the stored weights, 3.6 GiB)" in why
    # a 24 GB card with 12 GiB free: budget 0.3 without the copy, 0 with it resident, so no copy
    without = levers.auto_budget(model, auto, gpu, (12 * gib, 24 * gib))[0]
    with_copy = levers.auto_budget(model, auto, gpu, (int(8.4 * gib), 24 * gib))[0]
    assert with_copy < without
    on, why = levers.fp8_stored_backward(model, auto, gpu, int(3.6 * gib), (12 * gib, 24 * gib))
    assert not on and "casts the stored weights to bf16 per use" in why
    fixed = config.from_dict({"arch": "flux2_klein", "resolutions": [1024], "checkpoint_budget": 0.0})
    assert levers.fp8_stored_backward(model, fixed, gpu, int(3.6 * gib), (14 * gib, 24 * gib))[0]  # budget 0 fits
    assert not levers.fp8_stored_backward(model, fixed, gpu, int(3.6 * gib), (12 * gib, 24 * gib))[0]
    assert not levers.fp8_stored_backward(model, auto, gpu, 60 * gib, (70 * gib, 80 * gib))[0]  # Dev-sized copy
    # so little free that even plain checkpointing does not fit (auto's 0): the copy would only add to it
    assert levers.auto_budget(model, auto, gpu, (int(8.4 * gib), 24 * gib))[0] == 0.0
    assert not levers.fp8_stored_backward(model, auto, gpu, gib // 8, (int(8.4 * gib), 24 * gib))[0]
    assert levers.fp8_stored_backward(model, auto, torch.device("cpu"), gib, (70 * gib, 80 * gib)) == (False, "")
    assert levers.fp8_stored_backward(model, auto, gpu, 0, (70 * gib, 80 * gib)) == (False, "")
    on, why = levers.fp8_stored_backward(nn.Linear(4, 4), auto, gpu, gib, (70 * gib, 80 * gib))
    assert not on and "without a memory estimate" in why


def _fp8_stored_model() -> nn.Module:
    layer = nn.Linear(32, 32)
    layer.weight = nn.Parameter(layer.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    return nn.Sequential(layer)


def test_auto_turns_fp8_on_only_where_it_costs_nothing(monkeypatch):
    """fp8_compute auto (the default): on for a base stored in fp8 on a CUDA GPU with per-row fp8 matmuls
    (no copy; Flux2 Dev -10 %/step), off for a bf16 base (its copies cost memory), on the CPU, on MLX,
    and on a GPU without the matmul; true and false are taken as they are."""
    from trainer.backends.torch_backend import fp8 as fp8_module
    from trainer.backends.torch_backend import levers

    assert config.from_dict({}).fp8_compute == "auto"
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(fp8_module, "check_device", lambda device: None)  # an H100 as far as the check goes
    auto = config.from_dict({"arch": "zimage"})
    assert levers.fp8_compute(_fp8_stored_model(), auto, gpu)[0] is True
    assert levers.fp8_compute(nn.Sequential(nn.Linear(32, 32)), auto, gpu)[0] is False  # bf16 base
    assert levers.fp8_compute(_fp8_stored_model(), auto, cpu)[0] is False
    assert levers.fp8_compute(_fp8_stored_model(), config.from_dict({"mixed_precision": "no"}), gpu)[0] is False
    assert levers.fp8_compute(nn.Sequential(nn.Linear(32, 32)), config.from_dict({"fp8_compute": True}), cpu) == (
        True,
        "",
    )
    assert levers.fp8_compute(_fp8_stored_model(), config.from_dict({"fp8_compute": False}), gpu) == (False, "")

    def no_fp8(device):
        raise ValueError("no per-row fp8 matmul")

    monkeypatch.setattr(fp8_module, "check_device", no_fp8)  # an A100
    on, why = levers.fp8_compute(_fp8_stored_model(), auto, gpu)
    assert on is False and "no per-row fp8 matmul" in why
    assert config.from_dict({"backend": "mlx", "arch": "zimage"}).fp8_compute == "auto"  # auto is fine on MLX


def test_the_triton_quantization_kernel_is_an_arch_fact_probed_before_use(monkeypatch, caplog):
    """Flux2 names the Linears whose forward input fp8_kernels' Triton kernel quantizes (its single blocks'
    linear2, where inductor's fused quantization was slow); a run uses it only on a CUDA GPU where it builds
    and matches the torch ops bit for bit, else one log line and the torch ops. The kernel's agreement on a
    GPU: bench/fp8_quant.py, bench/results_fp8_quant.json."""
    from trainer.archs import ARCHS
    from trainer.backends.torch_backend import fp8, fp8_kernels

    assert {name: arch.fp8_quantize_kernel for name, arch in ARCHS.items() if arch.fp8_quantize_kernel} == {
        name: ("linear2",) for name in ARCHS if name.startswith("flux2")
    }
    assert ARCHS["zimage"].fp8_quantize_kernel == ()
    block = nn.Module()
    block.linear1, block.linear2 = nn.Linear(32, 64), nn.Linear(64, 32)
    on_cpu = Fp8Base([block], torch.device("cpu"), kernel=("linear2",))
    assert not on_cpu.kernel and on_cpu.kernel_linears == []  # CPU: the torch ops
    on_cpu.remove()
    assert not fp8._kernel_works(torch.device("cpu"))
    monkeypatch.setattr(fp8_kernels, "AVAILABLE", True)
    monkeypatch.setattr(
        fp8_kernels, "probe", lambda device, reference, widths=(): "its result differs from torch's at width 3000"
    )
    with caplog.at_level("WARNING", logger="kiln"):
        assert not fp8._kernel_works(torch.device("cuda"))
    assert "Triton quantization kernel is off (its result differs from torch's at width 3000)" in caplog.text
    monkeypatch.setattr(fp8_kernels, "probe", lambda device, reference, widths=(): None)
    assert fp8._kernel_works(torch.device("cuda"))
    probed = []  # as on a GPU where it works
    monkeypatch.setattr(fp8, "_kernel_works", lambda device, widths=(): probed.append(widths) or True)
    installed = Fp8Base([block], torch.device("cpu"), kernel=("linear2",))
    assert installed.mode == "on+kernel" and installed.kernel_linears == [block.linear2]
    assert probed == [(64,)]  # probed at the width it will quantize: linear2's input
    installed.remove()
    unnamed = Fp8Base([block], torch.device("cpu"), kernel=("proj",))  # no Linear of that name: no probe
    assert unnamed.kernel_linears == [] and len(probed) == 1
    unnamed.remove()


def test_the_ab_switch_turns_the_triton_quantization_kernel_off(monkeypatch):
    from trainer.backends.torch_backend import fp8, fp8_kernels

    monkeypatch.setattr(fp8_kernels, "AVAILABLE", True)
    monkeypatch.setattr(fp8_kernels, "probe", lambda device, reference, widths=(): None)
    assert fp8._kernel_works(torch.device("cuda"))
    monkeypatch.setattr(fp8, "TRITON_QUANTIZE", False)
    assert not fp8._kernel_works(torch.device("cuda"))


def test_a_weight_marked_for_the_kernel_quantizes_its_forward_input_with_it_and_torch_ops_off_the_gpu(monkeypatch):
    """kernel=True reaches quantize_rows in the forward product only (the backward's gradients keep inductor's
    fused quantization); off a CUDA GPU quantize_rows keeps the torch ops."""
    from trainer.backends.torch_backend import fp8

    calls = []
    real = fp8.quantize_rows
    monkeypatch.setattr(fp8, "quantize_rows", lambda t, kernel=False: calls.append(kernel) or real(t, kernel))
    gen = torch.Generator().manual_seed(3)
    base, x = torch.randn(16, 32, generator=gen), torch.randn(4, 32, generator=gen, requires_grad=True)
    plain = Fp8Weight(base)
    marked = Fp8Weight(base)
    marked.kernel = True
    calls.clear()  # (the weights' own quantization)
    y_plain, y_marked = fp8_linear(x, plain, None), fp8_linear(x, marked, None)
    assert torch.equal(y_plain, y_marked)
    grad = torch.randn(4, 16, generator=gen)
    assert torch.equal(*(torch.autograd.grad(y, x, grad)[0] for y in (y_plain, y_marked)))
    assert calls == [False, True, False, False]  # forward, forward, backward, backward
    q0, s0 = fp8.quantize_rows_torch(x.detach())
    q1, s1 = real(x.detach(), kernel=True)
    assert torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s0, s1)


@pytest.mark.parametrize("resolutions, used", [([1024], True), ([1024, 1536], True), ([512, 768, 1024], False)])
def test_the_kernel_linears_are_taken_only_where_every_bucket_is_1024_px_or_more(
    monkeypatch, make_config, resolutions, used
):
    from trainer.backends.torch_backend import fp8, levers

    monkeypatch.setattr(fp8, "_kernel_works", lambda device, widths=(): True)  # as on a GPU where it works
    block = nn.Module()
    block.linear1, block.linear2 = nn.Linear(32, 64), nn.Linear(64, 32)
    model = nn.Sequential(block)
    cfg = make_config(fp8_compute=True, mixed_precision="bf16", resolutions=resolutions)
    installed, _ = levers.fp8_base(model, cfg, torch.device("cpu"), [block], quantize_kernel=("linear2",))
    try:
        assert installed.kernel_linears == ([block.linear2] if used else [])
    finally:
        installed.remove()


def _stored_in_fp8(model: nn.Module) -> nn.Module:
    """The tiny model's block Linears stored in e4m3, as Load Diffusion Model's weight_dtype fp8_e4m3fn stores them."""
    from trainer.archs import get_arch

    for block in find_blocks(model, get_arch("demo").block_lists):
        for layer in block.modules():
            if isinstance(layer, nn.Linear):
                layer.weight = nn.Parameter(layer.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    return model


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_base_stored_in_fp8_streamed_trains_the_same_lora_as_resident(
    tmp_path, make_model, make_data, make_config, checkpointing
):
    """fp8_compute reads a streamed weight from its ring slot at each use (Fp8Weight holds the module's Parameter, not
    the tensor it was made from, which would keep a streamed block's weights on the GPU)."""
    results = []
    for stream in (0, 2):
        cfg = make_config(
            steps=3,
            mixed_precision="bf16",
            fp8_compute=True,
            stream_blocks=stream,
            gradient_checkpointing=checkpointing,
        )
        model = _stored_in_fp8(make_model())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        results.append(train(cfg, model, make_data(), run_dir=tmp_path / f"s{stream}"))
        assert all(torch.equal(v.float(), before[k].float()) for k, v in model.state_dict().items())
    for key, weights in results[0].lora.items():
        other = results[1].lora[key]
        assert np.array_equal(weights.A, other.A) and np.array_equal(weights.B, other.B), key
    assert any(np.abs(w.B).sum() > 0 for w in results[0].lora.values())


def test_a_streamed_blocks_fp8_weights_keep_no_copy_and_read_their_slot(make_model):
    """A bf16 base: the blocks that stream drop their fp8 copies (they would stay on the GPU beside the stream's
    ring) and multiply what lies in their slot; the resident blocks keep theirs."""
    from trainer.archs import get_arch
    from trainer.backends.torch_backend import streaming

    model = make_model()
    model.requires_grad_(False)
    blocks = find_blocks(model, get_arch("demo").block_lists)
    fp8 = Fp8Base(blocks, torch.device("cpu"))
    stream = fp8.streamed(streaming.for_blocks(blocks, [1], torch.device("cpu")), blocks)
    streamed = [m for m in blocks[1].modules() if m in fp8.weights]
    resident = [m for m in blocks[0].modules() if m in fp8.weights]
    assert streamed and resident
    for layer in streamed:
        weight = fp8.weights[layer]
        assert weight.rows is None and weight.cols is None and weight.nbytes() == 0
        assert weight.weight.data_ptr() == layer.weight.data_ptr()  # the ring slot's view
        ring = stream.ring[0]
        assert ring.data_ptr() <= layer.weight.data_ptr() < ring.data_ptr() + ring.numel()
    assert all(fp8.weights[m].rows is not None and fp8.weights[m].cols is not None for m in resident)
    stream.remove()
    fp8.remove()
