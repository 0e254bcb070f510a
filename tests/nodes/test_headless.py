"""`python -m trainer train CONFIG` for a ComfyUI architecture, with ComfyUI as a library (COMFYUI_PATH).

ComfyUI cannot detect tiny VAE and text-encoder files, so the loaders are swapped for the tiny
ComfyUI objects; the diffusion model really is loaded from its file by ComfyUI's own loader.
"""
from __future__ import annotations


import numpy as np
import pytest
from PIL import Image

import comfy_env

comfy_env.require_comfy()

import comfy.sd  # noqa: E402
import tiny_comfy as tc  # noqa: E402

headless = comfy_env.import_pack("headless")
bridge = comfy_env.import_pack("nodes.comfy.bridge")
lora_format = comfy_env.import_pack("trainer.lora_format")


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_headless_train_of_a_flux2_file(tmp_path, capsys, backend):
    if backend == "mlx":
        pytest.importorskip("mlx.core", reason="backend mlx needs MLX (mlx[cpu] on Linux)")
    model_file = tc.write_flux2_file(tmp_path / "tiny_flux2.safetensors")
    for name in ("vae", "te"):
        (tmp_path / f"{name}.safetensors").write_bytes(b"stand-in: the loaders below return tiny models")
    data = tmp_path / "ds"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text(f"photo {i}", encoding="utf-8")
    config = tmp_path / "klein.toml"
    config.write_text(
        f'arch = "flux2_klein"\nbackend = "{backend}"\ndevice = "{"auto" if comfy_env.gpu() else "cpu"}"\n'
        f'mixed_precision = "{"bf16" if comfy_env.gpu() else "no"}"\nsteps = 4\nrank = 4\nalpha = 4.0\n'
        f'model_path = "{model_file}"\nvae_path = "{tmp_path / "vae.safetensors"}"\n'
        f'text_encoder_path = "{tmp_path / "te.safetensors"}"\ndataset_dir = "{data}"\n'
        f'output_dir = "{tmp_path / "runs"}"\nrun_name = "klein"\nresolutions = [64]\ncheckpoint_every = 2\n')

    def loaders(cfg):
        return comfy.sd.load_diffusion_model(cfg.model_path), tc.tiny_vae(flux2=True), tc.tiny_klein_clip()

    assert headless.train_command(str(config), False, loaders=loaders) == 0
    lora_file = tmp_path / "runs" / "klein" / "klein.safetensors"
    assert lora_file.is_file() and (tmp_path / "runs" / "klein" / "step-000004").is_dir()
    model = comfy.sd.load_diffusion_model(str(model_file))
    assert bridge.unmatched_lora_keys(model, bridge.load_lora_file(lora_file)) == []
    lora, metadata = lora_format.load_lora(lora_file)
    assert metadata["kiln.arch"] == "flux2_klein" and metadata["kiln.steps"] == "4"
    assert "finished at step 4/4" in capsys.readouterr().out


def test_the_cli_reaches_the_same_headless_module():
    from trainer.__main__ import _headless

    assert _headless() is headless
