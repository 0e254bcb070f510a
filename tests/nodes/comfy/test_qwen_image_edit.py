"""Qwen-Image-Edit (2509, 2511) edit training on a tiny QwenImage built with ComfyUI's own classes, against a
real ComfyUI (COMFYUI_PATH): both variants train as `qwen_image` (ComfyUI loads them as that model); the
training forward with control latents hands the diffusion model bitwise what ComfyUI's sampler hands it for
a prompt whose conditioning carries reference latents (TextEncodeQwenImageEdit(Plus) / ReferenceLatent), and
returns the same output; 2511's reference method is the model's own; a run on a dataset with a control/
folder learns the edit, and its LoRA loads through ComfyUI's loader with zero unmatched keys.

The caption embeddings here stand for Encode Captions' (the text alone, docs/datasets.md says why): the
model call is what these tests hold, with the same context on both sides."""

from __future__ import annotations

from helpers import comfy_env
import numpy as np
import pytest

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()  # skips this whole module without COMFYUI_PATH

import node_helpers  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from helpers import tiny_comfy as tc  # noqa: E402
from helpers.bridge_calls import Calls, comfy_sampling_calls  # noqa: E402

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.trainer.archs as archs
import kiln_pack.trainer.data.companion_batch as companion_batch
import kiln_pack.trainer.lora.files as lf

ARCH = archs.get_arch("qwen_image")
# ComfyUI's model_detection: 2509 is plain Qwen-Image's config; 2511 files carry `__index_timestep_zero__`.
VARIANTS = {"2509": {}, "2511": {"default_ref_method": "index_timestep_zero"}}


@pytest.fixture(scope="module", params=list(VARIANTS))
def edit_model(request):
    return request.param, tc.tiny_qwen_image(**VARIANTS[request.param])


def caption(tokens: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((tokens, tc.QWEN_CONTEXT_DIM)).astype(np.float32)


def raw_reference(seed: int, h: int, w: int) -> torch.Tensor:
    """A control image's raw latent as VAEEncode gives it through Qwen-Image's (Wan 2.1) VAE: one frame."""
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((1, 16, 1, h, w)).astype(np.float32))


def edit_cond(embedding: np.ndarray, references: list[torch.Tensor], method: str | None = None):
    """CONDITIONING as TextEncodeQwenImageEditPlus gives it (its reference latents appended to the prompt's),
    with FluxKontextMultiReferenceLatentMethod's key when `method` (ComfyUI's 2511 template sets it)."""
    cond = [[torch.from_numpy(embedding)[None], {}]]
    cond = node_helpers.conditioning_set_values(cond, {"reference_latents": references}, append=True)
    return node_helpers.conditioning_set_values(cond, {"reference_latents_method": method}) if method else cond


def our_edit_call(model, x, sigmas, embeddings, references):
    """Our forward on cached rows: x [B,16,h,w], control latents per row [[16,h,w], ...] (the cache's shapes)."""
    context = torch.from_numpy(ARCH.collate_context(embeddings))
    extras = {
        k: torch.from_numpy(v) for k, v in ARCH.model_extras(len(embeddings), [len(e) for e in embeddings]).items()
    }
    controls = companion_batch.reference_extras(references, ARCH, [f"t{n}.png" for n in range(len(references))])
    extras.update({k: [torch.from_numpy(a) for a in v] for k, v in controls.items()})
    forward, dm = bridge.make_forward(model, "qwen_image"), bridge.diffusion_model(model)
    with Calls(dm) as calls, torch.inference_mode():
        return forward(dm, x, sigmas, context, extras), calls


def same_kwargs(ours: dict, theirs: dict, *, without=()) -> None:
    keys = set(ours) - {"transformer_options"}
    assert keys == set(theirs) - {"transformer_options", *without} and "ref_latents" in keys
    for key in keys:
        pairs = (
            list(zip(ours[key], theirs[key], strict=True))
            if isinstance(ours[key], list)
            else [(ours[key], theirs[key])]
        )
        for a, b in pairs:
            assert (a.dtype == b.dtype and torch.equal(a, b)) if torch.is_tensor(a) else a == b, key


def test_both_edit_variants_train_as_qwen_image(edit_model):
    variant, model = edit_model
    assert bridge.detect_arch(model) == "qwen_image" and bridge.matching_archs(model) == ["qwen_image"]
    method = "index_timestep_zero" if variant == "2511" else "index"
    assert bridge.diffusion_model(model).default_ref_method == method  # the model's own fact, read by its forward
    assert ARCH.reference_latents == "reference_latents"


@pytest.mark.parametrize("references", [1, 2])
def test_edit_forward_equals_comfy_sampling_with_reference_latents(edit_model, references):
    variant, model = edit_model
    emb = caption(7, 0)
    refs = [raw_reference(n, 4, 4 + 2 * n) for n in range(references)]
    theirs = comfy_sampling_calls(model, edit_cond(emb, refs), (1, 16, 1, 4, 4), steps=2)
    dm = bridge.diffusion_model(model)
    for args, kwargs, output in theirs:
        ours, calls = our_edit_call(model, args[0][:, :, 0], args[1], [emb], [[r[0, :, 0].numpy() for r in refs]])
        ((a_args, a_kwargs, _),) = calls
        assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a_args, args, strict=True))
        same_kwargs(a_kwargs, kwargs)
        assert len(a_kwargs["ref_latents"]) == references and a_kwargs["ref_latents"][0].ndim == 5
        assert torch.equal(ours, output[:, :, 0])  # the target's tokens only, bitwise
    args, kwargs, output = theirs[0]
    with torch.inference_mode():  # the references matter, and 2511's method is not 2509's
        plain = dm(*args, **{k: v for k, v in kwargs.items() if k != "ref_latents"})
        other = "index" if variant == "2511" else "index_timestep_zero"
        assert not torch.equal(dm(*args, **kwargs, ref_latents_method=other), output)
    assert not torch.equal(plain, output)


def test_2511_template_method_is_the_model_default():
    """ComfyUI's 2511 template sets index_timestep_zero with FluxKontextMultiReferenceLatentMethod; on a 2511
    file that is the model's default, which Kiln's training forward takes: the same output, bitwise."""
    model = tc.tiny_qwen_image(**VARIANTS["2511"])
    emb, refs = caption(5, 1), [raw_reference(3, 4, 4)]
    theirs = comfy_sampling_calls(model, edit_cond(emb, refs, "index_timestep_zero"), (1, 16, 1, 4, 4), steps=2)
    for args, kwargs, output in theirs:
        assert kwargs["ref_latents_method"] == "index_timestep_zero"
        ours, calls = our_edit_call(model, args[0][:, :, 0], args[1], [emb], [[refs[0][0, :, 0].numpy()]])
        same_kwargs(calls[0][1], kwargs, without={"ref_latents_method"})
        assert torch.equal(ours, output[:, :, 0])


def test_a_batch_of_two_caption_lengths_gives_each_row_its_own_references(edit_model):
    _, model = edit_model
    embs, refs = [caption(5, 2), caption(9, 3)], [raw_reference(4, 4, 4), raw_reference(5, 4, 4)]
    theirs = [
        comfy_sampling_calls(model, edit_cond(e, [r]), (1, 16, 1, 4, 4), seed=i)
        for i, (e, r) in enumerate(zip(embs, refs))
    ]
    x = torch.cat([theirs[0][0][0][0], theirs[1][1][0][0]])[:, :, 0]
    sigmas = torch.cat([theirs[0][0][0][1], theirs[1][1][0][1]])
    ours, calls = our_edit_call(model, x, sigmas, embs, [[r[0, :, 0].numpy()] for r in refs])
    assert len(calls) == 2 and all(len(c[1]["ref_latents"][0]) == 1 for c in calls)  # one row each
    torch.testing.assert_close(ours[0:1], theirs[0][0][2][:, :, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1:2], theirs[1][1][2][:, :, 0], rtol=1e-5, atol=1e-5)


def edit_dataset(root):
    """Two 64 px targets with their controls in control/ (the colours inverted), encoded by a tiny 16-channel
    VAE; the captions' embeddings from a stand-in text encoder (one per text, as Encode Captions caches)."""
    import kiln_pack.trainer.data.dataset as dataset_module

    root.mkdir(parents=True)
    (root / "control").mkdir()
    for n in range(2):
        rgb = np.random.default_rng(n).integers(0, 255, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(rgb).save(root / f"t{n}.png")
        Image.fromarray(255 - rgb).save(root / "control" / f"t{n}.png")
        (root / f"t{n}.txt").write_text("invert the colours")
    settings = dataset_module.DataSettings(resolutions=(64,), divisor=16)
    ds = dataset_module.Dataset.load(root, settings)
    ds = ds.encode_images(*bridge.vae_encoder(tc.tiny_vae(flux2=False)))
    return ds.encode_captions(lambda text: caption(3 + len(text.split()), len(text)), "stand-in encoder")


def edit_loss(model, data, forward_model=None) -> float:
    """The flow loss on both edit items at fixed draws (sigma 0.6), references fed; `forward_model`: the
    model with the LoRA merged by ComfyUI's loader."""
    model = forward_model or model
    rng = np.random.default_rng(7)
    total = 0.0
    for n in range(2):
        x0 = torch.from_numpy(bridge.latents_in(model, data.latent(n)))[None]
        noise = torch.from_numpy(rng.standard_normal(x0.shape).astype(np.float32))
        x_t = 0.4 * x0 + 0.6 * noise
        v, _ = our_edit_call(model, x_t, torch.tensor([0.6]), [data.context(n)], [data.controls(n)])
        total += float(((v - (noise - x0)) ** 2).mean())
    return total / 2


def test_a_run_on_a_control_folder_learns_the_edit_and_loads_in_comfy(edit_model, tmp_path):
    import comfy.model_management as mm

    import kiln_pack.nodes.comfy.training as training
    import kiln_pack.trainer.config as config
    import kiln_pack.trainer.run.loop as loop

    _, model = edit_model
    ds = edit_dataset(tmp_path / "edit")
    data = ds.training_data()
    assert len(data.controls(0)) == 1 and data.controls(0)[0].shape == data.latent(0).shape == (16, 8, 8)
    values = dict(arch="qwen_image", device="cpu", mixed_precision="no", steps=12, batch_size=2, rank=4)
    values.update(alpha=4.0, learning_rate=5e-3, seed=1, checkpoint_every=0, log_every=1, caption_dropout=0.0)
    cfg = config.from_dict({**values, "gradient_checkpointing": False, "compile_blocks": False, "resolutions": [64]})
    calls = []

    def run(cfg, module, data, forward=None, **hooks):
        def counted(dm, x, sigmas, context, extras):
            calls.append(len(extras.get("reference_latents", [])))
            return forward(dm, x, sigmas, context, extras)

        return loop.train(cfg, module, data, run_dir=tmp_path / "run", forward=counted)

    before = edit_loss(model, data)
    result = training.train(cfg, model, ds, run=run)
    assert result.step == 12 and calls == [1] * 12 and all(np.isfinite(result.history.loss))
    path = tmp_path / "edit.safetensors"
    metadata = lf.build_metadata(arch_name="qwen_image", config={}, steps=12, trigger_words=[], title="edit")
    lf.save_lora(path, result.lora, arch="qwen_image", fmt="comfy", metadata=metadata)
    tensors = bridge.load_lora_file(path)
    assert bridge.unmatched_lora_keys(model, tensors) == []
    patched = bridge.apply_lora(model, tensors, 1.0)
    mm.load_models_gpu([patched], force_full_load=True)
    after = edit_loss(model, data, patched)
    mm.load_models_gpu([model], force_full_load=True)
    assert after < 0.9 * before, (before, after)
