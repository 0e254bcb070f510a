"""Safetensors read/write in numpy alone, for both backends (torch and MLX).

Why our own: numpy has no bfloat16, so `safetensors.numpy` cannot write the
bf16 LoRA files we save, and files we read (LoRAs, ComfyUI checkpoints) are
untrusted: every header field is checked and each failure names the file, the
key and the fix. Layout (https://github.com/huggingface/safetensors): 8-byte
little-endian header length N, N bytes of UTF-8 JSON, then the tensor bytes;
`data_offsets` count from the end of the header. Nothing here uses pickle.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from itertools import pairwise
from math import prod

import numpy as np

from .atomic import atomic_write, require_free_space
from .errors import KilnError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # real headers are KB..MB; more means a corrupt length
_DAMAGED = "the file is damaged or not a safetensors file; re-download or re-save it"

# Stored dtype → numpy dtype of the raw bytes (always little-endian).
_RAW = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "<u2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U64": "<u8",
    "U32": "<u4",
    "U16": "<u2",
    "U8": "u1",
    "BOOL": "u1",
    "F8_E4M3": "u1",
    "F8_E5M2": "u1",
}
# numpy dtype → stored dtype, for write(dtype=None).
_STORED = {
    np.dtype(raw).newbyteorder("<"): name
    for name, raw in _RAW.items()
    if name not in ("BF16", "BOOL", "F8_E4M3", "F8_E5M2")
}
_STORED[np.dtype(bool)] = "BOOL"
_FLOAT_TARGETS = {"BF16", "F16", "F32"}


class SafetensorsError(KilnError):
    """A safetensors file we cannot read or write; the message names the file and the fix."""


def _fp8_table(exp_bits: int, mant_bits: int, has_inf: bool) -> np.ndarray:
    """All 256 fp8 codes as float32: the spec's formula applied code by code."""
    codes = np.arange(256)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exp = (codes >> mant_bits) & ((1 << exp_bits) - 1)
    mant = codes & ((1 << mant_bits) - 1)
    bias = (1 << (exp_bits - 1)) - 1
    normal = (1 + mant / (1 << mant_bits)) * np.exp2(exp - bias)
    subnormal = mant / (1 << mant_bits) * np.exp2(1 - bias)
    values = sign * np.where(exp == 0, subnormal, normal)
    top = exp == (1 << exp_bits) - 1
    if has_inf:  # E5M2 is IEEE-like: top exponent is inf (mant 0) or NaN
        values = np.where(top & (mant == 0), sign * np.inf, values)
        values = np.where(top & (mant != 0), np.nan, values)
    else:  # E4M3FN has no inf; only S.1111.111 is NaN
        values = np.where(top & (mant == (1 << mant_bits) - 1), np.nan, values)
    return values.astype(np.float32)


_FP8 = {"F8_E4M3": _fp8_table(4, 3, False), "F8_E5M2": _fp8_table(5, 2, True)}


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float → uint16 bf16 bits, round-to-nearest-even.

    NaN → 0xFFFF, as torch's CPU tensor cast does (its scalar path gives 0x7FC0); both are NaN.
    """
    bits = np.require(values, np.float32, ["C"]).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0xFFFF), rounded).astype(np.uint16)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------- writing


def _encode(path, key: str, array, target: str | None) -> tuple[str, np.ndarray]:
    """One tensor → (stored dtype, little-endian contiguous array of its bytes)."""
    if not isinstance(key, str) or key == "__metadata__":
        raise SafetensorsError(f"{path}: tensor name {key!r} is not allowed; use a str other than '__metadata__'")
    array = np.asarray(array)
    if target == "BF16" and array.dtype == np.uint16:  # a bf16 tensor's own bits (no float copy made of them)
        return "BF16", np.require(array, np.dtype("<u2"), ["C"])
    if target is not None and array.dtype.kind == "f":
        if target not in _FLOAT_TARGETS:
            raise SafetensorsError(
                f"{path}: tensor {key!r}: cannot store as {target!r}; use one of {sorted(_FLOAT_TARGETS)}"
            )
        if target == "BF16":
            return "BF16", float32_to_bf16_bits(array.astype(np.float32))
        array = array.astype(_RAW[target])
    stored = _STORED.get(array.dtype.newbyteorder("<"))
    if stored is None:
        raise SafetensorsError(
            f"{path}: tensor {key!r}: dtype {array.dtype} cannot be stored in safetensors; "
            "convert it to a float or integer dtype first"
        )
    # np.require, not ascontiguousarray: the latter turns a 0-d alpha into shape [1].
    return stored, np.require(array, np.dtype(_RAW[stored]) if stored != "BOOL" else bool, ["C"])


def _header_bytes(entries: dict, metadata: Mapping[str, str] | None, path) -> bytes:
    header = dict(entries)
    if metadata:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise SafetensorsError(
                    f"{path}: metadata {key!r} is {type(value).__name__}; "
                    "safetensors metadata values must be str (json.dumps it)"
                )
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)  # the spec pads the header with spaces to 8 bytes


def write(
    path,
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
    *,
    dtype: str | Mapping[str, str] | None = None,
) -> None:
    """Write atomically, after checking the disk has room. `dtype` converts floating arrays ("BF16",
    "F16", "F32"; "BF16" also takes uint16 arrays as bf16 bits); a mapping gives the stored dtype per key (keys
    not in it keep their own dtype)."""
    encoded = {}
    for key, array in tensors.items():
        target = dtype.get(key) if isinstance(dtype, Mapping) else dtype
        encoded[key] = _encode(path, key, array, target)
    # Widest items first keeps every tensor aligned to its itemsize (as safetensors does).
    order = sorted(encoded, key=lambda k: (-encoded[k][1].dtype.itemsize, k))
    entries, offset = {}, 0
    for key in order:
        stored, data = encoded[key]
        entries[key] = {"dtype": stored, "shape": list(data.shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    header = _header_bytes(entries, metadata, path)
    require_free_space(
        os.path.dirname(os.path.abspath(path)),
        8 + len(header) + offset,
        f"writing {os.path.basename(path)}",
        "free space on that disk (old runs, caches), or write to a folder on a larger disk",
    )
    _write_chunks(path, [len(header).to_bytes(8, "little"), header] + [encoded[k][1] for k in order])


def _write_chunks(path, chunks) -> None:
    def write_all(handle) -> None:
        for chunk in chunks:
            handle.write(chunk.data if isinstance(chunk, np.ndarray) else chunk)

    atomic_write(path, write_all)


# ---------------------------------------------------------------- reading


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_header(path, f) -> tuple[dict[str, dict], dict[str, str], int, int]:
    """→ (entries, metadata, data_start, data_length); every field validated."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise SafetensorsError(f"{path}: only {size} bytes, shorter than the 8-byte header length; {_DAMAGED}")
    length = int.from_bytes(f.read(8), "little")
    if length > MAX_HEADER_BYTES or length > size - 8:
        raise SafetensorsError(
            f"{path}: header length {length} bytes exceeds the file ({size} bytes) "
            f"or the {MAX_HEADER_BYTES}-byte limit; {_DAMAGED}"
        )
    try:
        header = json.loads(f.read(length).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SafetensorsError(f"{path}: header is not UTF-8 JSON ({error}); {_DAMAGED}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is JSON {type(header).__name__}, not an object; {_DAMAGED}")
    metadata = _check_metadata(path, header.pop("__metadata__", None))
    data_length = size - 8 - length
    entries = {key: _check_entry(path, key, entry, data_length) for key, entry in header.items()}
    _check_overlaps(path, entries)
    return entries, metadata, 8 + length, data_length


def _check_metadata(path, metadata) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise SafetensorsError(f"{path}: __metadata__ is {type(metadata).__name__}, not a str→str object; {_DAMAGED}")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise SafetensorsError(f"{path}: __metadata__ {key!r} is {type(value).__name__}, not str; {_DAMAGED}")
    return metadata


def _check_entry(path, key: str, entry, data_length: int) -> dict:
    def bad(problem: str) -> SafetensorsError:
        return SafetensorsError(f"{path}: tensor {key!r}: {problem}; {_DAMAGED}")

    if not isinstance(entry, dict):
        raise bad(f"entry is {type(entry).__name__}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _RAW:
        raise bad(f"unknown dtype {dtype!r} (known: {', '.join(_RAW)})")
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(n) for n in offsets)):
        raise bad(f"data_offsets {offsets!r} is not two ints")
    begin, end = offsets
    if not 0 <= begin <= end <= data_length:
        raise bad(f"data_offsets {offsets} fall outside the {data_length} data bytes")
    expected = prod(shape) * np.dtype(_RAW[dtype]).itemsize
    if end - begin != expected:
        raise bad(f"data_offsets span {end - begin} bytes but shape {shape} of {dtype} needs {expected}")
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def _check_overlaps(path, entries: dict[str, dict]) -> None:
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], k) for k, e in entries.items())
    for (_, prev_end, prev_key), (begin, _, key) in pairwise(spans):
        if begin < prev_end:
            raise SafetensorsError(f"{path}: tensor {key!r} overlaps tensor {prev_key!r}; {_DAMAGED}")


def _decode(dtype: str, raw: np.ndarray) -> np.ndarray:
    if dtype == "BF16":
        return bf16_bits_to_float32(raw)
    if dtype in _FP8:
        return _FP8[dtype][raw]
    if dtype == "BOOL":
        return raw != 0
    return raw


def read_header(path) -> tuple[dict[str, dict], dict[str, str]]:
    """{key: {"dtype", "shape"}} and the metadata, reading only the header."""
    with open(path, "rb") as f:
        entries, metadata, _, _ = _parse_header(path, f)
    return {k: {"dtype": e["dtype"], "shape": list(e["shape"])} for k, e in entries.items()}, metadata


def read(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors and the metadata; BF16 and F8 decode to float32, the rest keep their dtype."""
    tensors = {}
    with open(path, "rb") as f:
        entries, metadata, data_start, _ = _parse_header(path, f)
        for key, entry in entries.items():
            begin, end = entry["data_offsets"]
            buffer = bytearray(end - begin)  # writable, unlike bytes
            f.seek(data_start + begin)
            if f.readinto(buffer) != len(buffer):
                raise SafetensorsError(f"{path}: tensor {key!r} is cut short; {_DAMAGED}")
            raw = np.frombuffer(buffer, dtype=_RAW[entry["dtype"]]).reshape(entry["shape"])
            tensors[key] = _decode(entry["dtype"], raw)
    return tensors, metadata
