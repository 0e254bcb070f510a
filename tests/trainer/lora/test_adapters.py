"""LoKr, LoHa, DoRA (trainer/lora/adapters.py, torch_backend/adapters.py): closed forms, gradients, files, resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from trainer import config as config
from trainer import safetensors_io
from trainer.backends.torch_backend.lora import LoraSet
from trainer.lora import adapters
from trainer.lora import files as lora_format
from trainer.lora import report as lora_report
from trainer.lora.adapters import AdapterWeights, factorization
from trainer.run import state
from trainer.run.loop import train

from helpers.resume import assert_bitwise_resume

KINDS = {"lokr": {}, "lokr_full": {"lokr_full_w2": True}, "loha": {}, "dora": {}}


def _kind(name: str) -> str:
    return name.split("_")[0]


class Net(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(12, 8)

    def forward(self, x):
        return self.proj(x)


def _randomised(lora_set: LoraSet, seed: int) -> None:
    """Every trainable tensor random (the init has ΔW = 0, which checks nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora_set.named_parameters():  # dora_scale stays near the column norms, positive
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + (p if name.endswith("dora_scale") else 0))


def _injected(name: str, rank=2, alpha=3.0, factor=-1):
    net = Net().double().float()
    lora_set = LoraSet(
        net,
        ["proj"],
        rank=rank,
        alpha=alpha,
        dropout=0.0,
        seed=1,
        adapter=_kind(name),
        lokr_factor=factor,
        **KINDS[name],
    )
    _randomised(lora_set, 7)
    return net, lora_set


def test_factorization_follows_lycoris():
    assert factorization(12, -1) == (3, 4)
    assert factorization(3072, 4) == (4, 768)
    assert factorization(3072, -1) == (48, 64)
    assert factorization(9216, 16) == (16, 576)
    assert factorization(7, 4) == (1, 7)  # a prime: w1 is 1 wide


@pytest.mark.parametrize("name", list(KINDS))
def test_step_zero_is_the_base_model(name):
    net = Net()
    x = torch.randn(5, 12)
    before = net(x)
    LoraSet(net, ["proj"], rank=2, alpha=2.0, dropout=0.0, seed=0, adapter=_kind(name), **KINDS[name])
    assert torch.allclose(net(x), before, atol=1e-6)


@pytest.mark.parametrize("name", list(KINDS))
def test_forward_is_the_closed_form(name):
    net, lora_set = _injected(name)
    weights = lora_set.branches()["proj"].weights()
    W = net.proj.weight.detach().double().numpy()
    merged = adapters.adapted_weight(weights, W)
    assert not np.allclose(merged, W)
    x = np.random.default_rng(0).standard_normal((5, 12))
    expected = x @ merged.T + net.proj.bias.detach().double().numpy()
    got = net(torch.from_numpy(x).float()).detach().double().numpy()
    assert np.allclose(got, expected, atol=1e-4)


def test_lokr_delta_is_a_kronecker_product():
    weights = AdapterWeights(
        "lokr",
        {
            "lokr_w1": np.ones((2, 3), np.float32),
            "lokr_w2_a": np.eye(4, 2, dtype=np.float32),
            "lokr_w2_b": np.arange(8, dtype=np.float32).reshape(2, 4),
        },
        alpha=1.0,
    )
    delta = adapters.adapted_weight(weights, np.zeros((8, 12)))
    assert np.array_equal(delta, 0.5 * np.kron(np.ones((2, 3)), np.eye(4, 2) @ np.arange(8).reshape(2, 4)))


def test_dora_normalises_each_input_column():
    net, lora_set = _injected("dora")
    weights = lora_set.branches()["proj"].weights()
    merged = adapters.adapted_weight(weights, net.proj.weight.detach().numpy())
    norms = np.linalg.norm(merged, axis=0)
    scale = weights.tensors["dora_scale"][0]
    # ‖W'[:, j]‖ = m_j · ‖V_j‖/(‖V_j‖ + eps): the magnitude is what the column's norm becomes
    assert np.allclose(norms, np.abs(scale), rtol=1e-5)


@pytest.mark.parametrize("name", list(KINDS))
def test_gradients_match_finite_differences(name):
    net, lora_set = _injected(name)
    net.double()
    for branch in lora_set.branches().values():
        branch.double()
    x = torch.randn(4, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def loss():
        return (net(x) ** 2).sum()

    params = dict(lora_set.named_parameters())
    loss().backward()
    for pname, param in params.items():
        index = tuple(int(i) // 2 for i in param.shape)
        with torch.no_grad():
            original = param[index].item()
            param[index] = original + 1e-6
            up = loss().item()
            param[index] = original - 1e-6
            down = loss().item()
            param[index] = original
        assert param.grad[index].item() == pytest.approx((up - down) / 2e-6, rel=1e-4, abs=1e-6), pname


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("fmt", ["comfy", "kohya"])
def test_file_round_trip(tmp_path, name, fmt):
    _, lora_set = _injected(name)
    lora = {"double_blocks.0.img_attn.qkv": lora_set.branches()["proj"].weights()}
    path = tmp_path / "a.safetensors"
    meta = lora_format.build_metadata(
        arch_name="demo", config={"adapter": _kind(name)}, steps=1, trigger_words=[], title="t"
    )
    lora_format.save_lora(path, lora, arch="demo", fmt=fmt, dtype="fp32", metadata=meta)
    back, metadata = lora_format.load_lora(path)
    assert metadata["kiln.adapter"] == _kind(name)
    (loaded,) = back.values()
    assert list(back) == list(lora) and loaded.kind == _kind(name) and loaded.alpha == 3.0
    for role, array in lora["double_blocks.0.img_attn.qkv"].tensors.items():
        assert np.array_equal(loaded.tensors[role], array), role
    info = lora_report.describe(path)
    assert info["adapter"] == [_kind(name)] and info["parameters"] == loaded.size


def test_bf16_file_keeps_dora_scale_in_fp32(tmp_path):
    _, lora_set = _injected("dora")
    lora = {"double_blocks.0.img_attn.qkv": lora_set.branches()["proj"].weights()}
    lora_format.save_lora(tmp_path / "d.safetensors", lora, arch="demo", dtype="bf16", metadata={})
    header, _ = safetensors_io.read_header(tmp_path / "d.safetensors")
    assert header["diffusion_model.double_blocks.0.img_attn.qkv.dora_scale"]["dtype"] == "F32"
    assert header["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"]["dtype"] == "BF16"


def test_diffusers_and_lora_tools_refuse_adapters(tmp_path):
    _, lora_set = _injected("lokr")
    lora = {"double_blocks.0.img_attn.qkv": lora_set.branches()["proj"].weights()}
    with pytest.raises(ValueError, match="diffusers.*no lokr layout"):
        lora_format.to_tensors(lora, "diffusers", "demo")
    with pytest.raises(ValueError, match="LoKr adapter; merging"):
        adapters.require_lora(lora, "merging")


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"adapter": "dora", "backend": "mlx", "base_quantize": "int8"}, "adapter 'dora' reads the base weight"),
        ({"adapter": "lokr", "lora_dropout": 0.1}, "lora_dropout applies to adapter 'lora' only"),
        ({"adapter": "loha", "init_lora": "x.safetensors"}, "cannot start adapter 'loha'"),
        ({"adapter": "dora", "lora_format": "diffusers"}, "no dora layout"),
        ({"adapter": "lokr", "lokr_factor": 0}, "lokr_factor must be -1"),
    ],
)
def test_config_refuses(settings, message):
    with pytest.raises(config.ConfigError, match=message):
        config.from_dict({"arch": "demo", **settings})


@pytest.mark.parametrize("name", ["lokr", "loha", "dora"])
def test_resume_is_bitwise_and_ema_covers_every_tensor(tmp_path, make_model, make_data, make_config, name):
    cfg = make_config(steps=6, checkpoint_every=2, ema=True, ema_decay=0.9, adapter=name, lokr_factor=2)

    def run(folder, stop_at=None, resume=False):
        progress = []
        stop = (lambda: len(progress) >= stop_at) if stop_at else None
        return train(
            cfg,
            make_model(),
            make_data(),
            run_dir=tmp_path / folder,
            resume=tmp_path / folder if resume else None,
            on_step=progress.append,
            should_stop=stop,
        )

    straight = run("straight")
    run("stopped", stop_at=3)
    resumed = run("stopped", resume=True)
    a = assert_bitwise_resume(straight, resumed)
    trained = {k[len("lora.") :] for k in a if k.startswith("lora.") and not k.endswith(".alpha")}
    assert trained == {k[len("ema.") :] for k in a if k.startswith("ema.")}  # EMA shadows every tensor
    assert all(w.kind == name for w in straight.lora.values())
    shadow = state.checkpoint_lora(state.load_checkpoint(straight.checkpoint), ema=True)
    assert all(w.kind == name for w in shadow.values())
    moved = [
        not np.array_equal(w.tensors[r], s.tensors[r])
        for w, s in zip(straight.lora.values(), shadow.values())
        for r in w.tensors
    ]
    assert any(moved)
    file_lora, metadata = lora_format.load_lora(straight.checkpoint / "lora.safetensors")
    assert metadata["kiln.adapter"] == name and set(file_lora) == set(straight.lora)


def test_estimate_counts_each_kind():
    from trainer.estimate.common import get_dims, lora_shapes
    from trainer.estimate.torch_step import estimate

    shapes = lora_shapes(get_dims("flux2-klein-4b"), None)
    base = estimate("flux2-klein-4b", resolution=512, rank=16)
    got = {
        kind: estimate("flux2-klein-4b", resolution=512, rank=16, adapter=kind, lokr_factor=8)
        for kind in ("lokr", "loha", "dora")
    }
    assert base.lora_params == sum(16 * (i + o) for i, o in shapes)
    assert got["dora"].lora_params == base.lora_params + sum(i for i, _ in shapes)
    assert got["loha"].lora_params == 2 * base.lora_params
    lokr = sum(
        adapters.factorization(o, 8)[0] * adapters.factorization(i, 8)[0]
        + 16 * (adapters.factorization(o, 8)[1] + adapters.factorization(i, 8)[1])
        for i, o in shapes
    )
    assert got["lokr"].lora_params == lokr
    assert got["dora"].optimizer == 8 * got["dora"].lora_params  # adamw: two fp32 moments
    assert got["loha"].workspace > base.workspace and got["dora"].workspace > base.workspace
    assert got["lokr"].workspace == base.workspace


def test_lora_tools_and_init_lora_refuse_adapter_files(tmp_path):
    from trainer.lora import tools as lora_tools
    from trainer.run import init_lora

    _, lora_set = _injected("loha")
    lora = {"double_blocks.0.img_attn.qkv": lora_set.branches()["proj"].weights()}
    lora_format.save_lora(tmp_path / "h.safetensors", lora, arch="demo", dtype="fp32", metadata={})
    with pytest.raises(ValueError, match="LoHa adapter; resize works on plain LoRA pairs"):
        lora_tools.resize(lora, lora_tools.RankRule(rank=2))
    with pytest.raises(ValueError, match="LoHa adapter; merge"):
        lora_tools.merge([lora])
    with pytest.raises(ValueError, match="h.safetensors is a LoHa adapter; init_lora"):
        init_lora.from_file(tmp_path / "h.safetensors")


@pytest.mark.parametrize("name", ["lokr", "loha", "dora"])
def test_mlx_matches_torch(tmp_path, make_model, make_data, make_config, monkeypatch, name):
    """A few steps of the real loop on both backends (MLX eager, as tests/trainer/backends/mlx_backend/test_backend.py)."""
    pytest.importorskip("mlx.core")
    from trainer.backends.mlx_backend.backend import MlxBackend
    from trainer.backends.mlx_backend.models.tiny import demo_model

    monkeypatch.setattr(MlxBackend, "compile_step", False)
    results = {}
    for backend, model in (
        ("torch", make_model()),
        ("mlx", demo_model(0, hidden=32, heads=2, double_blocks=1, single_blocks=1, in_channels=16, context_dim=32)),
    ):
        cfg = make_config(backend=backend, steps=8, log_every=4, adapter=name, lokr_factor=4, ema=True, ema_decay=0.9)
        results[backend] = train(cfg, model, make_data(), run_dir=tmp_path / backend)
    ref, ours = results["torch"], results["mlx"]
    np.testing.assert_allclose(ours.history.loss, ref.history.loss, rtol=1e-3)
    for path, weights in ref.lora.items():
        assert ours.lora[path].kind == name
        for role, array in weights.tensors.items():
            np.testing.assert_allclose(ours.lora[path].tensors[role], array, atol=1e-5, err_msg=f"{path}.{role}")
            np.testing.assert_allclose(
                ours.ema_lora[path].tensors[role],
                ref.ema_lora[path].tensors[role],
                atol=1e-5,
                err_msg=f"EMA {path}.{role}",
            )
    moved = [
        not np.allclose(w.tensors[r], s.tensors[r])
        for w, s in zip(ref.lora.values(), ref.ema_lora.values())
        for r in w.tensors
    ]
    assert any(moved)


def test_mlx_estimate_counts_each_kind():
    from trainer.estimate.mlx_step import estimate_mlx

    base = estimate_mlx("flux2-klein-4b", resolution=512, rank=16)
    loha = estimate_mlx("flux2-klein-4b", resolution=512, rank=16, adapter="loha")
    assert loha.lora_params == 2 * base.lora_params and loha.workspace > base.workspace
