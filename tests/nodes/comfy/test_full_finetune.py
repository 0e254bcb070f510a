"""A full fine-tune (adapter "full") through the bridge on a tiny ComfyUI Flux2 Klein: a few steps in a training
session, the diffusion-model file written, loaded back by ComfyUI's own Load Diffusion Model path
(comfy.sd.load_diffusion_model) with every weight equal to the trained ones, and sampled; its extracted LoRA at
full rank loads through ComfyUI's LoRA loader with no key left unmatched."""

from __future__ import annotations

from helpers import comfy_env
import numpy as np
import pytest

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()  # skips this whole module without COMFYUI_PATH

import comfy.sample  # noqa: E402
import comfy.sd  # noqa: E402
import folder_paths  # noqa: E402
from helpers import tiny_comfy as tc  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.nodes.lora_nodes as ln
import kiln_pack.nodes.run as node_run
import kiln_pack.nodes.train_nodes as train_nodes
import kiln_pack.trainer.data as data_module
import kiln_pack.trainer.run.loop as loop
from kiln_pack.trainer import safetensors_io
from kiln_pack.trainer.lora.extract import ModelFile, extract
from kiln_pack.trainer.lora.files import save_lora
from kiln_pack.trainer.lora.tools import RankRule
from helpers.bridge_calls import small_config


def training_data(model, vae, clip, texts, size):
    encode_image, _ = bridge.vae_encoder(vae)
    encode, _ = bridge.text_encoder(clip)
    encode_text = lambda text: encode(text)["context"]  # noqa: E731 (Klein's encoder gives no other conditioning)
    pixels = np.random.default_rng(0).random((len(texts), size, size, 3), dtype=np.float32)
    latents = bridge.latents_in(model, encode_image(pixels))
    return data_module.InMemoryData.from_arrays(
        list(latents), [encode_text(t) for t in texts], [f"img{i}.png" for i in range(len(texts))], encode_text("")
    )


def sampled(model, cond, latent_shape) -> torch.Tensor:
    """Two euler steps of ComfyUI's own sampler, in inference mode as a prompt runs it."""
    latent = torch.zeros(latent_shape)
    noise = comfy.sample.prepare_noise(latent, 7)
    with torch.inference_mode():
        return comfy.sample.sample(
            model, noise, 2, 1.0, "euler", "simple", cond, cond, latent, seed=7, disable_pbar=True
        ).float()


def test_a_full_fine_tune_loads_in_comfy_and_samples_differently(tmp_path, comfy_dirs):
    (tmp_path / "base").mkdir()
    klein, clip, vae = tc.tiny_flux2(tmp_path / "base"), tc.tiny_klein_clip(), tc.tiny_vae(flux2=True)
    data = training_data(klein, vae, clip, ["a cat", "a dog on a beach", "moss"], 32)
    base = {k: v.float().clone() for k, v in bridge.diffusion_model(klein).state_dict().items()}
    cfg = small_config("flux2_klein", steps=3, adapter="full", learning_rate=1e-2, save_dtype="fp32")
    with bridge.training_session(klein) as (dm, _):
        result = loop.train(cfg, dm, data, run_dir=tmp_path / "run", forward=bridge.make_forward(klein, "flux2_klein"))
    assert result.model is not None and result.lora == {}
    for name, tensor in bridge.diffusion_model(klein).state_dict().items():  # the input MODEL as it came
        assert torch.equal(tensor.float(), base[name]), name
    # Train LoRA's state carries the run folder's file; Save Diffusion Model copies it where UNETLoader looks
    state = node_run.KilnState(
        run_dir=str(tmp_path / "run"),
        checkpoint=str(result.checkpoint),
        step=result.step,
        arch="flux2_klein",
        config=cfg.to_dict(),
        lora={},
        ema_lora=None,
        model_file=node_run.full_model_file(cfg, result, tmp_path / "run"),
    )
    folder = comfy_dirs / "diffusion_models"
    folder_paths.folder_names_and_paths["diffusion_models"] = ([str(folder)], folder_paths.supported_pt_extensions)
    state_of_run = state
    safetensors_io.write(tmp_path / "other.safetensors", {"not_a_layer.weight": np.zeros(2, np.float32)})
    saved = ln.KilnSaveDiffusionModel.execute(state, "kiln/klein_full", False)
    path = folder / "kiln" / "klein_full.safetensors"
    assert saved.result[0] == str(path) and "kiln/klein_full.safetensors" in folder_paths.get_filename_list(
        "diffusion_models"
    )
    with pytest.raises(ValueError, match="exists; choose another name or turn on overwrite"):
        ln.KilnSaveDiffusionModel.execute(state, "kiln/klein_full", False)

    with torch.inference_mode():
        loaded = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.float32})
    state = bridge.diffusion_model(loaded).state_dict()
    assert set(state) == set(result.model)
    for name, tensor in state.items():  # every weight as trained, bit for bit
        assert np.array_equal(tensor.float().numpy(), result.model[name]), name
    moved = [n for n in result.model if not np.array_equal(result.model[n], base[n].numpy())]
    assert any(".double_blocks." in f".{n}" or ".single_blocks." in f".{n}" for n in moved)

    cond, latent_shape = tc.conditioning(clip, "a cat"), (1, *data.latent(0).shape)
    tuned_image, base_image = sampled(loaded, cond, latent_shape), sampled(klein, cond, latent_shape)
    assert torch.isfinite(tuned_image).all() and not torch.equal(tuned_image, base_image)

    # Train LoRA's outputs of a full run: the model output samples the trained model (the input stays the base),
    # and the lora output stops a node that reads it with what to use instead
    trained, lora_out, _ = train_nodes.trained_outputs(klein, node_run.Outcome(state_of_run, [], ""))
    torch.testing.assert_close(sampled(trained, cond, latent_shape), tuned_image, rtol=1e-5, atol=1e-5)
    assert torch.equal(sampled(klein, cond, latent_shape), base_image)
    assert bridge.is_blocked(lora_out) and "Kiln Save Diffusion Model" in lora_out.message
    with pytest.raises(ValueError, match="are not in this .* connect the model the run trained"):
        bridge.with_weights(klein, str(tmp_path / "other.safetensors"))

    # extract at full rank: the LoRA reproduces the delta and ComfyUI's loader matches every key
    original = tmp_path / "base" / next(p.name for p in (tmp_path / "base").glob("*.safetensors"))
    lora, _ = extract(ModelFile(original), ModelFile(path), RankRule(rank=4096), svd="full")
    tuned = safetensors_io.read(path)[0]
    for module, weights in lora.items():  # fp32 file: the delta exactly as trained
        delta = tuned[f"{module}.weight"] - ModelFile(original)[f"{module}.weight"].float().numpy()
        rebuilt = weights.B @ weights.A * (weights.alpha / weights.A.shape[0])
        assert np.allclose(rebuilt, delta, atol=1e-5 * max(1.0, float(np.abs(delta).max()))), module
    lora_path = tmp_path / "extracted.safetensors"
    save_lora(lora_path, lora, arch="flux2_klein", fmt="comfy", dtype="fp32", metadata={})
    patched = bridge.apply_lora(klein, load_file(str(lora_path)), strict=True)  # strict: raises on an unmatched key
    assert len(patched.patches) == len(lora)


def test_save_diffusion_model_refuses_a_lora_run(tmp_path):
    state = node_run.KilnState(
        run_dir=str(tmp_path),
        checkpoint="",
        step=1,
        arch="flux2_klein",
        config={"adapter": "lora"},
        lora={},
        ema_lora=None,
    )
    with pytest.raises(ValueError, match="Kiln Save Diffusion Model: this run trained adapter 'lora'.*Kiln Save LoRA"):
        ln.KilnSaveDiffusionModel.execute(state, "kiln/x", False)


def test_save_now_of_a_full_run_writes_a_diffusion_model_that_comfy_loads(tmp_path, comfy_dirs):
    """The dashboard's Save now of a full fine-tune (live.Tracker.save_model): the model as of that step in
    models/diffusion_models/kiln/, listed at once, every weight as given."""
    import types

    import kiln_pack.nodes.live as live

    klein = tc.tiny_flux2(tmp_path)
    tensors = {k: v.float().numpy() + 0.5 for k, v in bridge.diffusion_model(klein).state_dict().items()}
    folder = comfy_dirs / "diffusion_models"
    folder_paths.folder_names_and_paths["diffusion_models"] = ([str(folder)], folder_paths.supported_pt_extensions)
    cfg = small_config("flux2_klein", adapter="full", save_dtype="fp32")
    tracker = types.SimpleNamespace(cfg=cfg, run=types.SimpleNamespace(name="myrun"), run_key="abc")
    name = live.Tracker.save_model(tracker, 7, tensors)
    assert name == "kiln/myrun-step000007.safetensors" and name in folder_paths.get_filename_list("diffusion_models")
    with torch.inference_mode():
        loaded = comfy.sd.load_diffusion_model(str(folder / name), model_options={"dtype": torch.float32})
    for key, value in bridge.diffusion_model(loaded).state_dict().items():
        assert np.array_equal(value.float().numpy(), tensors[key]), key
