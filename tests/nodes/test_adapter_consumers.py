"""LoKr, LoHa and DoRA files in ComfyUI's own loader (comfy.sd.load_lora_for_models, what LoraLoader runs):
every key loads, and the patched tiny Flux2 Klein gives the output Kiln's training forward gave with the
same adapter, to fp32 tolerance (relative to the adapter's effect on the output)."""

from __future__ import annotations

import logging

from helpers import comfy_env
import pytest
import torch

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()

import comfy.sd
import comfy.utils
from helpers import tiny_comfy

from trainer import archs
from trainer.backends.torch_backend.lora import LoraSet
from trainer.lora import files as lf

TOLERANCE = 1e-4
KINDS = {"lokr": {"lokr_factor": 4}, "lokr_full": {"lokr_full_w2": True}, "loha": {}, "dora": {}}


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    return tiny_comfy.tiny_flux2(tmp_path_factory.mktemp("klein"))


def _inputs(dm):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 128, 2, 2, generator=gen)
    context = torch.randn(1, 4, tiny_comfy.FLUX2_CONTEXT_DIM, generator=gen)
    return x, torch.tensor([0.6]), context


def _output(dm, inputs):
    with torch.no_grad():
        return dm(*inputs).float()


def _trained_adapter(dm, name: str):
    """Kiln's training forward with the adapter at random (as if trained) values, and its weights."""
    kind = name.split("_")[0]
    lora_set = LoraSet(
        dm,
        archs.get_arch("flux2_klein").default_targets,
        rank=4,
        alpha=8.0,
        dropout=0.0,
        seed=0,
        adapter=kind,
        **KINDS[name],
    )
    gen = torch.Generator().manual_seed(1)
    try:
        with torch.no_grad():
            for pname, p in lora_set.named_parameters():  # dora_scale near the column norms
                noise = torch.randn(p.shape, generator=gen) * 0.3
                p.copy_(p * (1 + noise) if pname.endswith("dora_scale") else noise)
        out = _output(dm, _inputs(dm))
        weights = {path: branch.weights() for path, branch in lora_set.branches().items()}
    finally:
        lora_set.remove()
    return out, weights


@pytest.mark.parametrize("fmt", ["comfy", "kohya"])
@pytest.mark.parametrize("name", list(KINDS))
def test_comfyui_loader_gives_the_training_forward(klein, tmp_path, caplog, name, fmt):
    dm = klein.model.diffusion_model
    assert next(dm.parameters()).dtype == torch.float32
    base = _output(dm, _inputs(dm))
    trained, weights = _trained_adapter(dm, name)
    assert torch.equal(_output(dm, _inputs(dm)), base)  # the adapter came out again
    path = tmp_path / "adapter.safetensors"
    meta = lf.build_metadata(
        arch_name="flux2_klein", config={"adapter": name.split("_")[0]}, steps=1, trigger_words=[], title="t"
    )
    lf.save_lora(path, weights, arch="flux2_klein", fmt=fmt, dtype="fp32", metadata=meta)
    tensors = comfy.utils.load_torch_file(str(path), safe_load=True)
    with caplog.at_level(logging.WARNING):
        patched, _ = comfy.sd.load_lora_for_models(klein, None, tensors, 1.0, 0)
    assert "lora key not loaded" not in caplog.text
    assert len(patched.patches) == len(weights)
    patched.patch_model()
    try:
        got = _output(patched.model.diffusion_model, _inputs(dm))
    finally:
        patched.unpatch_model()
    effect = (trained - base).abs().max().item()
    assert effect > 1e-3
    assert (got - trained).abs().max().item() / effect < TOLERANCE


def test_train_node_trains_a_dora_that_save_lora_writes(comfy_dirs, tmp_path_factory):
    """Train LoRA with Training Options' adapter = dora: its MODEL carries the adapter as ComfyUI patches
    (every key loaded), Save LoRA writes the dora file, and the file reads back as DoRA."""
    import kiln_pack.nodes.lora_nodes as ln
    from helpers.node_runs import encoded_dataset, out, train

    model = tiny_comfy.tiny_flux2(tmp_path_factory.mktemp("m"))
    ds = encoded_dataset(comfy_dirs, tiny_comfy.tiny_vae(flux2=True), tiny_comfy.tiny_klein_clip(), "ds_dora")
    trained, lora_model, state = train(model, ds, steps=3, options={"adapter": "dora"}).result[:3]
    assert all(key.endswith((".lora_A.weight", ".lora_B.weight", ".alpha", ".dora_scale")) for key in lora_model)
    assert sum(key.endswith(".dora_scale") for key in lora_model) == len(state.best_lora())
    assert len(trained.patches) == len(state.best_lora())
    saved = out(ln.KilnSaveLoRA.execute(lora_model, "kiln/dora", "kohya", "bf16", "", "", False, state))
    weights, metadata = lf.load_lora(saved)
    assert metadata["kiln.adapter"] == "dora" and {w.kind for w in weights.values()} == {"dora"}
