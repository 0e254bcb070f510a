"""Converted LoRAs in ComfyUI's own loader (#19): each other trainer's fixture (tests/helpers/lora_fixtures.py),
built at the shapes of a tiny Flux2 Klein and a tiny Z-Image, goes through `python -m trainer convert`'s
convert_file, then comfy.utils.load_torch_file → model_lora_keys_unet → comfy.lora.load_lora →
calculate_weight: no key left unloaded, and every weight moves by what the fixture's pattern means
(ΔW by hand from the original tensors). The Kiln Convert LoRA node does the same from models/loras."""

from __future__ import annotations

import logging

from helpers import comfy_env
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()

import comfy.sd  # noqa: E402
from helpers import comfy_lora  # noqa: E402
from helpers import lora_fixtures as fx  # noqa: E402
from helpers import tiny_comfy  # noqa: E402

from trainer import safetensors_io  # noqa: E402
from trainer.lora import files as lora_format  # noqa: E402

FAMILIES = {"flux2": lambda tmp: tiny_comfy.tiny_flux2(tmp), "zimage": lambda tmp: tiny_comfy.tiny_zimage()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            with torch.inference_mode():
                patcher = FAMILIES[family](tmp_path_factory.mktemp(family))
            weights = {
                k[len("diffusion_model.") : -len(".weight")]: v
                for k, v in patcher.model.state_dict().items()
                if k.startswith("diffusion_model.") and k.endswith(".weight")
            }
            shapes = {path: (tuple(w.shape) if w.ndim == 2 else (w.shape[0], 1)) for path, w in weights.items()}
            made[family] = patcher, shapes
        return made[family]

    return get


def _deltas(patcher, path, caplog) -> dict[str, torch.Tensor]:
    """ComfyUI's loader on a file: {ComfyUI path: ΔW}, with no key left unloaded."""
    with caplog.at_level(logging.WARNING):
        deltas = comfy_lora.deltas(patcher, comfy_lora.patches(patcher, path))
    # ComfyUI only logs a key it did not load, or a patch whose shape does not fit (and skips it)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    return deltas


@pytest.mark.parametrize("family,name", fx.cases())
def test_converted_file_loads_in_comfyui_with_the_same_effect(models, tmp_path, family, name, caplog):
    patcher, shapes = models(family)
    fixture = fx.build(family, name, shapes)
    src, dst = tmp_path / "foreign.safetensors", tmp_path / "converted.safetensors"
    safetensors_io.write(src, fixture.tensors, fixture.metadata, dtype={k: "F32" for k in fixture.tensors})
    converted = lora_format.convert_file(src, dst)
    assert converted.unplaced == []
    header, _ = safetensors_io.read_header(dst)
    assert {e["dtype"] for k, e in header.items()} == {"F32"}  # the source's dtype is kept
    got = _deltas(patcher, dst, caplog)
    assert sorted(got) == sorted(fixture.delta)
    for path, truth in fixture.delta.items():
        error = float(np.abs(got[path].double().numpy().reshape(truth.shape) - truth).max())
        assert error <= 1e-5 * float(np.abs(truth).max()), (name, path, error)


def test_convert_node_writes_under_models_loras_and_reports(models, tmp_path, caplog, monkeypatch):
    """Kiln Convert LoRA: a musubi-tuner Flux2 file converted (with one key that fits nothing, allowed and
    reported), saved beside it, its LORA_MODEL applied by ComfyUI's LoraModelLoader with nothing left over."""
    import folder_paths

    import kiln_pack.nodes.lora_nodes as lora_nodes

    patcher, shapes = models("flux2")
    fixture = fx.build("flux2", "musubi-tuner", shapes)
    loras = tmp_path / "loras"
    (loras / "musubi").mkdir(parents=True)
    stray = "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"
    safetensors_io.write(
        loras / "musubi" / "lora.safetensors", {**fixture.tensors, stray: np.ones((4, 8), np.float32)}, {}
    )
    monkeypatch.setitem(
        folder_paths.folder_names_and_paths, "loras", ([str(loras)], folder_paths.supported_pt_extensions)
    )
    folder_paths.filename_list_cache.pop("loras", None)
    with pytest.raises(ValueError, match=f"fit no module.*{stray}"):
        lora_nodes.KilnConvertLoRA.execute("musubi/lora.safetensors", "", "auto", False, False)
    lora_model, path, report = lora_nodes.KilnConvertLoRA.execute(
        "musubi/lora.safetensors", "", "auto", True, False
    ).result
    assert path == str(loras / "musubi" / "lora_comfy.safetensors") and stray in report
    assert "musubi/lora_comfy.safetensors" in folder_paths.get_filename_list("loras")
    got = _deltas(patcher, path, caplog)
    assert sorted(got) == sorted(fixture.delta)
    with caplog.at_level(logging.WARNING):  # what ComfyUI's LoraModelLoader runs on a LORA_MODEL
        patched, _ = comfy.sd.load_lora_for_models(patcher, None, lora_model, 1.0, 0)
    assert "lora key not loaded" not in caplog.text
    assert sorted(k[0] if isinstance(k, tuple) else k for k in patched.patches) == sorted(
        f"diffusion_model.{p}.weight" for p in fixture.delta
    )
