"""ComfyUI's own LoRA loader on a file, as the LoRA tests read it: comfy.lora.model_lora_keys_unet → load_lora →
calculate_weight. Import after helpers.comfy_env.require_comfy(): it imports ComfyUI."""

from __future__ import annotations

import torch


def patches(patcher, path) -> dict[str, list]:
    """{weight key: patch entries} as ModelPatcher.add_patches stores them; ComfyUI logs (a WARNING) each key it
    does not load and each patch whose shape does not fit."""
    import comfy.lora
    import comfy.utils

    key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
    loaded = comfy.lora.load_lora(comfy.utils.load_torch_file(str(path), safe_load=True), key_map)
    by_weight: dict[str, list] = {}
    for target, adapter in loaded.items():
        key, offset = (target, None) if isinstance(target, str) else (target[0], target[1])
        by_weight.setdefault(key, []).append((1.0, adapter, 1.0, offset, None))
    return by_weight


def deltas(patcher, by_weight: dict[str, list]) -> dict[str, torch.Tensor]:
    """{ComfyUI path: ΔW}: each weight's patches applied to zeros."""
    import comfy.lora

    state = patcher.model.state_dict()
    return {
        key[len("diffusion_model.") : -len(".weight")]: comfy.lora.calculate_weight(
            entries, torch.zeros_like(state[key], dtype=torch.float32), key
        )
        for key, entries in by_weight.items()
    }
