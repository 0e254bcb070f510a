"""The MLX backend against the PyTorch one on the tiny DiT: same weights, same draws, same numbers.

fp32 throughout; torch is the reference. Tolerances are what fp32 allows: the two backends
differ by summation order only (forward ~1e-6), which Adam turns into weight differences of at
most ~1% of one step's size on the smallest gradients.

On mlx[cpu] the first run of a compiled graph builds its fused kernels with g++ (~1 s each,
cached under $TMPDIR/mlx), so the comparisons with torch run the step eagerly (the same
function, not compiled) and the resume test runs the compiled step, with everything switched
on, and checks it against the eager one: compiled = eager = torch.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
torch = pytest.importorskip("torch")

from helpers.resume import assert_bitwise_resume
from mlx.utils import tree_flatten

from trainer import safetensors_io
from trainer.archs import get_arch
from trainer.backends.base import Batch
from trainer.backends.mlx_backend import optim as mlx_optim
from trainer.backends.mlx_backend.backend import MlxBackend
from trainer.backends.mlx_backend.models import build
from trainer.backends.mlx_backend.models.tiny import demo_model, demo_weights
from trainer.backends.torch_backend.backend import TorchBackend
from trainer.run.loop import train

SIZES = dict(hidden=32, heads=2, double_blocks=1, single_blocks=1, in_channels=16, context_dim=32)  # conftest's


TRAIN = dict(max_grad_norm=0.01)  # clipping active: the tiny DiT's gradient norm is ~0.02


def mlx_model(seed: int = 0):
    return demo_model(seed, **SIZES)


def eager(backend: MlxBackend) -> MlxBackend:
    backend.compile_step = False  # the same step function, not compiled (no g++ kernel builds on CPU)
    return backend


def fixed_batch(batch_size=2, seed=0, height=4, width=4) -> Batch:
    rng = np.random.default_rng(seed)
    return Batch(
        latents=rng.standard_normal((batch_size, 16, height, width)).astype(np.float32),
        noise=rng.standard_normal((batch_size, 16, height, width)).astype(np.float32),
        sigmas=rng.uniform(0.2, 0.8, batch_size).astype(np.float32),
        weights=rng.uniform(0.5, 1.5, batch_size).astype(np.float32),
        context=rng.standard_normal((batch_size, 8, 32)).astype(np.float32),
    )


def both(make_model, make_config, **overrides):
    cfg = make_config(**overrides)
    torch_backend, mlx_backend = TorchBackend(), eager(MlxBackend())
    torch_backend.setup(make_model(), cfg, get_arch("demo"))
    mlx_backend.setup(mlx_model(), cfg, get_arch("demo"))
    return torch_backend, mlx_backend


def random_lora(backend, seed=1, scale=0.05):
    """The backend's LoRA with B made non-zero, so every gradient and the branch itself matter."""
    rng = np.random.default_rng(seed)
    lora = backend.lora_state()
    for weights in lora.values():
        weights.B = (scale * rng.standard_normal(weights.B.shape)).astype(np.float32)
    return lora


def run_torch(model, batch):
    with torch.no_grad():
        return model(*(torch.from_numpy(a) for a in (batch.latents, batch.sigmas, batch.context))).numpy()


def run_mlx(model, batch):
    return np.array(model(*(mx.array(a) for a in (batch.latents, batch.sigmas, batch.context))))


def test_demo_weights_are_torch_init_bit_for_bit(make_model):
    from trainer.demo.tiny_dit import build_tiny_flux

    for reference, seed, sizes in ((make_model(3), 3, SIZES), (build_tiny_flux(0), 0, {})):
        ours = demo_weights(seed, **sizes)
        theirs = {k: v.numpy() for k, v in reference.state_dict().items()}
        assert list(ours) == list(theirs)
        assert all(np.array_equal(ours[k], theirs[k]) for k in theirs)
    assert isinstance(build("demo", demo_weights(0), "float32"), type(mlx_model()))  # through the registry


def test_forward_with_lora_matches_torch(make_model, make_config):
    torch_backend, mlx_backend = both(make_model, make_config)
    lora = random_lora(torch_backend)
    torch_backend.load_lora_state(lora)
    mlx_backend.load_lora_state(lora)
    for shape in ((4, 4), (4, 6)):
        batch = fixed_batch(height=shape[0], width=shape[1])
        expected, got = run_torch(torch_backend.model, batch), run_mlx(mlx_backend.model, batch)
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    assert mlx_backend.trainable_parameter_count() == torch_backend.trainable_parameter_count()


def _loop_pair(tmp_path, make_model, make_data, make_config, monkeypatch, **overrides):
    monkeypatch.setattr(MlxBackend, "compile_step", False)  # the loop builds its own backend
    results = {}
    for name, model in (("torch", make_model()), ("mlx", mlx_model())):
        cfg = make_config(backend=name, steps=30, log_every=10, **overrides)
        results[name] = train(cfg, model, make_data(), run_dir=tmp_path / name)
    return results["torch"], results["mlx"]


def test_training_loop_matches_torch(tmp_path, make_model, make_data, make_config, monkeypatch):
    """30 steps of the real loop, clipping active (max norm below the gradients' norm), EMA on."""
    ref, ours = _loop_pair(
        tmp_path,
        make_model,
        make_data,
        make_config,
        monkeypatch,
        ema=True,
        ema_decay=0.9,
        lr_schedule="cosine_with_warmup",
        warmup_steps=3,
        **TRAIN,
    )
    assert min(ref.history.grad_norm) > 0.01  # every step was clipped
    np.testing.assert_allclose(ours.history.loss, ref.history.loss, rtol=1e-3)
    np.testing.assert_allclose(ours.history.grad_norm, ref.history.grad_norm, rtol=1e-3)
    for path, weights in ref.lora.items():  # measured ≤ 1e-6 (B ~1.6e-2 after 30 steps)
        np.testing.assert_allclose(ours.lora[path].B, weights.B, atol=1e-5)
        np.testing.assert_allclose(ours.ema_lora[path].B, ref.ema_lora[path].B, atol=1e-5)  # the EMA
        np.testing.assert_allclose(ours.ema_lora[path].A, ref.ema_lora[path].A, atol=1e-5)
    # The saved LoRA has the torch backend's keys, shapes and dtypes; run.json names the backend.
    files = [safetensors_io.read(result.checkpoint / "lora.safetensors")[0] for result in (ref, ours)]
    assert {k: (v.shape, v.dtype) for k, v in files[0].items()} == {k: (v.shape, v.dtype) for k, v in files[1].items()}
    states = [safetensors_io.read(result.checkpoint / "state.safetensors")[0] for result in (ref, ours)]
    weights_and_ema = [{k for k in state if k.startswith(("lora.", "ema."))} for state in states]
    assert weights_and_ema[0] == weights_and_ema[1]
    assert json.loads((ours.checkpoint / "run.json").read_text())["backend"] == "mlx"


def test_gradient_accumulation_matches_torch(tmp_path, make_model, make_data, make_config, monkeypatch):
    ref, ours = _loop_pair(tmp_path, make_model, make_data, make_config, monkeypatch, grad_accum=2, **TRAIN)
    np.testing.assert_allclose(ours.history.loss, ref.history.loss, rtol=1e-3)


def test_adamw_matches_torch_on_the_same_gradients():
    """The optimizer alone (trap 2): bias correction on, the configured weight decay, lr changed per step."""
    rng = np.random.default_rng(0)
    start = {"a": rng.standard_normal((4, 8)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}
    grads = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in start.items()} for _ in range(6)]
    params = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in start.items()}
    reference = torch.optim.AdamW(list(params.values()), lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
    optimizer = mlx_optim.build_optimizer("adamw", lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
    ours = {k: mx.array(v) for k, v in start.items()}
    for step, grad in enumerate(grads):
        lr = 1e-2 / (step + 1)
        for group in reference.param_groups:
            group["lr"] = lr
        for name, p in params.items():
            p.grad = torch.from_numpy(grad[name])
        reference.step()
        optimizer.learning_rate = lr
        ours = optimizer.apply_gradients({k: mx.array(v) for k, v in grad.items()}, ours)
    for name, p in params.items():
        np.testing.assert_allclose(np.array(ours[name]), p.detach().numpy(), atol=1e-6, rtol=0)


def test_adamw_steps_match_torch_through_the_backend(make_model, make_config):
    torch_backend, mlx_backend = both(make_model, make_config, weight_decay=0.01, max_grad_norm=1.0)
    lora = random_lora(torch_backend)
    torch_backend.load_lora_state(lora)
    mlx_backend.load_lora_state(lora)
    for step in range(3):
        batches = [fixed_batch(seed=step)]
        torch_backend.step(batches, 1e-3)
        mlx_backend.step(batches, 1e-3)
    ref, ours = torch_backend.lora_state(), mlx_backend.lora_state()
    for path in ref:
        for kind in ("A", "B"):  # 3 steps move weights by ~3e-3; measured ≤ 1.2e-7 apart
            np.testing.assert_allclose(getattr(ours[path], kind), getattr(ref[path], kind), atol=1e-6, rtol=0)
    tensors, meta = mlx_backend.optimizer_state()
    assert meta["scalars"]["step"] == 3 and set(meta["names"]) == set(torch_backend.params)
    assert set(tensors) == {f"{name}.{m}" for name in torch_backend.params for m in ("m", "v")}


def test_checkpointing_gives_every_lora_parameter_its_gradient(make_config):
    """Trap 1: with per-block checkpointing every LoRA weight moves, exactly as without it."""
    trained = []
    for checkpointing in (False, True):
        backend = eager(MlxBackend())
        backend.setup(
            mlx_model(),
            make_config(gradient_checkpointing=checkpointing, **{**TRAIN, "weight_decay": 0.0}),
            get_arch("demo"),
        )
        lora = random_lora(backend)
        backend.load_lora_state(lora)
        backend.step([fixed_batch()], 1e-3)
        trained.append(backend.lora_state())
        for path, weights in trained[-1].items():  # no weight decay: a weight moves iff its gradient ≠ 0
            assert np.all(weights.A != lora[path].A), path
            assert np.all(weights.B != lora[path].B), path
        backend.teardown()
    for path in trained[0]:  # compared after the first step
        np.testing.assert_allclose(trained[1][path].A, trained[0][path].A, atol=1e-7)
        np.testing.assert_allclose(trained[1][path].B, trained[0][path].B, atol=1e-7)


def test_teardown_restores_the_model(make_config):
    model = mlx_model()
    batch = fixed_batch()
    before = run_mlx(model, batch)
    modules = {path: id(m) for path, m in model.named_modules()}
    classes = {path: type(m) for path, m in model.named_modules()}
    trainable = [k for k, _ in tree_flatten(model.trainable_parameters())]
    backend = eager(MlxBackend())
    backend.setup(model, make_config(gradient_checkpointing=True, ema=True, lora_dropout=0.1), get_arch("demo"))
    backend.load_lora_state(random_lora(backend))
    backend.step([batch], 1e-2)
    assert not np.allclose(run_mlx(model, batch), before, atol=1e-4)  # the LoRA is live
    backend.teardown()
    assert {path: id(m) for path, m in model.named_modules()} == modules
    assert {path: type(m) for path, m in model.named_modules()} == classes
    assert [k for k, _ in tree_flatten(model.trainable_parameters())] == trainable
    assert np.array_equal(run_mlx(model, batch), before)


def test_an_error_in_the_loop_restores_the_model(tmp_path, make_data, make_config, monkeypatch):
    monkeypatch.setattr(MlxBackend, "compile_step", False)
    model = mlx_model()
    modules = {path: id(m) for path, m in model.named_modules()}

    def on_step(report):
        if report.step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(
            make_config(backend="mlx", steps=5, gradient_checkpointing=True),
            model,
            make_data(),
            run_dir=tmp_path,
            on_step=on_step,
        )
    assert {path: id(m) for path, m in model.named_modules()} == modules
    with pytest.raises(ValueError, match="match no Linear"):  # a failed setup leaves nothing behind
        MlxBackend().setup(model, make_config(targets=["no_such_layer"]), get_arch("demo"))
    assert {path: id(m) for path, m in model.named_modules()} == modules


def test_compiled_step_resumes_bitwise_and_equals_the_eager_step(tmp_path, make_data, make_config, monkeypatch):
    """Everything random on (LoRA dropout keys, caption dropout), EMA, accumulation, checkpointing."""
    cfg = make_config(
        backend="mlx",
        steps=8,
        checkpoint_every=3,
        caption_dropout=0.3,
        lora_dropout=0.1,
        ema=True,
        ema_decay=0.9,
        grad_accum=2,
        lr_schedule="cosine_with_warmup",
        warmup_steps=2,
        gradient_checkpointing=True,
        **TRAIN,
    )

    def run(name, stop_at=None, resume=False):
        steps = []
        return train(
            cfg,
            mlx_model(),
            make_data(count=8),
            run_dir=tmp_path / name,
            on_step=steps.append,
            resume=tmp_path / name if resume else None,
            should_stop=(lambda: len(steps) >= stop_at) if stop_at else None,
        )

    traced = []  # one gradient function per micro-batch shape, however often the lr changes
    build_gradients = MlxBackend._gradient_function
    monkeypatch.setattr(
        MlxBackend, "_gradient_function", lambda self, *a: traced.append(a) or build_gradients(self, *a)
    )
    straight = run("straight")
    assert len(traced) == 2  # 2 buckets of 4 items: two shapes over 16 micro-batches
    assert run("stopped", stop_at=3).stopped
    resumed = run("stopped", resume=True)
    assert "rng.mlx_key" in assert_bitwise_resume(straight, resumed, holds=("optim.",))
    assert straight.history.loss == resumed.history.loss
    monkeypatch.setattr(MlxBackend, "compile_step", False)
    eager_run = run("eager")
    np.testing.assert_allclose(eager_run.history.loss, straight.history.loss, rtol=1e-6)
    for path, weights in straight.lora.items():
        np.testing.assert_allclose(eager_run.lora[path].B, weights.B, atol=1e-7)
        np.testing.assert_allclose(eager_run.ema_lora[path].B, straight.ema_lora[path].B, atol=1e-7)


def test_bf16_model_trains_with_fp32_lora(make_config):
    backend = eager(MlxBackend())
    backend.setup(demo_model(0, dtype="bfloat16", **SIZES), make_config(mixed_precision="bf16"), get_arch("demo"))
    loss = backend.scalars([backend.step([fixed_batch()], 1e-3).loss])[0]
    assert np.isfinite(loss)
    assert all(v.dtype == mx.float32 for v in backend.lora.parameters().values())
    with pytest.raises(ValueError, match="bfloat16"):
        MlxBackend().setup(mlx_model(), make_config(mixed_precision="bf16"), get_arch("demo"))


def test_quantized_linear_layers_take_lora(make_config):
    import mlx.nn as nn

    model = mlx_model()
    nn.quantize(
        model,
        group_size=32,
        bits=4,
        class_predicate=lambda p, m: isinstance(m, nn.Linear) and m.weight.shape[1] % 32 == 0,
    )
    backend = eager(MlxBackend())
    backend.setup(model, make_config(), get_arch("demo"))
    layer = backend.lora.layers["double_blocks.0.img_attn.qkv"]
    assert isinstance(layer.base_layer, nn.QuantizedLinear) and layer.lora_A.shape == (4, 32)
    assert np.isfinite(backend.scalars([backend.step([fixed_batch()], 1e-3).loss])[0])
    backend.teardown()
    assert isinstance(model.double_blocks[0].img_attn.qkv, nn.QuantizedLinear)


def test_adafactor_steps_and_other_optimizers_are_refused(make_config):
    backend = eager(MlxBackend())
    backend.setup(mlx_model(), make_config(optimizer="adafactor"), get_arch("demo"))
    before = backend.lora_state()
    backend.step([fixed_batch()], 1e-3)
    assert any(not np.array_equal(before[p].B, w.B) for p, w in backend.lora_state().items())
    with pytest.raises(ValueError, match="backend 'mlx'"):
        mlx_optim.build_optimizer("lion", lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)


def test_adamw8bit_on_mlx_is_fp32_adamw_said_once(caplog):
    with caplog.at_level(logging.WARNING, logger="kiln"):
        built = mlx_optim.build_optimizer("adamw8bit", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    assert type(built) is type(
        mlx_optim.build_optimizer("adamw", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)
    )
    (line,) = [r.getMessage() for r in caplog.records if "adamw8bit" in r.getMessage()]
    assert "CUDA only" in line and "fp32 AdamW instead" in line


def test_a_run_started_from_a_lora_matches_torch(tmp_path, make_model, make_data, make_config, monkeypatch):
    """init_lora on MLX: the file's weights (and EMA shadow) at step 0, then the same steps as torch."""
    from trainer.lora import files as lora_format
    from trainer.run import init_lora

    torch_backend, _ = both(make_model, make_config)
    source = random_lora(torch_backend, seed=4)
    torch_backend.teardown()
    path = tmp_path / "start.safetensors"
    lora_format.save_lora(path, source, arch="demo", fmt="kohya", dtype="fp32", metadata={})
    cfg, init = init_lora.prepare(make_config(backend="mlx", init_lora=str(path), ema=True))
    backend = eager(MlxBackend())
    backend.setup(mlx_model(), cfg, get_arch("demo"))
    init_lora.load_into(backend, init, ema=True)
    loaded, shadow = backend.lora_state(), backend.ema_state()
    backend.teardown()
    for name, weights in source.items():
        assert np.array_equal(loaded[name].A, weights.A) and np.array_equal(loaded[name].B, weights.B)
        assert np.array_equal(shadow[f"{name}.B"], weights.B)
    ref, ours = _loop_pair(tmp_path, make_model, make_data, make_config, monkeypatch, init_lora=str(path), **TRAIN)
    for name, weights in ref.lora.items():
        assert not np.array_equal(weights.B, source[name].B)  # it trained
        np.testing.assert_allclose(ours.lora[name].B, weights.B, atol=2e-5, rtol=0)
