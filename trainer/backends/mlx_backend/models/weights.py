"""Diffusion-model weights for the MLX ports: from a ComfyUI safetensors file or a torch state dict.

Keys come out as ComfyUI's diffusion-model names without prefix (`double_blocks.0.img_attn.qkv.weight`).
fp8 files are decoded: plain F8_E4M3 weights, and ComfyUI's scaled fp8 in both of its spellings
(old: a `scaled_fp8` marker with `<layer>.scale_weight`/`.scale_input`; new: `<layer>.comfy_quant`
JSON with `<layer>.weight_scale`/`.input_scale`), each weight = fp8 value × its weight scale.
Input scales only matter to fp8 matmuls and are dropped. F8_E5M2 and the block-scaled formats
(mxfp8, nvfp4) are refused with a message. No torch is needed for files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import mlx.core as mx
import numpy as np

from ....safetensors_io import SafetensorsError, read_header

PREFIXES = ("model.diffusion_model.", "diffusion_model.")
_WEIGHT_SCALES = (".scale_weight", ".weight_scale")
_DROPPED_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")
_FP8_FORMAT = "float8_e4m3fn"


def load_comfy_file(path) -> dict[str, mx.array]:
    """All diffusion-model tensors of a ComfyUI file (UNETLoader file or full checkpoint), fp8 decoded.

    Floating tensors keep their stored dtype (bf16 stays bf16), fp8 ones become float32 (value × scale);
    build() casts to the compute dtype. The arrays are lazy until evaluated.
    """
    path = Path(path)
    header, metadata = read_header(path)  # validates every entry before MLX reads a byte
    e5m2 = [k for k, entry in header.items() if entry["dtype"] == "F8_E5M2"]
    if e5m2:
        raise SafetensorsError(
            f"{path}: {len(e5m2)} tensors ({e5m2[0]}, ...) are F8_E5M2, which MLX cannot "
            "decode; use the bf16 or F8_E4M3 (fp8_e4m3fn) release of this model"
        )
    keep = _strip_prefix(list(header))
    tensors = mx.load(str(path))  # F8_E4M3 arrives as its uint8 codes
    tensors = {short: tensors[key] for key, short in keep.items()}
    fp8 = {short for key, short in keep.items() if header[key]["dtype"] == "F8_E4M3"}
    _check_quant_formats(path, tensors, metadata)
    out = {}
    for key, value in tensors.items():
        if key == "scaled_fp8" or key.endswith(_DROPPED_SUFFIXES + _WEIGHT_SCALES):
            continue
        if key in fp8:
            value = mx.from_fp8(value, dtype=mx.float32)
            scale = _weight_scale(path, tensors, key)
            # float32, as ComfyUI dequantizes before its cast to the compute dtype; lazy, so the float32
            # copies only exist while build() casts them to its dtype
            value = value if scale is None else value * scale.astype(mx.float32)
        out[key] = value
    return out


def from_state_dict(sd: Mapping, dtype="float32") -> dict[str, mx.array]:
    """A torch state dict (ComfyUI's diffusion model, prefixed or not) → mx arrays in `dtype`.

    ComfyUI's fp8 layers export the fp8 weight and its `weight_scale`; the product is returned.
    Each tensor is cast by torch and handed over on its own (bf16 through its 16-bit pattern, as numpy
    has no bfloat16), so the conversion never holds a float32 copy of the whole model.
    """
    target = _MX_DTYPES[dtype] if isinstance(dtype, str) else dtype
    keep = _strip_prefix(list(sd))
    tensors = {short: sd[key] for key, short in keep.items()}
    _refuse_other_formats(
        "state dict",
        {
            key[: -len(".comfy_quant")]: _json("state dict", key, bytes(value.cpu().numpy().astype(np.uint8))).get(
                "format"
            )
            for key, value in tensors.items()
            if key.endswith(".comfy_quant")
        },
    )
    out = {}
    for key, value in tensors.items():
        if key == "scaled_fp8" or key.endswith(_DROPPED_SUFFIXES + _WEIGHT_SCALES):
            continue
        tensor = value.detach()
        if "float8" in str(tensor.dtype):
            scale = _weight_scale("state dict", tensors, key)
            tensor = tensor.float() if scale is None else tensor.float() * scale.detach().float().to(tensor.device)
        out[key] = _torch_to_mx(tensor, target)
    return out


_MX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _torch_to_mx(tensor, dtype: mx.Dtype) -> mx.array:
    import torch

    if dtype == mx.bfloat16:
        bits = tensor.to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy()
        return mx.array(bits).view(mx.bfloat16)
    return mx.array(tensor.float().cpu().numpy()).astype(dtype)


def _strip_prefix(keys: list[str]) -> dict[str, str]:
    """{stored key: key without the diffusion-model prefix}; a full checkpoint keeps its diffusion model only."""
    for prefix in PREFIXES:
        if any(k.startswith(prefix) for k in keys):
            return {k: k[len(prefix) :] for k in keys if k.startswith(prefix)}
    return {k: k for k in keys}


def _weight_scale(source, tensors: Mapping, key: str):
    """The per-tensor scale of an fp8 `<layer>.weight` (a scalar array, mx or torch), if there is one."""
    if not key.endswith(".weight"):
        return None
    layer = key[: -len(".weight")]
    for suffix in _WEIGHT_SCALES:
        scale = tensors.get(layer + suffix)
        if scale is not None:
            size = scale.size if isinstance(scale, mx.array) else scale.numel()
            if size != 1:
                raise SafetensorsError(
                    f"{source}: {layer + suffix} has {size} values, a block-scaled fp8 "
                    "format MLX training does not decode; use the bf16 release of this model"
                )
            return scale.reshape(())
    return None


def _check_quant_formats(path, tensors: dict[str, mx.array], metadata: dict[str, str]) -> None:
    """Refuse ComfyUI quantization formats other than per-tensor fp8 e4m3 (`comfy_quant` / metadata)."""
    formats = {
        key[: -len(".comfy_quant")]: _json(path, key, bytes(np.array(value, np.uint8))).get("format")
        for key, value in tensors.items()
        if key.endswith(".comfy_quant")
    }
    if "_quantization_metadata" in metadata:
        layers = _json(path, "_quantization_metadata", metadata["_quantization_metadata"].encode()).get("layers", {})
        formats.update({layer: conf.get("format") for layer, conf in layers.items() if isinstance(conf, dict)})
    _refuse_other_formats(path, formats)


def _refuse_other_formats(source, formats: dict[str, str | None]) -> None:
    other = {layer: fmt for layer, fmt in formats.items() if fmt != _FP8_FORMAT}
    if other:
        layer, fmt = next(iter(other.items()))
        raise SafetensorsError(
            f"{source}: layer {layer!r} is quantized as {fmt!r} ({len(other)} such layers); "
            f"MLX training decodes {_FP8_FORMAT} only; use the bf16 or fp8 release of this model"
        )


def _json(path, key: str, raw: bytes) -> dict:
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SafetensorsError(f"{path}: {key} is not JSON ({error}); the file is damaged") from None
    if not isinstance(value, dict):
        raise SafetensorsError(f"{path}: {key} is JSON {type(value).__name__}, not an object; the file is damaged")
    return value
