"""A LoRA on every Linear of a tiny model built from ComfyUI's own classes (Z-Image, Flux2 Klein, Chroma, Lumina 2,
Qwen-Image, Wan 2.1), embedders, modulation and final layers included (trainer/lora/outside.py), in each key form
other trainers write: `diffusion_model.<path>` (ai-toolkit), `lora_unet_<flat path>` (kohya, musubi-tuner),
`transformer.<diffusers name>` (diffusers, PEFT) and `lycoris_<flat diffusers name>` (SimpleTuner's LyCORIS).
`convert` places every key, and ComfyUI's loader reads the result with no key unmatched and each module's ΔW (#47).
The diffusers names are Kiln's export (tests/trainer/lora/test_family_diffusers_names.py holds them to diffusers'
own models); a module diffusers has no plain name for (Flux2's final adaLN) is in the ComfyUI forms only.
`inspect`'s count of the keys stock ComfyUI loads from each file as is equals what ComfyUI's loader takes."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch
from helpers import comfy_env

pytestmark = pytest.mark.comfyui
comfy_env.require_comfy()

from helpers import comfy_lora, tiny_comfy, tiny_families, tiny_wan

from trainer import safetensors_io
from trainer.lora import files as lf
from trainer.lora import keys, report

RANK = 2
# family → (Kiln arch, the tiny model)
FAMILIES = {
    "zimage": ("zimage", lambda tmp: tiny_comfy.tiny_zimage()),
    "flux2": ("flux2_klein", lambda tmp: tiny_comfy.tiny_flux2(tmp)),
    "chroma": ("chroma", lambda tmp: tiny_families.chroma(tmp)),
    "lumina2": ("lumina2", lambda tmp: tiny_families.lumina2(tmp)),
    "qwen_image": ("qwen_image", lambda tmp: tiny_comfy.tiny_qwen_image()),
    "wan": ("wan21_t2v", lambda tmp: tiny_wan.load(tiny_wan.write_wan_file(tmp / "wan.safetensors"))),
}
FORMS = ("diffusion_model", "lora_unet", "transformer", "lycoris")
# Modules left out of the diffusers forms: Flux2's final adaLN has no plain diffusers name (outside.NO_NAME_WHY);
# Chroma's linear1 and Lumina 2's qkv split at the released model's sizes, which a tiny model's rows are not
# (test_family_diffusers_names holds those splits on diffusers' full-size models).
NOT_IN_DIFFUSERS_FORMS = {
    "flux2": r"final_layer\.adaLN_modulation\.1",
    "chroma": r"single_blocks\.\d+\.linear1",
    "lumina2": r"(layers|noise_refiner|context_refiner)\.\d+\.attention\.qkv",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            with torch.inference_mode():
                made[family] = FAMILIES[family][1](tmp_path_factory.mktemp(family))
        return made[family]

    return get


def _every_linear(patcher) -> dict[str, lf.LoraWeights]:
    """A LoRA (alpha ≠ rank) on each 2-D weight of the model, keyed by its ComfyUI path."""
    rng = np.random.default_rng(0)
    shapes = {
        k[len("diffusion_model.") : -len(".weight")]: tuple(v.shape)
        for k, v in patcher.model.state_dict().items()
        if k.startswith("diffusion_model.") and k.endswith(".weight") and v.ndim == 2
    }
    return {
        path: lf.LoraWeights(
            rng.standard_normal((RANK, fan_in)).astype(np.float32),
            rng.standard_normal((out, RANK)).astype(np.float32),
            RANK * 1.5,
        )
        for path, (out, fan_in) in shapes.items()
    }


def _file(lora, form: str, arch: str) -> dict[str, np.ndarray]:
    """The LoRA's keys as a trainer writing this form would lay them out."""
    if form == "diffusion_model":  # ai-toolkit: PEFT's names, scale folded in (no alpha)
        return {
            k: v
            for path, w in lora.items()
            for k, v in {
                f"diffusion_model.{path}.lora_A.weight": w.A,
                f"diffusion_model.{path}.lora_B.weight": w.B * w.scale,
            }.items()
        }
    if form == "lora_unet":  # kohya / musubi-tuner
        return lf.to_tensors(lora, "kohya", arch)
    named = {p: w for p, w in lora.items() if _exported(arch, p, w.B.shape[0])}
    tensors = lf.to_tensors(named, "diffusers", arch)
    if form == "transformer":
        return tensors
    return {  # SimpleTuner's LyCORIS: the diffusers name flattened, lora_down/lora_up
        "lycoris_"
        + k.removeprefix("transformer.").replace(".lora_A.weight", "").replace(".lora_B.weight", "").replace(".", "_")
        + (".lora_down.weight" if ".lora_A." in k else ".lora_up.weight"): v
        for k, v in tensors.items()
    }


def _exported(arch: str, path: str, rows: int) -> bool:
    """Whether the diffusers export names the module at these rows (a module no rule knows fails here)."""
    rule, names = keys.diffusers_targets(keys.arch_of(arch), path)
    return bool(names) and (rule.split_sizes is None or sum(rule.split_sizes) == rows)


def _comfy_deltas(patcher, path, caplog) -> tuple[dict[str, torch.Tensor], list[str]]:
    """ComfyUI's loader on a file: ({ComfyUI path: ΔW}, its warnings)."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        deltas = comfy_lora.deltas(patcher, comfy_lora.patches(patcher, path))
    return deltas, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_linear_in_every_key_form_converts_into_comfyui(models, tmp_path, family, form, caplog):
    arch = FAMILIES[family][0]
    patcher = models(family)
    lora = _every_linear(patcher)
    tensors = _file(lora, form, arch)
    src, dst = tmp_path / f"{form}.safetensors", tmp_path / "converted.safetensors"
    safetensors_io.write(src, tensors, {}, dtype={k: "F32" for k in tensors})
    converted = lf.convert_file(src, dst, arch=arch)
    assert converted.unplaced == []
    got, warnings = _comfy_deltas(patcher, dst, caplog)
    assert warnings == []  # nothing unmatched, no patch of the wrong shape
    wanted = set(lora)
    if form in ("transformer", "lycoris"):
        wanted = {p for p, w in lora.items() if _exported(arch, p, w.B.shape[0])}
        left = sorted(set(lora) - wanted)
        assert bool(left) == (family in NOT_IN_DIFFUSERS_FORMS), left
        assert all(re.fullmatch(NOT_IN_DIFFUSERS_FORMS[family], p) for p in left), left
    assert sorted(got) == sorted(wanted)
    for path in wanted:
        w = lora[path]
        truth = (w.B.astype(np.float64) @ w.A.astype(np.float64)) * w.scale
        error = float(np.abs(got[path].double().numpy().reshape(truth.shape) - truth).max())
        assert error <= 1e-5 * float(np.abs(truth).max()), (family, form, path, error)


def _comfy_loaded_keys(patcher, path, caplog) -> int:
    """How many of a file's keys ComfyUI's loader takes onto the model: those load_lora reads (it warns 'lora key
    not loaded' of each other key), less those whose patch add_patches drops (a weight the model lacks: NOT LOADED)."""
    import comfy.lora
    import comfy.utils

    lora = comfy.utils.load_torch_file(str(path), safe_load=True)
    key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        patches = comfy.lora.load_lora(lora, key_map)
    told = "lora key not loaded: "
    left = {m[len(told) :] for r in caplog.records if (m := r.getMessage()).startswith(told)}
    kept = {k if isinstance(k, str) else k[0] for k in patcher.clone().add_patches(patches, 1.0)}

    def target(key: str) -> str:  # the weight of the key map's entry that read the key (the longest name it starts)
        to = key_map[max((n for n in key_map if key.startswith(n + ".")), key=len)]
        return to if isinstance(to, str) else to[0]

    return sum(key not in left and target(key) in kept for key in lora)


# The files stock ComfyUI loads no key of as they are: it maps Lumina 2 with Z-Image's diffusers names
# (comfy/lora.py → comfy/utils.py z_image_to_diffusers), not diffusers' Lumina2 ones, and Wan with none.
NOTHING_LOADED = {("lumina2", "transformer"), ("lumina2", "lycoris"), ("wan", "transformer"), ("wan", "lycoris")}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_inspect_counts_the_keys_comfyui_loads_from_the_file_as_is(models, tmp_path, family, form, caplog):
    patcher = models(family)
    tensors = _file(_every_linear(patcher), form, FAMILIES[family][0])
    src = tmp_path / f"{form}.safetensors"
    safetensors_io.write(src, tensors, {}, dtype={k: "F32" for k in tensors})
    info = report.describe(src)
    loaded = _comfy_loaded_keys(patcher, src, caplog)
    assert len(tensors) - info["comfyui_unmatched"] == loaded, (family, form, info["comfyui_unmatched_keys"][:4])
    assert (loaded == 0) == ((family, form) in NOTHING_LOADED), (family, form, loaded)


def test_inspect_counts_zimage_names_comfyui_maps_onto_lumina2(models, tmp_path, caplog):
    """A Lumina 2 file in Z-Image's diffusers names loads in ComfyUI, but for a name of a weight Lumina 2 lacks
    (Z-Image's adaLN_modulation.0; Lumina 2's is .1: its patch is dropped) and diffusers' own Lumina2 names."""
    patcher = models("lumina2")
    lora = _every_linear(patcher)
    zimage = keys.arch_of("zimage")
    # q/k/v left out: Z-Image's map splits qkv in equal thirds, which Lumina 2's grouped k/v heads are not
    named = {p: w for p, w in lora.items() if keys.diffusers_targets(zimage, p) and not p.endswith(".qkv")}
    ada, out = lora["layers.0.adaLN_modulation.1"], lora["layers.0.attention.out"]
    dropped = {
        "transformer.layers.0.adaLN_modulation.0.lora_A.weight": ada.A,
        "transformer.layers.0.adaLN_modulation.0.lora_B.weight": ada.B,
        **lf.to_tensors({"layers.0.attention.out": out}, "diffusers", "lumina2"),  # attn.to_out.0
    }
    tensors = {**lf.to_tensors(named, "diffusers", "zimage"), **dropped}
    src = tmp_path / "zimage_names.safetensors"
    safetensors_io.write(src, tensors, {"kiln.arch": "lumina2"}, dtype={k: "F32" for k in tensors})
    info = report.describe(src)
    assert info["arch_fit"] == "lumina2"
    assert info["comfyui_unmatched_keys"] == sorted(dropped)
    assert _comfy_loaded_keys(patcher, src, caplog) == len(tensors) - len(dropped)
