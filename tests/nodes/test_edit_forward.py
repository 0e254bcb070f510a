"""Edit training on a tiny Flux2 Klein against a real ComfyUI (COMFYUI_PATH): the training forward with
control latents hands the diffusion model bitwise what ComfyUI's sampler hands it for a prompt with a
ReferenceLatent, and returns the same output; a few loop steps train on an encoded edit dataset."""
from __future__ import annotations

import comfy_env
import numpy as np
import pytest

comfy_env.require_comfy()  # skips this whole module without COMFYUI_PATH

import node_helpers
import tiny_comfy as tc
import torch
from PIL import Image
from test_bridge import Calls, comfy_sampling_calls, embedding

bridge = comfy_env.import_pack("nodes.comfy.bridge")
archs = comfy_env.import_pack("trainer.archs")
companion_batch = comfy_env.import_pack("trainer.companion_batch")


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    return tc.tiny_flux2(tmp_path_factory.mktemp("klein"))


@pytest.fixture(scope="module")
def klein_clip():
    return tc.tiny_klein_clip()


def reference_latent(seed, shape):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def same_kwargs(ours: dict, theirs: dict) -> None:
    keys = set(ours) - {"transformer_options"}
    assert keys == set(theirs) - {"transformer_options"} and "ref_latents" in keys
    for key in keys:
        a, b = ours[key], theirs[key]
        pairs = list(zip(a, b, strict=True)) if isinstance(a, list) else [(a, b)]
        for x, y in pairs:
            assert (x.dtype == y.dtype and torch.equal(x, y)) if torch.is_tensor(x) else x == y, key


@pytest.mark.parametrize("references", [1, 2])
def test_edit_forward_equals_comfy_sampling_with_reference_latents(klein, klein_clip, references):
    text = "make the fox blue"
    refs = [reference_latent(n, (1, 128, 2, 2 + n)) for n in range(references)]   # raw VAE latents
    cond = tc.conditioning(klein_clip, text)
    for ref in refs:   # what the ReferenceLatent node does
        cond = node_helpers.conditioning_set_values(cond, {"reference_latents": [ref]}, append=True)
    theirs = comfy_sampling_calls(klein, cond, (1, 128, 2, 3), steps=2)
    arch = archs.get_arch("flux2_klein")
    context = torch.from_numpy(arch.collate_context([embedding(klein_clip, text)]))
    extras = companion_batch.reference_extras([[r[0].numpy() for r in refs]], arch, ["target.png"])
    forward, dm = bridge.make_forward(klein, "flux2_klein"), bridge.diffusion_model(klein)
    for args, kwargs, output in theirs:
        # As the torch backend hands them over: float32 tensors on the model's device.
        ours_extras = {k: [torch.from_numpy(a) for a in v] for k, v in extras.items()}
        with Calls(dm) as calls, torch.inference_mode():
            ours = forward(dm, args[0], args[1], context, ours_extras)
        (a_args, a_kwargs, _), = calls
        assert all(torch.equal(x, y) for x, y in zip(a_args, args, strict=True))
        same_kwargs(a_kwargs, kwargs)
        assert len(a_kwargs["ref_latents"]) == references
        assert torch.equal(ours, output) and ours.shape == args[0].shape   # the target's tokens only
    with torch.inference_mode():   # the references matter
        plain = forward(dm, theirs[0][0][0], theirs[0][0][1], context, {})
    assert not torch.equal(plain, theirs[0][2])


def test_a_few_steps_train_on_an_encoded_edit_dataset(klein, klein_clip, tmp_path):
    config = comfy_env.import_pack("trainer.config")
    dataset_module = comfy_env.import_pack("trainer.data.dataset")
    training = comfy_env.import_pack("nodes.comfy.training")
    loop = comfy_env.import_pack("trainer.loop")
    root = tmp_path / "edit"
    (root / "control").mkdir(parents=True)
    for n in range(2):
        rgb = np.random.default_rng(n).integers(0, 255, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(rgb).save(root / f"t{n}.png")
        Image.fromarray(255 - rgb).save(root / "control" / f"t{n}.png")
        (root / f"t{n}.txt").write_text("invert the colours")
    vae = tc.tiny_vae(flux2=True)
    settings = dataset_module.DataSettings(resolutions=(64,), divisor=16)
    ds = dataset_module.Dataset.load(root, settings)
    ds = ds.encode_images(*bridge.vae_encoder(vae)).encode_captions(*bridge.text_encoder(klein_clip))
    data = ds.training_data()
    assert len(data.controls(0)) == 1 and data.controls(0)[0].shape == data.latent(0).shape
    cfg = config.from_dict({"arch": "flux2_klein", "device": "cpu", "mixed_precision": "no", "steps": 2,
                            "batch_size": 2, "rank": 2, "alpha": 2.0, "checkpoint_every": 0, "log_every": 1,
                            "caption_dropout": 0.0, "gradient_checkpointing": False, "compile_blocks": False,
                            "resolutions": [64]})
    calls = []

    def run(cfg, module, data, forward=None, **hooks):
        def counted(dm, x, sigmas, context, extras):
            calls.append(len(extras.get("reference_latents", [])))
            return forward(dm, x, sigmas, context, extras)
        return loop.train(cfg, module, data, run_dir=tmp_path / "run", forward=counted)

    result = training.train(cfg, klein, ds, run=run)
    assert result.step == 2 and calls == [1, 1] and all(np.isfinite(result.history.loss))
