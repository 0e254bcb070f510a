"""trainer/safetensors_io.py: round trips, interop with the safetensors package, hostile headers."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from trainer import safetensors_io as st
from trainer.safetensors_io import SafetensorsError

NATIVE_DTYPES = [
    np.float32,
    np.float16,
    np.float64,
    np.int64,
    np.int32,
    np.int16,
    np.int8,
    np.uint8,
    np.uint16,
    np.bool_,
]


def _sample(dtype, shape=(3, 5), seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.random(shape) > 0.5
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 100).astype(dtype)


def _tricky_floats() -> np.ndarray:
    """Ties, subnormals, inf/NaN, overflow-to-inf and random values: where bf16 rounding differs."""
    special = np.array(
        [
            0.0,
            -0.0,
            1.0,
            np.inf,
            -np.inf,
            np.nan,
            1e-40,
            -1e-45,
            3.4e38,
            -3.39e38,
            1.00390625,
            1.01171875,
            1.0 + 2**-8 + 2**-20,
        ],
        dtype=np.float32,
    )
    ties = (np.arange(1, 200, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # exactly halfway
    rng = np.random.default_rng(1)
    return np.concatenate([special, ties, rng.standard_normal(500).astype(np.float32) * 10])


@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip_native_dtypes(tmp_path, dtype):
    tensors = {"x": _sample(dtype), "scalar": np.array(_sample(dtype, ())), "empty": np.zeros((0, 4), dtype)}
    path = tmp_path / "t.safetensors"
    st.write(path, tensors, {"note": "hi"})
    back, metadata = st.read(path)
    assert metadata == {"note": "hi"}
    for key, array in tensors.items():
        assert back[key].dtype == array.dtype and back[key].shape == array.shape
        assert np.array_equal(back[key], array)
    header, _ = st.read_header(path)
    assert header["x"]["shape"] == [3, 5]


def test_header_is_padded_to_8_bytes(tmp_path):
    path = tmp_path / "t.safetensors"
    st.write(path, {"abc": np.ones(3, np.float16)}, {"k": "v"})
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    assert length % 8 == 0 and raw[8 + length - 1 : 8 + length] in (b" ", b"}")


@pytest.mark.parametrize("target", ["BF16", "F16", "F32"])
def test_float_conversion_leaves_ints_alone(tmp_path, target):
    path = tmp_path / "t.safetensors"
    st.write(path, {"w": _sample(np.float64), "i": _sample(np.int32)}, dtype=target)
    header, _ = st.read_header(path)
    assert header["w"]["dtype"] == target and header["i"]["dtype"] == "I32"


def test_bf16_matches_torch_bitwise(tmp_path):
    values = _tricky_floats()
    path = tmp_path / "bf16.safetensors"
    st.write(path, {"v": values}, dtype="BF16")
    ours = load_file(str(path))["v"]
    expected = torch.from_numpy(values).to(torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours.view(torch.int16), expected.view(torch.int16))
    back, _ = st.read(path)  # and our reader decodes what torch would
    assert np.array_equal(back["v"], expected.float().numpy(), equal_nan=True)


def test_per_key_dtype_mapping(tmp_path):
    path = tmp_path / "t.safetensors"
    st.write(path, {"w": np.ones((2, 2), np.float32), "alpha": np.array(4.0, np.float32)}, dtype={"w": "BF16"})
    header, _ = st.read_header(path)
    assert header["w"]["dtype"] == "BF16" and header["alpha"]["dtype"] == "F32"
    st.write(path, {"s": np.array(1.5, np.float32)}, dtype="BF16")  # 0-d stays 0-d
    assert st.read_header(path)[0]["s"] == {"dtype": "BF16", "shape": []}
    assert st.read(path)[0]["s"].shape == ()


@pytest.mark.parametrize("torch_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reads_files_from_safetensors_torch(tmp_path, torch_dtype):
    tensor = torch.from_numpy(_tricky_floats()).reshape(-1, 1).to(torch_dtype)
    path = tmp_path / "theirs.safetensors"
    save_file({"t": tensor, "n": torch.arange(6, dtype=torch.int64)}, str(path), metadata={"a": "b"})
    back, metadata = st.read(path)
    assert metadata == {"a": "b"}
    assert np.array_equal(back["t"], tensor.float().numpy(), equal_nan=True)
    assert np.array_equal(back["n"], np.arange(6))


@pytest.mark.parametrize("torch_dtype,name", [(torch.float8_e4m3fn, "F8_E4M3"), (torch.float8_e5m2, "F8_E5M2")])
def test_reads_fp8(tmp_path, torch_dtype, name):
    codes = torch.arange(256, dtype=torch.uint8).view(torch_dtype)  # every fp8 value, NaN included
    path = tmp_path / "fp8.safetensors"
    save_file({"w": codes}, str(path))
    header, _ = st.read_header(path)
    back, _ = st.read(path)
    assert header["w"]["dtype"] == name and back["w"].dtype == np.float32
    assert np.array_equal(back["w"], codes.float().numpy(), equal_nan=True)


def test_metadata_values_must_be_str(tmp_path):
    with pytest.raises(SafetensorsError, match=r"t\.safetensors.*'steps'"):
        st.write(tmp_path / "t.safetensors", {"x": np.ones(1)}, {"steps": 5})
    assert not os.listdir(tmp_path)


def test_unstorable_dtype_names_key(tmp_path):
    with pytest.raises(SafetensorsError, match="'z'"):
        st.write(tmp_path / "t.safetensors", {"z": np.ones(2, np.complex64)})
    with pytest.raises(SafetensorsError, match="__metadata__"):
        st.write(tmp_path / "t.safetensors", {"__metadata__": np.ones(2)})
    with pytest.raises(SafetensorsError, match="'F8'"):
        st.write(tmp_path / "t.safetensors", {"w": np.ones(2)}, dtype="F8")


# ---------------------------------------------------------------- hostile files


def _file(tmp_path, header, data: bytes = b"", raw_header: bytes | None = None, length: int | None = None):
    body = raw_header if raw_header is not None else json.dumps(header).encode()
    return _raw_file(tmp_path, struct.pack("<Q", len(body) if length is None else length) + body + data)


def _raw_file(tmp_path, content: bytes):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    return path


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


BAD_HEADERS = {
    "unknown dtype": ({"w": _entry(dtype="F128")}, "unknown dtype"),
    "shape not list": ({"w": _entry() | {"shape": "2"}}, "shape"),
    "negative dim": ({"w": _entry(shape=(-2,))}, "shape"),
    "bool dim": ({"w": _entry() | {"shape": [True, 2]}}, "shape"),
    "one offset": ({"w": _entry() | {"data_offsets": [0]}}, "data_offsets"),
    "float offset": ({"w": _entry() | {"data_offsets": [0, 8.0]}}, "data_offsets"),
    "past the end": ({"w": _entry(shape=(4,), offsets=(0, 16))}, "outside"),
    "negative offset": ({"w": _entry(offsets=(-8, 0))}, "outside"),
    "size mismatch": ({"w": _entry(shape=(3,), offsets=(0, 8))}, "needs 12"),
    "overlap": ({"a": _entry(offsets=(0, 8)), "b": _entry(shape=(1,), offsets=(4, 8))}, "overlaps"),
    "entry not object": ({"w": [1, 2]}, "not an object"),
    "metadata not object": ({"__metadata__": ["a"]}, "__metadata__"),
    "metadata value not str": ({"__metadata__": {"steps": 5}}, "steps"),
    "lower-case dtype": ({"w": _entry(dtype="f32")}, "unknown dtype 'f32'"),
    "dtype not a string": ({"w": _entry() | {"dtype": 4}}, "unknown dtype 4"),
    "no dtype": ({"w": {"shape": [2], "data_offsets": [0, 8]}}, "unknown dtype None"),
    "shape null": ({"w": _entry() | {"shape": None}}, "shape None"),
    "reversed offsets": ({"w": _entry(offsets=(8, 0))}, "outside"),
    "shape overflow": ({"w": _entry(shape=(2**40, 2**40))}, "needs"),
    "empty tensor inside another": ({"a": _entry(offsets=(0, 8)), "b": _entry(shape=(0,), offsets=(4, 4))}, "overlaps"),
}


@pytest.mark.parametrize("case", BAD_HEADERS, ids=list(BAD_HEADERS))
def test_malformed_header(tmp_path, case):
    header, message = BAD_HEADERS[case]
    path = _file(tmp_path, header, data=bytes(8))
    for reader in (st.read, st.read_header):
        with pytest.raises(SafetensorsError, match=message) as error:
            reader(path)
        assert str(path) in str(error.value) and "re-download or re-save" in str(error.value)


@pytest.mark.parametrize("case", ["short", "length past file", "absurd length", "not utf8", "not json", "not object"])
def test_malformed_framing(tmp_path, case):
    path = {
        "short": lambda: _raw_file(tmp_path, b"\x01\x02\x03"),
        "length past file": lambda: _file(tmp_path, {}, length=1000),
        "absurd length": lambda: _file(tmp_path, {}, length=2**40),
        "not utf8": lambda: _file(tmp_path, None, raw_header=b"{\xff\xfe}"),
        "not json": lambda: _file(tmp_path, None, raw_header=b"{not json"),
        "not object": lambda: _file(tmp_path, [1, 2]),
    }[case]()
    with pytest.raises(SafetensorsError) as error:
        st.read(path)
    assert str(path) in str(error.value)


@pytest.mark.parametrize("keep", [9, 40, -3, -1])
def test_a_real_file_cut_short_names_the_file(tmp_path, keep):
    """A copy interrupted part-way: in the header, or inside the last tensor's bytes."""
    path = tmp_path / "cut.safetensors"
    st.write(path, {"a.weight": np.ones((4, 4), np.float32), "b.weight": np.ones(3, np.float16)})
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(SafetensorsError) as error:
        st.read(path)
    assert str(path) in str(error.value) and "re-download or re-save" in str(error.value)


def test_named_key_in_error(tmp_path):
    path = _file(tmp_path, {"my.weight": _entry(dtype="Q4")}, data=bytes(8))
    with pytest.raises(SafetensorsError, match="'my.weight'"):
        st.read(path)


# ---------------------------------------------------------------- atomic write


def test_atomic_write_leaves_no_temp_files(tmp_path):
    path = tmp_path / "lora.safetensors"
    st.write(path, {"x": np.ones(4, np.float32)})
    st.write(path, {"x": np.zeros(4, np.float32)})  # overwrite in place
    assert os.listdir(tmp_path) == ["lora.safetensors"]
    assert np.array_equal(st.read(path)[0]["x"], np.zeros(4))
    assert os.stat(path).st_mode & 0o777 == 0o644 or os.name == "nt"


def test_failed_write_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "lora.safetensors"
    st.write(path, {"x": np.ones(4, np.float32)}, {"v": "old"})
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        st.write(path, {"x": np.zeros(1000, np.float32)}, {"v": "new"})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["lora.safetensors"]
