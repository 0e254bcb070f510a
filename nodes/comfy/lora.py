"""LORA_MODEL in and out, and LoRAs applied through ComfyUI's own loader (what LoraLoader does),
with every key checked: ComfyUI itself only logs a key that matches nothing or a patch whose shape
does not fit, and applies nothing. Re-exported by bridge.py, the door's surface."""

from __future__ import annotations

import weakref

import comfy.lora
import comfy.lora_convert
import comfy.utils
import numpy as np
import torch

from ...trainer import safetensors_io
from ...trainer.lora import files as lora_format
from ...trainer.lora.files import LoraWeights


def lora_model_from(
    weights: dict[str, LoraWeights], arch_name: str | None = None, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Kiln LoRA → LORA_MODEL: `diffusion_model.<path>.lora_A.weight/.lora_B.weight/.alpha` tensors,
    which LoraModelLoader (comfy.sd.load_lora_for_models) and SaveLoRA (save_file) take as they are."""
    tensors = lora_format.to_tensors(weights, "comfy", arch_name)
    return {
        k: torch.from_numpy(np.ascontiguousarray(v, np.float32)).to(torch.float32 if k.endswith("alpha") else dtype)
        for k, v in tensors.items()
    }


def lora_arrays(lora_model: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A LORA_MODEL's tensors as float32 numpy (bf16 and fp16 exactly), for the trainer."""
    return {k: v.detach().float().cpu().numpy() for k, v in lora_model.items()}


def lora_weights_from(lora_model: dict[str, torch.Tensor], arch_name: str | None = None) -> dict[str, LoraWeights]:
    """LORA_MODEL (or a LoRA file's tensors: comfy, diffusers or kohya keys) → Kiln LoRA."""
    weights, _ = lora_format.from_tensors(lora_arrays(lora_model), arch=arch_name, source="LORA_MODEL")
    return weights


def load_lora_file(path) -> dict[str, torch.Tensor]:
    """A .safetensors LoRA as tensors (no pickle; header checked by trainer.safetensors_io)."""
    tensors, _ = safetensors_io.read(path)
    return {k: torch.from_numpy(v) for k, v in tensors.items()}


class _ReadTracker(dict):
    """A LoRA dict that records which keys ComfyUI's loader reads: a key never read was not loaded."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.read: set[str] = set()

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self.read.add(key)
        return value

    def get(self, key, default=None):
        if key in self:
            self.read.add(key)
        return super().get(key, default)


def _patched(model, lora_model: dict[str, torch.Tensor], strength: float):
    """comfy.sd.load_lora_for_models' steps for the model alone → (clone with patches, unmatched keys).
    Unmatched = keys ComfyUI's loader never read (what it logs as 'lora key not loaded') + rejected patches."""
    if not lora_model:
        raise ValueError("the LoRA has no tensors")
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    tracked = _ReadTracker(comfy.lora_convert.convert_lora(lora_model))
    patches = comfy.lora.load_lora(tracked, key_map)
    patched = model.clone()
    applied = set(patched.add_patches(patches, strength))
    return patched, (
        sorted(set(tracked) - tracked.read)
        + sorted(str(k) for k in patches if k not in applied)
        + _misshapen(model, patches)
    )


def _misshapen(model, patches) -> list[str]:
    """Plain LoRA patches whose B·A cannot take the shape of the weight they patch: ComfyUI logs
    those when it merges and leaves the weight as it was (a LoRA with no effect, or a training
    adapter silently not merged)."""
    bad = []
    for key, adapter in patches.items():
        weights = getattr(adapter, "weights", None)
        if getattr(adapter, "name", None) != "lora" or weights is None or weights[3] is not None:
            continue  # LoCon mid weights, LoHa, LoKr, diffs: left to ComfyUI
        name, offset = key if isinstance(key, tuple) else (key, None)
        try:
            shape = list(comfy.utils.get_attr(model.model, name).shape)
        except AttributeError:
            continue
        if offset is not None:
            shape[offset[0]] = offset[2]
        up, down = weights[0], weights[1]
        if (
            up.ndim < 2
            or down.ndim < 2
            or up.shape[1] != down.shape[0]
            or up.shape[0] * down[0].numel() != int(np.prod(shape))
        ):
            bad.append(f"{name}: up/B {list(up.shape)} x down/A {list(down.shape)} does not fit weight {shape}")
    return bad


def unmatched_lora_keys(model, lora_model: dict[str, torch.Tensor]) -> list[str]:
    """The LoRA keys ComfyUI's loader would drop for this model (empty: the LoRA loads whole)."""
    return _patched(model, lora_model, 1.0)[1]


def require_fit(model, lora_model: dict[str, torch.Tensor], what: str) -> None:
    """Raise, naming `what` (node, input and file), unless every key of the LoRA loads into this model."""
    problems = unmatched_lora_keys(model, lora_model)
    if problems:
        raise ValueError(
            f"{what}: {len(problems)} of {len(lora_model)} keys match nothing in this "
            f"{type(model.model).__name__} model or do not fit its weights (e.g. {problems[:3]}); "
            "choose the file made for this model"
        )


def apply_lora(model, lora_model: dict[str, torch.Tensor], strength: float = 1.0, *, strict: bool = True):
    """A clone of MODEL with the LoRA as weight patches, through ComfyUI's own loader (what LoraLoader and
    LoraModelLoader do). strict: raise if any key would be dropped (ComfyUI itself only logs it)."""
    patched, unmatched = _patched(model, lora_model, strength)
    if strict and unmatched:
        raise ValueError(
            f"{len(unmatched)} of {len(lora_model)} LoRA keys match nothing in this "
            f"{type(model.model).__name__} model or do not fit its weights (e.g. {unmatched[:3]}); "
            "is the LoRA for another model? Use one made for this model"
        )
    return patched


_UP_SUFFIXES = (
    ".lora_up.weight",
    ".lora_B.weight",
    "_lora.up.weight",
    ".lora.up.weight",
    ".lora_B",
    ".lora_linear_layer.up.weight",
    ".lora_B.default.weight",
    ".diff",
    ".diff_b",
)
_LINEAR_SUFFIXES = _UP_SUFFIXES + (
    ".lora_down.weight",
    ".lora_A.weight",
    "_lora.down.weight",
    ".lora.down.weight",
    ".lora_A",
    ".lora_linear_layer.down.weight",
    ".lora_A.default.weight",
    ".lora_mid.weight",
    ".alpha",
)


def negate_lora(lora_model: dict[str, torch.Tensor], strength: float = 1.0) -> dict[str, torch.Tensor]:
    """The LoRA at -strength as a LORA_MODEL: every up (B) matrix and diff scaled by -strength, so applying
    it at 1.0 removes the LoRA applied at +strength. Only plain LoRA/diff keys can be negated exactly."""
    other = sorted(k for k in lora_model if not k.endswith(_LINEAR_SUFFIXES))
    if other:
        raise ValueError(
            f"cannot negate {other[:3]}: only plain LoRA (up/down, A/B) and diff keys scale linearly "
            "(LoHa/LoKr/DoRA do not); load it with ComfyUI's LoraLoader at the negative strength"
        )
    return {k: v * -strength if k.endswith(_UP_SUFFIXES) else v.clone() for k, v in lora_model.items()}


def training_adapter_merged(model, adapter: dict[str, torch.Tensor]):
    """A clone with the (Z-Image Turbo) training adapter as +1 weight patches, every key matched.
    ComfyUI merges when it loads the clone; inside a training session it does so in full precision
    (W + ΔW summed in fp32, rounded once to the weight dtype: see _fp32_patches)."""
    merged = apply_lora(model, adapter, 1.0, strict=True)
    _MERGED[merged] = adapter  # what was merged, for a streamed run's samples without it (training.py)
    return merged


_MERGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def merged_adapter(model) -> dict[str, LoraWeights]:
    """The training adapter training_adapter_merged merged into `model`, as Kiln LoRA weights by module path."""
    return lora_weights_from(_MERGED[model])
