"""A MODEL's effective weights as a lazy state dict: what extracting a LoRA from two models reads.

Each key's weight is its original (ModelPatcher.get_key_patches: the backup where a clone has patched
it in place) plus every patch the patcher holds (LoRAs loaded onto it, model merges), summed in fp32
by ComfyUI's own comfy.lora.calculate_weight, with no rounding back to the weight's dtype (a rounded
bf16 sum would put rounding noise into the difference). One key at a time, on `device`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import comfy.lora
import comfy.model_management as mm
import torch

_PREFIX = "diffusion_model."


class EffectiveWeights(Mapping):
    """{ComfyUI module path + '.weight'/'.bias'/…: fp32 tensor} of a MODEL's diffusion model, patches applied."""

    def __init__(self, model, device=None):
        self._patches = model.get_key_patches(_PREFIX)
        self._device = torch.device(device) if device is not None else mm.get_torch_device()

    def __getitem__(self, key: str) -> torch.Tensor:
        (weight, convert), *patches = self._patches[_PREFIX + key]
        value = mm.cast_to_device(weight, self._device, torch.float32, copy=True)
        value = convert(value, inplace=True)
        if patches:
            value = comfy.lora.calculate_weight(patches, value, _PREFIX + key)
        return value

    def __iter__(self) -> Iterator[str]:
        return (key[len(_PREFIX) :] for key in self._patches)

    def __len__(self) -> int:
        return len(self._patches)


def compute_device():
    """ComfyUI's torch device (the GPU it runs on), for SVDs."""
    return mm.get_torch_device()
