"""A MODEL's effective weights as a lazy state dict: what extracting a LoRA from two models reads; and a MODEL with
a full fine-tune's weights set (Train LoRA's model output of an adapter-full run).

Each key's weight is its original (ModelPatcher.get_key_patches: the backup where a clone has patched
it in place) plus every patch the patcher holds (LoRAs loaded onto it, model merges), summed in fp32
by ComfyUI's own comfy.lora.calculate_weight, with no rounding back to the weight's dtype (a rounded
bf16 sum would put rounding noise into the difference). One key at a time, on `device`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import comfy.lora
import comfy.model_management as mm
import comfy.utils
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


def with_weights(model, path: str):
    """A clone of MODEL whose diffusion-model weights are those of the file at `path` (a full fine-tune's, in
    ComfyUI's layout): one "set" patch per key, ComfyUI's own patch kind (its loader's for a full weight in a
    LoRA file), so the input MODEL stays the base and the clone samples the trained model. Every key of the file
    must be the model's: a file of another model is refused, naming the keys."""
    tensors = comfy.utils.load_torch_file(path, safe_load=True)
    clone = model.clone()
    loaded = clone.add_patches({_PREFIX + key: ("set", (value,)) for key, value in tensors.items()}, 1.0)
    missing = sorted(set(tensors) - {key[len(_PREFIX) :] for key in loaded})
    if missing:
        raise ValueError(
            f"{len(missing)} of {len(tensors)} weights of {path} are not in this {type(model.model).__name__} "
            f"model (e.g. {missing[:3]}): connect the model the run trained"
        )
    return clone
