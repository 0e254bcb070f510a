"""Kiln's LoRA files through ComfyUI's own LoRA loader (COMFYUI_PATH): comfy.utils.load_torch_file,
model_lora_keys_unet, load_lora and calculate_weight on a stand-in model of ComfyUI's own class, for
every format and family (the cases of tests/helpers/lora_cases.py)."""

from __future__ import annotations

from helpers import comfy_env
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()

import comfy.lora  # noqa: E402
import comfy.model_base  # noqa: E402
import comfy.utils  # noqa: E402
from trainer.lora import files as lf  # noqa: E402

from helpers.lora_cases import CASES, HIDDEN, delta, lora_metadata, make_lora  # noqa: E402


def _fake_model(model_class, modules: dict, unet_config: dict):
    """An instance of ComfyUI's model class holding only bias-free Linears at `modules`: enough for
    model_lora_keys_unet (it reads state_dict() keys, isinstance and model_config.unet_config)."""
    model = model_class.__new__(model_class)
    torch.nn.Module.__init__(model)
    model.diffusion_model = torch.nn.Module()
    for path, (out, fan_in) in modules.items():
        parent = model.diffusion_model
        *parents, leaf = path.split(".")
        for name in parents:
            if not hasattr(parent, name):
                parent.add_module(name, torch.nn.Module())
            parent = getattr(parent, name)
        parent.add_module(leaf, torch.nn.Linear(fan_in, out, bias=False))
    model.model_config = type("Config", (), {"unet_config": unet_config})()
    return model


@pytest.mark.parametrize("arch_name,modules", CASES)
@pytest.mark.parametrize("fmt", list(lf.FORMATS))
def test_comfyui_loader_applies_every_key(tmp_path, arch_name, modules, fmt, caplog):
    """Our bf16 file through comfy.utils.load_torch_file, model_lora_keys_unet, load_lora and
    calculate_weight: every key is used and each weight moves by scale·B@A, alpha included, split
    diffusers parts landing on their fused rows."""
    model = (
        _fake_model(comfy.model_base.Flux2, modules, {"depth": 2, "depth_single_blocks": 2, "hidden_size": HIDDEN})
        if arch_name.startswith("flux2")
        else _fake_model(comfy.model_base.Lumina2, modules, {"n_layers": 4, "dim": HIDDEN})
    )
    path = tmp_path / "lora.safetensors"
    lf.save_lora(path, make_lora(modules), arch=arch_name, fmt=fmt, metadata=lora_metadata())
    lora, _ = lf.load_lora(path)  # the bf16-rounded weights ComfyUI will see
    tensors = comfy.utils.load_torch_file(str(path), safe_load=True)
    key_map = comfy.lora.model_lora_keys_unet(model, {})
    patches = comfy.lora.load_lora(tensors, key_map)
    assert "lora key not loaded" not in caplog.text
    by_weight: dict[str, list] = {}
    for target, adapter in patches.items():  # as ModelPatcher.add_patches stores them
        key, offset = (target, None) if isinstance(target, str) else (target[0], target[1])
        by_weight.setdefault(key, []).append((1.0, adapter, 1.0, offset, None))
    assert sorted(by_weight) == sorted(f"diffusion_model.{p}.weight" for p in modules)
    for module, w in lora.items():
        key = f"diffusion_model.{module}.weight"
        got = comfy.lora.calculate_weight(by_weight[key], torch.zeros(w.B.shape[0], w.A.shape[1]), key)
        assert np.allclose(got.numpy(), delta(w), atol=1e-4), module
