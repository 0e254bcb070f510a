"""LoRA files written by the real libraries (tests/helpers/library_loras.py: LyCORIS LoKr, full-matrix LoKr,
LoHa, LoCon and DoRA; PEFT with DoRA; diffusers' save_lora_weights) on the Linears of a tiny Z-Image, Flux2 Klein
and Qwen-Image under their diffusers names (embedders, modulation and final layers included; each name traced to
ComfyUI's weight by ComfyUI's own map, diffusers' own checkpoint converter, or the shared names), converted
by `python -m trainer convert`'s convert_file and loaded by ComfyUI's loader: nothing unmatched, and the weight
change of the library's own merge (#47). Also: `inspect`'s count of keys stock ComfyUI leaves unmatched in the
original file equals what ComfyUI's loader reports for it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from helpers import comfy_env
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.comfyui
comfy_env.require_comfy()

import comfy.lora  # noqa: E402
import comfy.utils  # noqa: E402
from helpers import comfy_lora, library_loras, tiny_comfy  # noqa: E402

from trainer import safetensors_io  # noqa: E402
from trainer.lora import files as lora_format  # noqa: E402
from trainer.lora import report  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
KINDS = {  # the adapter kind each case's library writes (helpers/library_loras.CASES)
    "lycoris_lokr": "lokr",
    "lycoris_lokr_full": "lokr",
    "lycoris_loha": "loha",
    "lycoris_locon": "lora",
    "lycoris_dora": "dora",
    "peft_dora": "dora",
    "diffusers_lora": "lora",
}


def _zimage_names(patcher) -> dict:
    """ComfyUI's own map (comfy.utils.z_image_to_diffusers, embedders and modulation included)."""
    state = patcher.model.state_dict()
    names = {}
    for key, to in comfy.utils.z_image_to_diffusers(
        tiny_comfy.zimage_unet_config(), output_prefix="diffusion_model."
    ).items():
        target, offset = (to, None) if isinstance(to, str) else (to[0], to[1])
        if key.endswith(".weight") and target in state and state[target].ndim == 2:
            names[key[: -len(".weight")]] = (target, offset)
    return names


def _flux2_names(patcher) -> dict:
    """diffusers' own Flux2 checkpoint converter (single_file_utils), run on weights whose values name their key
    and row: each diffusers Linear traced back to a ComfyUI weight and its rows. A weight whose rows it reorders
    (the final adaLN's shift, scale) has no plain name and is left out."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    weights = [k for k, v in patcher.model.state_dict().items() if k.endswith(".weight") and v.ndim == 2]
    shapes = {k: patcher.model.state_dict()[k].shape for k in weights}
    tagged = {
        k.removeprefix("diffusion_model."): (i * 1_000_000 + torch.arange(shapes[k][0], dtype=torch.float64))[
            :, None
        ].expand(shapes[k])
        for i, k in enumerate(weights)
    }
    names = {}
    for name, value in convert_flux2_transformer_checkpoint_to_diffusers(tagged).items():
        source, rows = weights[int(value[0, 0]) // 1_000_000], (value[:, 0] % 1_000_000).long()
        if not torch.equal(rows, torch.arange(int(rows[0]), int(rows[0]) + len(rows))):
            continue
        whole = len(rows) == shapes[source][0]
        names[name.removesuffix(".weight")] = (source, None if whole else (0, int(rows[0]), len(rows)))
    return names


def _qwen_image_names(patcher) -> dict:
    """ComfyUI's Qwen-Image holds diffusers' names (comfy/ldm/qwen_image; its LoRA key map reads them bare)."""
    return {
        k[len("diffusion_model.") : -len(".weight")]: (k, None)
        for k, v in patcher.model.state_dict().items()
        if k.startswith("diffusion_model.") and k.endswith(".weight") and v.ndim == 2
    }


# family → (Kiln arch, the tiny model, {diffusers name: (ComfyUI weight key, row offset or None)}, the pipeline
# whose save_lora_weights writes the diffusers case)
FAMILIES = {
    "zimage": ("zimage", lambda tmp: tiny_comfy.tiny_zimage(), _zimage_names, "ZImagePipeline"),
    "flux2": ("flux2_klein", tiny_comfy.tiny_flux2, _flux2_names, "Flux2KleinPipeline"),
    "qwen_image": ("qwen_image", lambda tmp: tiny_comfy.tiny_qwen_image(), _qwen_image_names, "QwenImagePipeline"),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """family → (patcher, {diffusers name: (ComfyUI weight key, row offset or None)}, folder with the files)."""
    folder = tmp_path_factory.mktemp("library_loras")
    made, spec = {}, {}
    for family, (_, build, naming, pipeline) in FAMILIES.items():
        with torch.inference_mode():
            patcher = build(folder)
        state = patcher.model.state_dict()
        names = naming(patcher)
        shapes = {
            name: [offset[2] if offset else state[target].shape[0], state[target].shape[1]]
            for name, (target, offset) in names.items()
        }
        spec[family] = {"shapes": shapes, "seed": 3, "pipeline": pipeline}
        made[family] = patcher, names, folder / family
    (folder / "spec.json").write_text(json.dumps(spec))
    # The base interpreter: a ComfyUI tree's venv may hold a transformers PEFT cannot import.
    python = getattr(sys, "_base_executable", sys.executable)
    run = subprocess.run(
        [python, "-m", "helpers.library_loras", str(folder / "spec.json"), str(folder)],
        cwd=TESTS,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return made


def _assembled(names, tensors: dict, prefix: str, like: dict) -> dict[str, torch.Tensor]:
    """{ComfyUI weight key: tensor} from per-diffusers-name tensors (q/k/v slices stacked into qkv)."""
    out = {key: torch.zeros_like(value, dtype=torch.float64) for key, value in like.items()}
    for name, (target, offset) in names.items():
        value = torch.as_tensor(np.asarray(tensors[prefix + name]), dtype=torch.float64)
        if offset:
            out[target][offset[1] : offset[1] + offset[2]] = value
        else:
            out[target][:] = value
    return out


def _comfy_loads(patcher, path, caplog) -> tuple[dict, int]:
    """ComfyUI's loader on a file: ({weight key: patches}, keys it reports as not loaded)."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        by_weight = comfy_lora.patches(patcher, path)
    return by_weight, sum("lora key not loaded" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("case", list(library_loras.CASES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_library_file_converts_into_comfyui_with_the_same_weight_change(written, tmp_path, family, case, caplog):
    patcher, names, folder = written[family]
    src, dst = folder / f"{case}.safetensors", tmp_path / "converted.safetensors"
    tensors, _ = safetensors_io.read(src)
    _, stock_unloaded = _comfy_loads(patcher, src, caplog)
    info = report.describe(src)
    assert info["comfyui_unmatched"] == stock_unloaded, (case, info["comfyui_unmatched"], stock_unloaded)
    assert info["kinds"] == [KINDS[case]], (case, info["kinds"])  # inspect names the kind the library wrote
    assert all(row["rank"] for row in info["module_table"]) or case == "lycoris_lokr_full"  # and its rank
    converted = lora_format.convert_file(src, dst, arch=FAMILIES[family][0])
    assert converted.unplaced == []
    name = {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr", "loha": "LoHa"}[KINDS[case]]
    n = converted.total  # every module counted, by the kind the library wrote (DoRA too): N of N
    assert f"{n} of {n} module(s) converted: {n} {name}" in converted.report(), converted.report()
    by_weight, unloaded = _comfy_loads(patcher, dst, caplog)
    assert unloaded == 0 and not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert len(by_weight) == len({target for target, _ in names.values()})
    assert report.describe(dst)["comfyui_unmatched"] == 0
    delta, _ = safetensors_io.read(folder / f"{case}.delta.safetensors")
    state = {key: patcher.model.state_dict()[key] for key in by_weight}
    base = _assembled(names, delta, "base.", state)
    truth = _assembled(names, delta, "", state)
    for key, entries in by_weight.items():
        got = comfy.lora.calculate_weight(entries, base[key].clone().float(), key).double()
        if "dora" not in case:
            error = float((got - base[key] - truth[key]).abs().max())
            assert error <= 1e-4 * float(truth[key].abs().max()), (case, key, error)
            continue
        # DoRA: ComfyUI divides W + ΔW by the base weight's row norms, the library by its own (docs/lora-files.md):
        # the same rows in direction, lengths apart by ‖W + ΔW‖ / ‖W‖
        ours, theirs = got, base[key] + truth[key]
        cosine = (ours * theirs).sum(1) / (ours.norm(dim=1) * theirs.norm(dim=1))
        assert float((1 - cosine).abs().max()) < 1e-6, (case, key)
