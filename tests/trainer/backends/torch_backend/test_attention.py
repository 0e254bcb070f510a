"""The `attention` setting: the chosen SDPA kernel goes first for the whole training step (forward,
backward and checkpointing's recompute), torch's order comes back afterwards, and "auto" picks per GPU."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from trainer import config as config_module
from trainer.archs import get_arch
from trainer.backends.torch_backend import attention
from trainer.backends.torch_backend.backend import TorchBackend
from trainer.demo import tiny_dit

from helpers.torch_batches import fixed_batch


def _first_kernels_seen(monkeypatch, make_model, make_config, **settings) -> list[SDPBackend]:
    seen = []
    real = tiny_dit.attention

    def recording(*args, **kwargs):
        seen.append(SDPBackend(torch._C._get_sdp_priority_order()[0]))
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(tiny_dit, "attention", recording)
        backend = TorchBackend()
        backend.setup(make_model(), make_config(**settings), get_arch("demo"))
        try:
            backend.step([fixed_batch()], 1e-3)
        finally:
            backend.teardown()
    return seen


@pytest.mark.parametrize(
    "choice, first",
    [("math", SDPBackend.MATH), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)],
)
def test_the_chosen_kernel_goes_first_in_forward_and_recompute(monkeypatch, make_model, make_config, choice, first):
    before = torch._C._get_sdp_priority_order()
    plain = _first_kernels_seen(monkeypatch, make_model, make_config, attention=choice, gradient_checkpointing=False)
    recomputed = _first_kernels_seen(
        monkeypatch, make_model, make_config, attention=choice, gradient_checkpointing=True
    )
    assert plain and set(plain) == {first}
    assert len(recomputed) == 2 * len(plain)  # every block's attention ran again in backward...
    assert set(recomputed) == {first}  # ...under the same choice
    assert torch._C._get_sdp_priority_order() == before  # torch's order is back after the step


def test_torch_keeps_torchs_own_order(monkeypatch, make_model, make_config):
    default_first = SDPBackend(torch._C._get_sdp_priority_order()[0])
    assert set(_first_kernels_seen(monkeypatch, make_model, make_config, attention="torch")) == {default_first}


def test_every_other_kernel_stays_behind_the_choice_as_a_fallback():
    order = attention.priority("cudnn")
    assert order[0] == SDPBackend.CUDNN_ATTENTION
    assert {SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH} <= set(order[1:])
    torch.backends.cuda.enable_flash_sdp(False)  # a user switched flash off: it stays off
    try:
        assert SDPBackend.FLASH_ATTENTION not in attention.priority("cudnn")
    finally:
        torch.backends.cuda.enable_flash_sdp(True)


def test_auto_follows_the_measured_table(monkeypatch):
    assert attention.resolve("auto", torch.device("cpu")) == "torch"
    assert attention.resolve("flash", torch.device("cpu")) == "flash"
    for capability, expected in [((9, 0), attention.AUTO_BY_CAPABILITY.get((9, 0), "torch")), ((7, 5), "torch")]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert attention.resolve("auto", torch.device("cuda")) == expected


def test_every_config_choice_has_a_kernel_and_mlx_refuses_a_choice():
    assert set(config_module.CHOICES["attention"]) == {"auto", *attention.PREFERRED}
    assert config_module.from_dict({"backend": "mlx"}).attention == "auto"
    with pytest.raises(config_module.ConfigError, match="attention 'cudnn' picks a PyTorch kernel"):
        config_module.from_dict({"backend": "mlx", "attention": "cudnn"})
    with pytest.raises(config_module.ConfigError, match="attention must be one of"):
        config_module.from_dict({"attention": "sage"})
