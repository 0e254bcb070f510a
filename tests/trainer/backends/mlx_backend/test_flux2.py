"""The MLX Flux2 against ComfyUI's goldens (scripts/make_goldens.py), its module paths, and fp8 loading."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")

from trainer import safetensors_io
from trainer.archs.flux2 import DEFAULT_TARGETS  # noqa: E402
from trainer.backends.mlx_backend.models import build  # noqa: E402
from trainer.backends.mlx_backend.models.weights import load_comfy_file  # noqa: E402
from trainer.demo import tiny_weights  # noqa: E402
from trainer.lora.targets import select_targets  # noqa: E402

GOLDENS = Path(__file__).resolve().parents[3] / "goldens"
FLUX2_GOLDENS = ("flux2_klein", "flux2_dev")
TOLERANCE = 1e-4  # max |MLX − ComfyUI| / max |ComfyUI|, both float32


def read_golden(name: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(inputs and output, the tiny weights they were made from)."""
    tensors, metadata = safetensors_io.read(GOLDENS / f"{name}.safetensors")
    spec = json.loads(metadata["kiln.weights"])
    weights = getattr(tiny_weights, spec["function"])(spec["seed"], **spec["kwargs"])
    return tensors, weights


def run(model, golden: dict[str, np.ndarray]) -> np.ndarray:
    out = model(golden["x"], golden["timestep"], golden["context"], guidance=golden.get("guidance"))
    return np.array(out.astype(mx.float32))


def relative_error(out: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(out - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("name", FLUX2_GOLDENS)
def test_matches_comfyui_golden(name):
    golden, weights = read_golden(name)
    out = run(build(name, weights, dtype="float32"), golden)
    assert out.shape == golden["output"].shape
    assert relative_error(out, golden["output"]) <= TOLERANCE


@pytest.mark.parametrize("name", FLUX2_GOLDENS)
def test_bfloat16_is_close(name):
    """The default dtype: weights and activations in bf16 (a port that silently computed in float32 would
    pass the golden but cost twice the memory)."""
    golden, weights = read_golden(name)
    model = build(name, weights)
    assert {p.dtype for _, p in _parameters(model)} == {mx.bfloat16}
    out = model(golden["x"], golden["timestep"], golden["context"], guidance=golden.get("guidance"))
    assert out.dtype == mx.bfloat16
    assert relative_error(np.array(out.astype(mx.float32)), golden["output"]) <= 5e-2


@pytest.mark.parametrize("quantize,tolerance", [("int8", 2e-2), ("int4", 0.12)])
def test_quantized_base_keeps_the_output(quantize, tolerance):
    """base_quantize: the block Linears become QuantizedLinear (embedders, modulation and the final
    layer stay bf16), the weights shrink, and the output stays near the bf16 model's."""
    golden, weights = read_golden("flux2_klein")
    reference = run(build("flux2_klein", weights), golden)
    model = build("flux2_klein", weights, quantize=quantize)
    assert isinstance(model.double_blocks[0].img_attn.qkv, nn.QuantizedLinear)
    assert isinstance(model.single_blocks[1].linear2, nn.QuantizedLinear)
    assert type(model.img_in) is nn.Linear and type(model.final_layer.linear) is nn.Linear
    assert model.double_blocks[0].img_attn.qkv.bits == {"int8": 8, "int4": 4}[quantize]
    size = sum(v.nbytes for _, v in _parameters(model))
    assert size < 0.75 * sum(v.nbytes for _, v in _parameters(build("flux2_klein", weights)))
    assert relative_error(run(model, golden), reference) <= tolerance
    with pytest.raises(ValueError, match="quantize must be one of"):
        build("flux2_klein", weights, quantize="int3")


def test_golden_through_a_comfy_file(tmp_path):
    """A checkpoint-style file (`model.diffusion_model.` prefix, other keys beside) loads to the same model."""
    golden, weights = read_golden("flux2_klein")
    tensors = {"model.diffusion_model." + k: v for k, v in weights.items()}
    tensors["vae.decoder.conv_in.weight"] = np.zeros((2, 2), np.float32)
    path = tmp_path / "tiny_klein.safetensors"
    safetensors_io.write(path, tensors)
    loaded = load_comfy_file(path)
    assert loaded.keys() == weights.keys()
    out = run(build("flux2_klein", loaded, dtype="float32"), golden)
    assert relative_error(out, golden["output"]) <= TOLERANCE


def test_module_paths_are_comfyui_paths():
    weights = tiny_weights.flux2_weights(0, dev=True)
    model = build("flux2_dev", weights, dtype="float32")
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    # every ComfyUI Linear (a 2-D weight) at the same dotted path, and no other
    assert set(linears) == {k[: -len(".weight")] for k, v in weights.items() if v.ndim == 2}
    assert {k for k, _ in _parameters(model)} == set(weights)
    order = [name for name, _ in model.named_modules() if name in linears]
    selected = set(select_targets(order, DEFAULT_TARGETS))
    expected = {
        f"double_blocks.{n}.{s}_{layer}"
        for n in range(2)
        for s in ("img", "txt")
        for layer in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")
    }
    expected |= {f"single_blocks.{n}.linear{i}" for n in range(2) for i in (1, 2)}
    assert selected == expected
    assert all(linears[name].get("bias") is None for name in selected)  # Flux2 has no biases


def test_sizes_come_from_the_weights():
    weights = tiny_weights.flux2_weights(1, hidden=384, double=1, single=3, context_dim=96, in_channels=64)
    model = build("flux2_klein", weights, dtype="float32")
    assert (len(model.double_blocks), len(model.single_blocks), model.config.num_heads) == (1, 3, 3)
    rng = np.random.default_rng(0)
    out = model(rng.standard_normal((1, 64, 2, 3)), np.array([0.5]), rng.standard_normal((1, 5, 96)))
    assert out.shape == (1, 64, 2, 3)
    assert np.isfinite(np.array(out)).all()


def test_wrong_arch_and_unknown_arch_are_named():
    with pytest.raises(ValueError, match="flux2_dev"):
        build("flux2_klein", tiny_weights.flux2_weights(0, dev=True))
    with pytest.raises(ValueError, match="guidance"):
        build("flux2_dev", tiny_weights.flux2_weights(0))
    with pytest.raises(ValueError, match="known: .*flux2_klein"):
        build("flux3", {})
    weights = tiny_weights.flux2_weights(0)
    weights["txt_in.bias"] = np.zeros(256, np.float32)
    with pytest.raises(ValueError, match="unexpected.*txt_in.bias"):
        build("flux2_klein", weights)


# ---------------------------------------------------------------- fp8 files


def write_raw(path: Path, entries: dict[str, tuple[str, tuple[int, ...], bytes]], metadata=None) -> None:
    """A safetensors file from raw bytes (safetensors_io writes no F8)."""
    header, offset = {}, 0
    for key, (dtype, shape, data) in entries.items():
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(data for _, _, data in entries.values()))


def fp8_codes(shape, seed: int) -> np.ndarray:
    codes = np.random.default_rng(seed).integers(0, 256, size=shape).astype(np.uint8)
    return np.where((codes & 0x7F) == 0x7F, 0x38, codes).astype(np.uint8)  # no NaN codes (S.1111.111)


def f32(values) -> bytes:
    return np.asarray(values, "<f4").tobytes()


@pytest.mark.parametrize("style", ["scale_weight", "comfy_quant"])
def test_scaled_fp8_file(tmp_path, style):
    a, c = fp8_codes((6, 4), 1), fp8_codes((3,), 2)
    b = np.linspace(-2, 2, 8, dtype=np.float32)
    b_bits = safetensors_io.float32_to_bf16_bits(b)
    decode = safetensors_io._FP8["F8_E4M3"]
    if style == "scale_weight":  # the old scaled-fp8 files: a marker key and per-layer scale_weight
        prefix, scales = (
            "model.diffusion_model.",
            {
                "layer.a.scale_weight": ("F32", (), f32(0.375)),
                "layer.a.scale_input": ("F32", (), f32(1.0)),
                "scaled_fp8": ("F8_E4M3", (0,), b""),
            },
        )
    else:  # the current format: comfy_quant JSON per layer and weight_scale
        conf = json.dumps({"format": "float8_e4m3fn"}).encode()
        prefix, scales = (
            "",
            {
                "layer.a.weight_scale": ("F32", (1,), f32([0.375])),
                "layer.a.input_scale": ("F32", (), f32(2.0)),
                "layer.a.comfy_quant": ("U8", (len(conf),), conf),
            },
        )
    entries = {
        "layer.a.weight": ("F8_E4M3", a.shape, a.tobytes()),
        "layer.b.weight": ("BF16", b.shape, b_bits.tobytes()),
        "layer.c.weight": ("F8_E4M3", c.shape, c.tobytes()),
        **scales,
    }
    path = tmp_path / "fp8.safetensors"
    write_raw(path, {prefix + k: v for k, v in entries.items()})

    loaded = load_comfy_file(path)
    assert set(loaded) == {"layer.a.weight", "layer.b.weight", "layer.c.weight"}
    np.testing.assert_array_equal(np.array(loaded["layer.a.weight"]), decode[a] * np.float32(0.375))
    np.testing.assert_array_equal(
        np.array(loaded["layer.b.weight"].astype(mx.float32)), safetensors_io.bf16_bits_to_float32(b_bits)
    )
    np.testing.assert_array_equal(np.array(loaded["layer.c.weight"]), decode[c])  # no scale: plain fp8


def test_unsupported_fp8_formats_are_refused(tmp_path):
    e5m2 = tmp_path / "e5m2.safetensors"
    write_raw(e5m2, {"img_in.weight": ("F8_E5M2", (2,), b"\x01\x02")})
    with pytest.raises(safetensors_io.SafetensorsError, match="F8_E5M2.*bf16 or F8_E4M3"):
        load_comfy_file(e5m2)
    nvfp4 = tmp_path / "nvfp4.safetensors"
    write_raw(
        nvfp4,
        {"img_in.weight": ("U8", (2,), b"\x01\x02")},
        metadata={"_quantization_metadata": json.dumps({"layers": {"img_in": {"format": "nvfp4"}}})},
    )
    with pytest.raises(safetensors_io.SafetensorsError, match="nvfp4"):
        load_comfy_file(nvfp4)


def test_from_torch_state_dict():
    torch = pytest.importorskip("torch")
    from trainer.backends.mlx_backend.models.weights import from_state_dict

    codes = torch.tensor([[0.5, -1.5], [2.0, 0.125]]).to(torch.float8_e4m3fn)
    sd = {
        "diffusion_model.img_in.weight": torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16),
        "diffusion_model.txt_in.weight": codes,
        "diffusion_model.txt_in.scale_weight": torch.tensor(4.0),
    }
    out = from_state_dict(sd)
    assert set(out) == {"img_in.weight", "txt_in.weight"}
    assert out["img_in.weight"].dtype == mx.float32
    np.testing.assert_array_equal(np.array(out["txt_in.weight"]), [[2.0, -6.0], [8.0, 0.5]])
    # bf16 goes across bit for bit (no float32 copy of the model on the way)
    weight = torch.randn(7, 5)
    out = from_state_dict(
        {"diffusion_model.img_in.weight": weight.to(torch.bfloat16), **{k: v for k, v in sd.items() if "txt" in k}},
        dtype="bfloat16",
    )
    assert out["img_in.weight"].dtype == out["txt_in.weight"].dtype == mx.bfloat16
    np.testing.assert_array_equal(
        np.array(out["img_in.weight"].astype(mx.float32)), weight.to(torch.bfloat16).float().numpy()
    )
    np.testing.assert_array_equal(np.array(out["txt_in.weight"].astype(mx.float32)), [[2.0, -6.0], [8.0, 0.5]])
    mxfp8 = {
        "img_in.weight": codes,
        "img_in.comfy_quant": torch.tensor(list(b'{"format": "mxfp8"}'), dtype=torch.uint8),
    }
    with pytest.raises(ValueError, match="mxfp8"):
        from_state_dict(mxfp8)


def _parameters(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())
