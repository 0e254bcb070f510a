"""Kiln Merge LoRAs, Resize LoRA and Extract LoRA in a real ComfyUI (COMFYUI_PATH), on tiny Flux2 / Z-Image.

Each node's LORA_MODEL, and the file ComfyUI's own SaveLoRA writes from it, goes through ComfyUI's own
LoraModelLoader with every key matched; the weights ComfyUI then runs with (loaded, patches merged) minus
the base weights equal the dense reference: the weighted sum of scale·B@A, its truncated SVD, or the
difference between the two models.
"""

from __future__ import annotations

from pathlib import Path

from helpers import comfy_env
import numpy as np
import pytest

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()

import comfy.model_management as mm  # noqa: E402
import comfy.sd  # noqa: E402
import comfy.utils  # noqa: E402
import folder_paths  # noqa: E402
from helpers import tiny_comfy as tc  # noqa: E402
import torch  # noqa: E402
from comfy_extras.nodes_train import LoraModelLoader, SaveLoRA  # noqa: E402

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.nodes.lora_tool_nodes as tools
import kiln_pack.trainer.lora.files as lora_format
import kiln_pack.trainer.lora.tools as lora_tools

MODULES = ("double_blocks.0.img_attn.qkv", "double_blocks.1.img_mlp.0", "single_blocks.1.linear2")
ZIMAGE_MODULES = ("layers.0.attention.qkv", "layers.1.feed_forward.w2")


@pytest.fixture(scope="module")
def output_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("comfy_out")
    folder_paths.set_output_directory(str(root))
    return root


def weights_as_run(model) -> dict[str, torch.Tensor]:
    """The diffusion model's weights as ComfyUI runs them: loaded, every patch merged."""
    mm.load_models_gpu([model], force_full_load=True)
    return {k: v.detach().float().cpu().clone() for k, v in bridge.diffusion_model(model).state_dict().items()}


def random_lora(model, modules, rank, alpha, seed):
    dm, rng = bridge.diffusion_model(model), np.random.default_rng(seed)
    out = {}
    for name in modules:
        rows, cols = dm.get_submodule(name).weight.shape
        out[name] = lora_format.LoraWeights(
            (rng.standard_normal((rank, cols)) * 0.05).astype(np.float32),
            (rng.standard_normal((rows, rank)) * 0.05).astype(np.float32),
            alpha,
        )
    return out


def loaded_by_comfy(model, lora_model, output_dir: Path, name: str):
    """LORA_MODEL → ComfyUI's SaveLoRA file → ComfyUI's LoraModelLoader; both with every key matched."""
    assert bridge.unmatched_lora_keys(model, lora_model) == []
    SaveLoRA.execute(lora_model, f"loras/{name}")
    saved = comfy.utils.load_torch_file(str(next((output_dir / "loras").glob(f"{name}_*.safetensors"))))
    assert bridge.unmatched_lora_keys(model, saved) == []
    direct = LoraModelLoader.execute(model, lora_model, 1.0)
    via_file = LoraModelLoader.execute(model, saved, 1.0)
    return [result.result[0] if hasattr(result, "result") else result[0] for result in (direct, via_file)]


def assert_deltas(model, patched_models, expected: dict[str, np.ndarray], base: dict, tolerance: float):
    for patched in patched_models:
        after = weights_as_run(patched)
        for key, value in after.items():
            name = key.removesuffix(".weight")
            truth = expected.get(name, 0.0)
            change = (value - base[key]).double().numpy()
            scale = max(np.abs(truth).max() if name in expected else 0.0, 1e-6)
            assert np.abs(change - truth).max() <= tolerance * scale, key


def text(result) -> str:
    return "".join(result.ui.as_dict()["text"])


@pytest.mark.parametrize("family", ["flux2", "zimage"])
def test_merge_node_exact_and_to_a_rank(tmp_path, output_dir, family):
    model = tc.tiny_flux2(tmp_path) if family == "flux2" else tc.tiny_zimage()
    modules = MODULES if family == "flux2" else ZIMAGE_MODULES
    base = weights_as_run(model)
    first = random_lora(model, modules, 4, 2.0, seed=1)
    second = random_lora(model, modules[:1], 8, 8.0, seed=2)  # one module only: the others take the first's
    loras = [bridge.lora_model_from(first), bridge.lora_model_from(second)]
    reference = {
        n: sum(w * lora_tools.dense_delta(l, n) for l, w in ((first, 0.6), (second, -0.4)) if n in l) for n in modules
    }

    exact = tools.KilnMergeLoRAs.execute(loras[0], 0.6, 0, "fixed", 0.9, lora_2=loras[1], weight_2=-0.4)
    assert "energy kept 100.00%" in text(exact)
    assert_deltas(model, loaded_by_comfy(model, exact.result[0], output_dir, f"merged_{family}"), reference, base, 1e-5)

    reduced = tools.KilnMergeLoRAs.execute(loras[0], 0.6, 2, "fixed", 0.9, lora_2=loras[1], weight_2=-0.4)
    truncated = {}
    for name, dense in reference.items():
        U, s, Vt = np.linalg.svd(dense, full_matrices=False)
        truncated[name] = (U[:, :2] * s[:2]) @ Vt[:2]
    assert "lowest kept energy" in text(reduced)
    assert_deltas(
        model, loaded_by_comfy(model, reduced.result[0], output_dir, f"merged2_{family}"), truncated, base, 1e-4
    )


def test_resize_node_full_rank_is_exact_and_dynamic_ranks_differ_per_module(tmp_path, output_dir):
    model = tc.tiny_flux2(tmp_path)
    base = weights_as_run(model)
    lora = random_lora(model, MODULES, 6, 3.0, seed=3)
    reference = {n: lora_tools.dense_delta(lora, n) for n in MODULES}
    full = tools.KilnResizeLoRA.execute(bridge.lora_model_from(lora), 6, "fixed", 0.9)
    assert_deltas(model, loaded_by_comfy(model, full.result[0], output_dir, "resized"), reference, base, 1e-5)
    dynamic = tools.KilnResizeLoRA.execute(bridge.lora_model_from(lora), 0, "sv_fro", 0.8)
    assert "sv_fro 0.8" in text(dynamic) and bridge.unmatched_lora_keys(model, dynamic.result[0]) == []
    with pytest.raises(ValueError, match="Kiln Resize LoRA: sv_ratio"):
        tools.KilnResizeLoRA.execute(bridge.lora_model_from(lora), 4, "sv_ratio", 0.5)


def test_extract_node_recovers_loras_applied_to_a_model(tmp_path, output_dir):
    """tuned = base with a known rank-4 LoRA applied (ComfyUI patches, not new weights): Extract reads
    both MODELs' effective weights and gives that LoRA's delta back."""
    model = tc.tiny_flux2(tmp_path)
    base = weights_as_run(model)
    known = random_lora(model, MODULES, 4, 4.0, seed=4)
    tuned = bridge.apply_lora(model, bridge.lora_model_from(known), 1.0)
    result = tools.KilnExtractLoRA.execute(model, tuned, 4, "fixed", 0.9, 1.0, "auto")
    report = text(result)
    assert f"extract (rank 4): {len(MODULES)} modules" in report and "weight matrices are equal" in report
    reference = {n: lora_tools.dense_delta(known, n) for n in MODULES}
    assert_deltas(model, loaded_by_comfy(model, result.result[0], output_dir, "extracted"), reference, base, 1e-4)


def test_extract_node_from_two_model_files_reports_what_a_lora_cannot_hold(tmp_path):
    model = tc.tiny_flux2(tmp_path)
    path = tc.write_flux2_file(tmp_path / "tuned.safetensors", seed=0)
    import safetensors.torch

    tensors = safetensors.torch.load_file(str(path))
    rows, cols = tensors["single_blocks.0.linear2.weight"].shape
    generator = torch.Generator().manual_seed(5)
    delta = torch.randn(rows, 2, generator=generator) @ torch.randn(2, cols, generator=generator) * 0.02
    tensors["single_blocks.0.linear2.weight"] += delta
    tensors["single_blocks.0.norm.key_norm.weight"] *= 1.05
    safetensors.torch.save_file(tensors, str(path))
    with torch.inference_mode():
        tuned = comfy.sd.load_diffusion_model(str(path))
    result = tools.KilnExtractLoRA.execute(model, tuned, 2, "fixed", 0.9, 1.0, "full")
    report = text(result)
    assert "extract (rank 2): 1 modules" in report and "energy kept 100.00%" in report
    assert "1 other tensors differ" in report and "single_blocks.0.norm.key_norm.weight" in report
    weights = bridge.lora_weights_from(result.result[0])
    np.testing.assert_allclose(
        lora_tools.dense_delta(weights, "single_blocks.0.linear2"),
        delta.double().numpy(),
        atol=1e-5 * float(delta.abs().max()),
    )
    with pytest.raises(ValueError, match="Kiln Extract LoRA: the two models have no differing"):
        tools.KilnExtractLoRA.execute(model, model, 2, "fixed", 0.9, 1.0, "auto")
