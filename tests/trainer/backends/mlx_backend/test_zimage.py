"""The MLX Z-Image port against ComfyUI's NextDiT, through goldens (no ComfyUI or torch needed here).

tests/goldens/zimage*.safetensors hold inputs and ComfyUI's output for the tiny Z-Image of
`trainer.demo.tiny_weights.zimage_weights(seed)`; scripts/make_goldens.py writes them (`zimage`,
`zimage_short_caption`), calling ComfyUI's model as nodes/comfy/ does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")

from mlx.utils import tree_flatten

from trainer import safetensors_io
from trainer.archs.zimage import DEFAULT_TARGETS
from trainer.backends.mlx_backend.models import build, zimage
from trainer.demo.tiny_weights import zimage_weights
from trainer.lora.targets import matches, select_targets

GOLDENS = Path(__file__).resolve().parents[3] / "goldens"
TOLERANCE = 1e-4  # max |ours − ComfyUI| relative to max |ComfyUI|, fp32


def load_golden(name: str):
    tensors, metadata = safetensors_io.read(GOLDENS / f"{name}.safetensors")
    return tensors, metadata


@pytest.fixture(scope="module")
def model():
    recipe = json.loads(load_golden("zimage")[1]["kiln.weights"])
    assert recipe["function"] == "zimage_weights"
    return zimage.build("zimage", zimage_weights(recipe["seed"], **recipe["kwargs"]), dtype="float32")


@pytest.mark.parametrize("name", ["zimage", "zimage_short_caption"])
def test_matches_comfyui_golden(model, name):
    golden, metadata = load_golden(name)
    x, sigma, context = golden["x"], golden["timestep"], golden["context"]
    assert x.shape[0] == 2 and context.shape[1] == int(metadata["kiln.num_tokens"])
    out = model(x, sigma, context, context.shape[1])
    assert out.dtype == mx.float32 and tuple(out.shape) == x.shape
    expected = golden["output"]
    error = np.abs(np.array(out) - expected).max() / np.abs(expected).max()
    assert error <= TOLERANCE, f"{name}: max relative error {error:.2e} > {TOLERANCE}"


def test_goldens_differ_in_caption_length():
    lengths = {load_golden(name)[0]["context"].shape[1] for name in ("zimage", "zimage_short_caption")}
    assert len(lengths) == 2


def test_registry_builds_both_arch_names():
    weights = zimage_weights(1, n_layers=1, n_refiner_layers=1)
    for arch_name in ("zimage", "zimage_turbo"):
        model = build(arch_name, weights, "float32")
        assert isinstance(model, zimage.ZImage) and len(model.layers) == 1
    assert build("zimage", weights).x_embedder.weight.dtype == mx.bfloat16  # default dtype
    out = build("zimage", weights)(np.zeros((1, 16, 4, 4), np.float32), [0.5], np.ones((1, 3, 64), np.float32), 3)
    assert out.dtype == mx.bfloat16 and out.shape == (1, 16, 4, 4)


def test_sizes_inferred_from_shapes():
    config = zimage.config_from_weights(zimage_weights(0, dim=384, n_layers=3, n_refiner_layers=1, cap_feat_dim=32))
    assert config["dim"] == 384 and config["heads"] == config["kv_heads"] == 3
    assert (config["n_layers"], config["n_refiner_layers"], config["cap_feat_dim"]) == (3, 1, 32)
    assert config["ffn_dim"] == 1024 and (config["in_channels"], config["patch"]) == (16, 2)


def test_default_lora_targets_resolve_to_linear(model):
    modules = dict(model.named_modules())
    linears = [name for name, module in modules.items() if isinstance(module, nn.Linear)]
    selected = select_targets(linears, DEFAULT_TARGETS)
    for pattern in DEFAULT_TARGETS:
        hits = [name for name in modules if matches(name, pattern)]
        assert hits and all(isinstance(modules[name], nn.Linear) for name in hits), pattern
    assert "layers.0.attention.qkv" in selected and "layers.1.feed_forward.w3" in selected
    assert "noise_refiner.0.attention.out" in selected and "context_refiner.1.feed_forward.w2" in selected
    # every parameter has its ComfyUI name (state-dict round trip)
    assert {name for name, _ in tree_flatten(model.parameters())} == set(zimage_weights(0))


def test_mismatched_weights_are_named():
    weights = zimage_weights(0, n_layers=1, n_refiner_layers=1)
    weights["layers.0.feed_forward.w2.weight"] = weights["layers.0.feed_forward.w2.weight"][:, :-1]
    with pytest.raises(ValueError, match=r"layers\.0\.feed_forward\.w2\.weight"):
        zimage.build("zimage", weights, "float32")
    with pytest.raises(ValueError, match="strip"):
        zimage.build("zimage", {"model.diffusion_model." + k: v for k, v in weights.items()}, "float32")


def test_bfloat16_and_checkpointed_blocks_stay_close(model):
    golden, _ = load_golden("zimage")
    inputs = (golden["x"], golden["timestep"], golden["context"], golden["context"].shape[1])
    expected = golden["output"]
    recipe = json.loads(load_golden("zimage")[1]["kiln.weights"])
    half = zimage.build("zimage", zimage_weights(recipe["seed"], **recipe["kwargs"]))  # bfloat16
    out = half(*inputs)
    assert out.dtype == mx.bfloat16
    assert np.abs(np.array(out.astype(mx.float32)) - expected).max() / np.abs(expected).max() < 5e-2
    model.checkpoint_blocks = True
    try:
        checkpointed = np.array(model(*inputs))
    finally:
        model.checkpoint_blocks = False
    assert np.abs(checkpointed - expected).max() / np.abs(expected).max() <= TOLERANCE


def test_rows_of_different_caption_lengths_run_as_separate_prompts():
    """A batch with per-row num_tokens equals each row run alone with its own caption (as ComfyUI does)."""
    model = build("zimage", zimage_weights(0), "float32")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 16, 4, 4)).astype(np.float32)
    sigma = np.array([0.3, 0.6, 0.9], np.float32)
    lengths = [5, 9, 5]
    context = np.zeros((3, 9, model.cap_embedder[1].weight.shape[1]), np.float32)
    for row, n in enumerate(lengths):
        context[row, :n] = rng.standard_normal((n, context.shape[2]))
    batch = np.array(model(x, sigma, context, num_tokens=np.array(lengths)))
    for row, n in enumerate(lengths):
        alone = np.array(model(x[row : row + 1], sigma[row : row + 1], context[row : row + 1, :n]))
        np.testing.assert_allclose(batch[row : row + 1], alone, rtol=1e-5, atol=1e-5)
    padded = np.array(model(x[:1], sigma[:1], context[:1]))  # zero padding is not neutral
    assert not np.allclose(padded, batch[:1], atol=1e-4)


def test_trains_in_the_mlx_backend_with_captions_of_different_lengths(tmp_path):
    """Through the loop and the compiled step: per-row caption lengths reach the model as constants."""
    from trainer import config as config_module
    from trainer.data import InMemoryData
    from trainer.run.loop import train

    model = build("zimage", zimage_weights(0), "float32")
    rng = np.random.default_rng(0)
    dim = model.cap_embedder[1].weight.shape[1]
    latents = [rng.standard_normal((16, 4, 4)).astype(np.float32) for _ in range(4)]
    contexts = [rng.standard_normal((n, dim)).astype(np.float32) for n in (3, 7, 3, 5)]
    data = InMemoryData.from_arrays(latents, contexts, [f"{i}.png" for i in range(4)], np.zeros((2, dim), np.float32))
    cfg = config_module.from_dict(
        dict(
            arch="zimage",
            backend="mlx",
            mixed_precision="no",
            steps=3,
            batch_size=2,
            rank=4,
            alpha=4.0,
            learning_rate=1e-3,
            checkpoint_every=0,
            log_every=1,
            caption_dropout=0.0,
            gradient_checkpointing=False,
            resolutions=[64],
        )
    )
    result = train(cfg, model, data, run_dir=tmp_path)
    assert len(result.history.loss) == 3 and all(np.isfinite(result.history.loss))
