"""The PyTorch backend on the tiny DiT: learning, clipping, EMA, accumulation, checkpointing, teardown."""

from __future__ import annotations

import logging
import re
import sys

import numpy as np
import pytest
import torch

from trainer.archs import get_arch
from trainer.backends.torch_backend.backend import TorchBackend
from trainer.backends.torch_backend.optim import OptimizerUnavailable, clip_global_norm, training_mode

from helpers.torch_batches import fixed_batch, inplace_net_with_lora, split


def backend_for(make_model, make_config, **overrides) -> TorchBackend:
    backend = TorchBackend()
    backend.setup(make_model(), make_config(**overrides), get_arch("demo"))
    return backend


def test_overfits_one_fixed_batch(make_model, make_config):
    backend = backend_for(make_model, make_config, rank=8, alpha=8.0, learning_rate=3e-2, max_grad_norm=0.0)
    batch = fixed_batch()
    losses = backend.scalars([backend.step([batch], 3e-2).loss for _ in range(50)])
    assert losses[-1] <= 0.5 * losses[0], (losses[0], losses[-1])


def test_clipping_matches_torch_clip_grad_norm():
    torch.manual_seed(0)
    grads = [torch.randn(5, 7) * 3, torch.randn(11), torch.randn(2, 3, 4)]
    reference = [g.clone() for g in grads]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in reference]
    for p, g in zip(params, reference):
        p.grad = g
    expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0, foreach=False)
    total = clip_global_norm(grads, 1.0)
    assert torch.allclose(total, expected_norm, rtol=1e-6)
    for got, want in zip(grads, params):
        assert torch.allclose(got, want.grad, rtol=1e-6, atol=1e-7)
    small = [torch.full((3,), 1e-3)]
    clip_global_norm(small, 1.0)
    assert torch.equal(small[0], torch.full((3,), 1e-3))  # below the threshold: untouched


def test_ema_matches_its_formula(make_model, make_config):
    decay = 0.9
    backend = backend_for(make_model, make_config, ema=True, ema_decay=decay)
    name = next(iter(backend.params))
    expected = backend.params[name].detach().clone()
    for step in range(5):
        backend.step([fixed_batch(seed=step)], 1e-2)
        backend.update_ema()
        expected = decay * expected + (1 - decay) * backend.params[name].detach()
    assert torch.allclose(backend.ema.shadow[name], expected, atol=1e-7)
    assert backend.ema.updates == 5
    trained = backend.params[name].detach().clone()
    assert not torch.allclose(trained, expected)  # EMA is really different from the weights
    with backend.ema_weights():
        assert torch.equal(backend.params[name].detach(), backend.ema.shadow[name])
    assert torch.equal(backend.params[name].detach(), trained)  # swapped back


def test_gradient_accumulation_equals_the_full_batch(make_model, make_config):
    batch = fixed_batch(batch_size=2)
    grads = []
    for micro in ([batch], split(batch)):
        backend = backend_for(make_model, make_config, learning_rate=1e-3)
        backend.optimizer.step = lambda: None  # keep the gradients to compare
        backend.optimizer.zero_grad = lambda set_to_none=True: None
        with torch.no_grad():  # make B non-zero so every gradient matters
            for p in backend.params.values():
                p.add_(0.01)
        backend.step(micro, 1e-3)
        grads.append(torch.cat([p.grad.flatten() for p in backend.params.values()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_checkpointing_gives_the_same_gradients(make_model, make_config):
    batch, grads = fixed_batch(), []
    for checkpointing in (False, True):
        backend = backend_for(make_model, make_config, gradient_checkpointing=checkpointing)
        backend.optimizer.step = lambda: None
        with torch.no_grad():
            for p in backend.params.values():
                p.add_(0.01)
        backend.optimizer.zero_grad = lambda set_to_none=True: None
        backend.step([batch], 1e-3)
        grads.append(torch.cat([p.grad.flatten() for p in backend.params.values()]))
        assert backend.checkpointing.recompute == checkpointing
        backend.teardown()
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    assert torch.count_nonzero(grads[1]) > 0.5 * grads[1].numel()


def test_bf16_autocast_keeps_fp32_lora_parameters(make_model, make_config):
    backend = backend_for(make_model, make_config, mixed_precision="bf16")
    loss = backend.scalars([backend.step([fixed_batch()], 1e-3).loss])[0]
    assert np.isfinite(loss)
    assert all(p.dtype == torch.float32 for p in backend.params.values())


def test_bf16_steps_cast_the_lora_weights_once_and_recompute_sees_them(make_model, make_config):
    """Under bf16 autocast each step multiplies by (scale·A, B) cast once (LoraSet.step_weights), held through
    backward: checkpointing's recompute must use the same weights, or its gradients would differ."""
    grads, seen, calls = [], [], []
    for checkpointing in (False, True):
        backend = backend_for(
            make_model,
            make_config,
            mixed_precision="bf16",
            rank=4,
            alpha=12.0,  # scale 3
            gradient_checkpointing=checkpointing,
        )
        backend.optimizer.step = lambda: None
        backend.optimizer.zero_grad = lambda set_to_none=True: None
        with torch.no_grad():
            for p in backend.params.values():
                p.add_(0.01)
        branch = next(iter(backend.lora.branches().values()))
        original = type(branch).forward
        type(branch).forward = lambda self, x: (seen.append(self.step_weights is not None), original(self, x))[1]
        try:
            backend.step([fixed_batch()], 1e-3)
        finally:
            type(branch).forward = original
        assert all(p.grad.dtype == torch.float32 for p in backend.params.values())
        assert branch.step_weights is None  # not kept past the step
        calls.append(len(seen))
        grads.append(torch.cat([p.grad.flatten() for p in backend.params.values()]))
        backend.teardown()
    assert seen and all(seen)  # forward and recompute alike
    assert calls[1] - calls[0] == 2 * calls[0]  # the checkpointed run did recompute
    assert torch.equal(grads[0], grads[1])


def test_teardown_restores_the_model_exactly(make_model, make_config):
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    backend = TorchBackend()
    backend.setup(model, make_config(gradient_checkpointing=True), get_arch("demo"))
    backend.step([fixed_batch()], 1e-2)
    backend.teardown()
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert [p.requires_grad for p in model.parameters()] == flags
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_builtin_optimizers_step(make_model, make_config, optimizer):
    backend = backend_for(make_model, make_config, optimizer=optimizer)
    before = {n: p.detach().clone() for n, p in backend.params.items()}
    backend.step([fixed_batch()], 1e-3)
    assert any(not torch.equal(before[n], p) for n, p in backend.params.items())


@pytest.mark.parametrize(
    "optimizer,module,pip",
    [
        ("prodigy", "prodigyopt", "pip install prodigyopt"),
        ("lion", "lion_pytorch", "pip install lion-pytorch==0.2.5"),
        ("came", "came_pytorch", "pip install came-pytorch==0.1.3"),
        ("schedulefree", "schedulefree", "pip install schedulefree==1.4.1"),
        ("adamw8bit_torchao", "torchao", "pip install torchao==0.18.0"),
    ],
)
def test_optional_optimizers_say_what_to_install(make_model, make_config, monkeypatch, optimizer, module, pip):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it raises ImportError
    lr = 1.0 if optimizer == "prodigy" else 1e-4
    with pytest.raises(OptimizerUnavailable, match=re.escape(pip)):
        backend_for(make_model, make_config, optimizer=optimizer, learning_rate=lr)


def test_adamw8bit_without_cuda_trains_fp32_adamw_and_says_so(make_model, make_config, caplog):
    with caplog.at_level(logging.WARNING, logger="kiln"):
        backend = backend_for(make_model, make_config, optimizer="adamw8bit")
    assert type(backend.optimizer) is torch.optim.AdamW
    (line,) = [r.getMessage() for r in caplog.records if "adamw8bit" in r.getMessage()]
    assert "runs on CUDA only on cpu" in line and "fp32 AdamW instead" in line and " MB " in line


def test_adamw8bits_fallback_state_is_not_loaded_into_the_8bit_optimizer_or_back(make_model, make_config):
    """A checkpoint says when adamw8bit ran as fp32 AdamW (off CUDA); resuming it where bitsandbytes' 8-bit AdamW
    is built (or the other way round) is refused with a clear message, not a state that does not fit."""
    from trainer.backends.torch_backend.optim import load_optimizer_arrays, optimizer_arrays

    fell_back = backend_for(make_model, make_config, optimizer="adamw8bit")
    fell_back.step([fixed_batch()], 1e-4)
    names = list(fell_back.params)
    tensors, meta = optimizer_arrays(fell_back.optimizer, names)
    assert meta["fell_back"] == "adamw8bit"
    load_optimizer_arrays(fell_back.optimizer, names, tensors, meta)  # the same kind: loads
    plain = backend_for(make_model, make_config, optimizer="adamw")  # stands for the 8-bit one: no fallback mark
    with pytest.raises(ValueError, match="adamw8bit's fallback off CUDA.*bitsandbytes' 8-bit AdamW"):
        load_optimizer_arrays(plain.optimizer, names, tensors, meta)
    plain_tensors, plain_meta = optimizer_arrays(plain.optimizer, names)
    assert "fell_back" not in plain_meta  # every other optimizer's checkpoint as before
    with pytest.raises(ValueError, match="state is bitsandbytes' 8-bit AdamW's"):
        load_optimizer_arrays(fell_back.optimizer, names, plain_tensors, plain_meta)


def test_schedulefree_weights_hold_its_average_outside_a_step(make_model, make_config):
    pytest.importorskip("schedulefree")
    backend = backend_for(make_model, make_config, optimizer="schedulefree", learning_rate=1e-2)
    for step in range(3):
        backend.step([fixed_batch(seed=step)], 1e-2)
    assert backend.optimizer.param_groups[0]["train_mode"] is False  # samples, saves and the EMA read x
    averaged = {n: p.detach().clone() for n, p in backend.params.items()}
    with training_mode(backend.optimizer):  # the point gradients are taken at differs from the average
        assert any(not torch.equal(averaged[n], p) for n, p in backend.params.items())


def test_optimizer_state_round_trip(make_model, make_config):
    backend = backend_for(make_model, make_config)
    for step in range(3):
        backend.step([fixed_batch(seed=step)], 1e-3)
    tensors, meta = backend.optimizer_state()
    assert any(k.endswith(".exp_avg_sq") for k in tensors) and meta["names"] == list(backend.params)
    other = backend_for(make_model, make_config)
    other.load_optimizer_state(tensors, meta)
    again, _ = other.optimizer_state()
    assert set(again) == set(tensors)
    assert all(np.array_equal(again[k], tensors[k]) for k in tensors)


def test_checkpointing_survives_blocks_that_modify_their_input():
    from trainer.backends.torch_backend.checkpointing import BlockCheckpointing

    x, grads = torch.randn(2, 3, 8), []
    for checkpointing in (False, True):
        net, lora = inplace_net_with_lora()
        hooks = BlockCheckpointing(net, ("blocks",)) if checkpointing else None
        net(x).square().sum().backward()  # raised "modified by an inplace operation" before the fix
        grads.append(torch.cat([p.grad.flatten() for _, p in lora.named_parameters()]))
        if hooks:
            hooks.remove()
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_bf16_base_model_trains_fp32_lora(make_model, make_config, mixed_precision):
    backend = TorchBackend()
    backend.setup(make_model().to(torch.bfloat16), make_config(mixed_precision=mixed_precision), get_arch("demo"))
    losses = backend.scalars([backend.step([fixed_batch()], 1e-2).loss for _ in range(3)])
    assert all(np.isfinite(losses))
    assert all(p.dtype == torch.float32 and p.grad is None for p in backend.params.values())  # zeroed after step
    assert any(torch.count_nonzero(b.lora_B) for b in backend.lora.branches().values())  # it learned


def test_blocks_that_write_into_their_inputs_train_without_checkpointing(make_config):
    """ComfyUI's Flux2 blocks do `x += ...`; with checkpointing off backward must still work."""
    import numpy as np
    import torch
    from torch import nn

    from trainer.archs import get_arch
    from trainer.backends.base import Batch
    from trainer.backends.torch_backend.backend import TorchBackend

    class InPlaceBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear1 = nn.Linear(4, 4)

        def forward(self, x):
            x += torch.tanh(self.linear1(x))  # in place on the block input, as ComfyUI's blocks do
            return x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.double_blocks = nn.ModuleList([InPlaceBlock()])
            self.single_blocks = nn.ModuleList([InPlaceBlock()])

        def forward(self, x, sigma, context):
            h = x.permute(0, 2, 3, 1) * 1.0
            for block in [*self.double_blocks, *self.single_blocks]:
                h = block(h)
            return h.permute(0, 3, 1, 2)

    rng = np.random.default_rng(0)
    batch = Batch(
        latents=rng.standard_normal((1, 4, 2, 2)).astype(np.float32),
        noise=rng.standard_normal((1, 4, 2, 2)).astype(np.float32),
        sigmas=np.array([0.5], np.float32),
        weights=np.ones(1, np.float32),
        context=np.zeros((1, 1, 4), np.float32),
    )
    after = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        model = Model()
        backend = TorchBackend()
        backend.setup(model, make_config(gradient_checkpointing=recompute, targets=["linear1"]), get_arch("demo"))
        for _ in range(2):  # B moves off zero in step 1, so step 2's A gradient depends on the saved inputs
            stats = backend.step([batch], 1e-2)
        assert np.isfinite(backend.scalars([stats.loss])[0])
        after[recompute] = backend.lora_state()
        backend.teardown()
    for path in after[True]:  # both paths give the true gradients, so the same weights
        np.testing.assert_allclose(after[False][path].A, after[True][path].A, rtol=1e-5, atol=1e-6)


def test_per_row_extras_stay_on_the_host_and_other_float_extras_follow_the_model(make_model, make_config):
    """Token counts choose shapes and ComfyUI reads Dev's guidance as a Python number: reading either back
    from the GPU would stall the host every step (and stop a step graph's recording)."""
    seen = {}

    def forward(model, x_t, sigmas, context, extras):
        seen.update(extras)
        return model(x_t, sigmas, context)

    backend = TorchBackend()
    backend.setup(make_model(), make_config(), get_arch("demo"), forward=forward)
    batch = fixed_batch()
    batch.extras = {
        "num_tokens": np.array([8, 5]),
        "guidance": np.array([1.0, 1.0], np.float32),
        "features": np.ones((2, 3), np.float32),
    }
    backend.step([batch], 1e-3)
    assert seen["num_tokens"].device.type == "cpu" and seen["num_tokens"].dtype == torch.int64
    assert seen["num_tokens"].tolist() == [8, 5]
    assert seen["guidance"].device.type == "cpu" and seen["guidance"].dtype == backend.dtype
    assert seen["guidance"].tolist() == [1.0, 1.0]
    assert seen["features"].device == backend.device and seen["features"].dtype == backend.dtype


def test_a_clips_mask_weighs_every_frame():
    """Video latents [B,C,T,H,W] take an image's loss mask [B,1,H,W] on each frame ([B,1,1,H,W])."""
    from trainer.backends.base import Batch
    from trainer.backends.torch_backend.device_batch import flow_tensors

    rng = np.random.default_rng(0)
    latents = rng.standard_normal((2, 4, 3, 2, 2)).astype(np.float32)
    mask = rng.random((2, 1, 2, 2)).astype(np.float32)
    batch = Batch(latents, latents, np.full(2, 0.5, np.float32), np.ones(2, np.float32), np.zeros((2, 1, 8)), mask=mask)
    tensors = flow_tensors(batch, torch.device("cpu"))
    assert tensors["mask"].shape == (2, 1, 1, 2, 2) and tensors["x0"].shape == latents.shape
    weighted = torch.ones(2, 4, 3, 2, 2) * tensors["mask"]
    assert torch.equal(weighted[:, 2, 1], torch.from_numpy(mask[:, 0]))  # frame 1 of channel 2: the image's mask
    image = Batch(latents[:, :, 0], latents[:, :, 0], batch.sigmas, batch.weights, batch.context, mask=mask)
    assert flow_tensors(image, torch.device("cpu"))["mask"].shape == (2, 1, 2, 2)  # images as they were
