"""trainer/lora/sources.py: other trainers' LoRA files (tests/helpers/lora_fixtures.py) → Kiln's in-memory LoRA →
a comfy file; `python -m trainer convert`. ComfyUI's own loader reads the results in
tests/nodes/test_lora_convert.py."""

from __future__ import annotations

import json

from helpers import lora_fixtures as fx
import numpy as np
import pytest

from trainer import safetensors_io
from trainer.cli.main import main
from trainer.lora import files as lf
from trainer.lora import report as lora_report
from trainer.lora import sources as ls

HIDDEN = 64
SHAPES = {
    "flux2": {
        "double_blocks.0.img_attn.qkv": (3 * HIDDEN, HIDDEN),
        "double_blocks.0.img_attn.proj": (HIDDEN, HIDDEN),
        "double_blocks.1.txt_attn.qkv": (3 * HIDDEN, HIDDEN),
        "double_blocks.1.img_mlp.0": (6 * HIDDEN, HIDDEN),
        "single_blocks.0.linear1": (9 * HIDDEN, HIDDEN),
        "single_blocks.1.linear2": (HIDDEN, 4 * HIDDEN),
        "img_in": (HIDDEN, 128),
    },
    "zimage": {
        "layers.0.attention.qkv": (3 * HIDDEN, HIDDEN),
        "layers.0.attention.out": (HIDDEN, HIDDEN),
        "layers.1.feed_forward.w1": (2 * HIDDEN, HIDDEN),
        "layers.1.feed_forward.w3": (2 * HIDDEN, HIDDEN),
        "noise_refiner.0.attention.qkv": (3 * HIDDEN, HIDDEN),
        "layers.0.attention_norm1": (HIDDEN, 1),
    },
}
ARCH = {"flux2": "flux2_klein", "zimage": "zimage"}


def _delta(w: lf.LoraWeights) -> np.ndarray:
    return (w.B.astype(np.float64) @ w.A.astype(np.float64)) * w.scale


def _close(a, b):
    return np.allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(b).max())))


@pytest.mark.parametrize("family,name", fx.cases())
def test_every_key_is_placed_with_the_same_effect(family, name):
    fixture = fx.build(family, name, SHAPES[family])
    converted = ls.read(fixture.tensors, arch=None, metadata=fixture.metadata, source=name)
    assert converted.unplaced == [], converted.report()
    assert converted.arch is not None and converted.arch.family == family  # detected from the names alone
    assert len(converted.passthrough) == fixture.passthrough
    lora_paths = {p for p in fixture.delta if p in converted.lora}
    for path in lora_paths:
        assert _close(_delta(converted.lora[path]), fixture.delta[path]), (name, path)
    # Everything else is passed through under a name ComfyUI maps: its ComfyUI path, or a diffusers part
    passed = {k.rsplit(".", 1)[0] for k in converted.passthrough}
    for path in set(fixture.delta) - lora_paths:
        names = {f"diffusion_model.{path}"} | {f"transformer.{n}" for n in _parts(family, path)}
        assert passed & names, (name, path, passed)
    assert lora_paths | {p for p in fixture.delta if any(path_in(k, p, family) for k in passed)} == set(fixture.delta)


def _parts(family, path):
    try:
        return fx.diffusers_names(family, path)
    except KeyError:
        return []


def path_in(module_key: str, path: str, family: str) -> bool:
    return module_key == f"diffusion_model.{path}" or module_key[len("transformer.") :] in _parts(family, path)


@pytest.mark.parametrize("family,name", [c for c in fx.cases() if fx.build(*c, SHAPES[c[0]]).passthrough == 0])
def test_lora_files_load_everywhere_kiln_reads_a_lora(tmp_path, family, name):
    """load_lora (Train LoRA's adapter, Invert Adapter, init_lora) and inspect read each LoRA-pair file."""
    fixture = fx.build(family, name, SHAPES[family])
    path = tmp_path / "foreign.safetensors"
    safetensors_io.write(path, fixture.tensors, fixture.metadata)
    lora, _ = lf.load_lora(path)
    assert sorted(lora) == sorted(fixture.delta)
    info = lora_report.describe(path)
    assert info["modules"] >= len(fixture.delta)  # diffusers parts are listed unfused


def test_an_ai_toolkit_lokr_in_comfy_keys_reads_as_a_lokr_adapter(tmp_path):
    """ai-toolkit writes LoKr under ComfyUI's keys, the layout Kiln's own LoKr files have (trainer/lora/adapter_files.py):
    it reads as LoKr adapters (the LoRA-pair tools refuse those by name: tests/trainer/lora/test_adapters.py)."""
    fixture = fx.build("flux2", "ai-toolkit LoKr", SHAPES["flux2"])
    adapters, fmt = lf.from_tensors(fixture.tensors)
    assert fmt == "comfy" and adapters and {w.kind for w in adapters.values()} == {"lokr"}


def test_convert_writes_a_comfy_file_and_records_the_source(tmp_path):
    fixture = fx.build("zimage", "SimpleTuner LyCORIS LoKr", SHAPES["zimage"])
    lokr = fx.build("zimage", "ai-toolkit", SHAPES["zimage"], seed=1)
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    safetensors_io.write(src, {**fixture.tensors, **lokr.tensors}, {"ss_network_dim": "4"})
    converted = lf.convert_file(src, dst)
    tensors, metadata = safetensors_io.read(dst)
    assert all(k.startswith(("diffusion_model.", "transformer.")) for k in tensors)
    assert "transformer.layers.0.attention.to_q.lokr_w1" in tensors  # a q/k/v part: ComfyUI applies it to its slice
    assert json.loads(metadata["kiln.converted_from"]) == ls.file_identity(src)
    assert metadata["kiln.arch"] == "zimage" and metadata["ss_network_dim"] == "4"
    assert converted.report() in metadata["kiln.convert_report"]


def test_unplaced_keys_stop_the_conversion_or_are_listed(tmp_path, capsys):
    fixture = fx.build("flux2", "musubi-tuner", SHAPES["flux2"])
    stray = {
        "lora_unet_txt_in_extra.lora_down.weight": np.ones((4, 8), np.float32),
        "lora_te1_text_model_encoder.lora_up.weight": np.ones((8, 4), np.float32),
        "diffusion_model.double_blocks.0.img_attn.qkv.dora_scale": np.ones(8, np.float32),
    }
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    safetensors_io.write(src, {**fixture.tensors, **stray}, {})
    assert main(["convert", str(src), str(dst)]) == 2
    error = capsys.readouterr().err
    assert all(key in error for key in stray) and not dst.exists()
    assert main(["convert", str(src), str(dst), "--allow-unplaced"]) == 0
    out = capsys.readouterr().out
    assert "3 key(s) not placed" in out and all(key in out for key in stray)
    lora, _ = lf.load_lora(dst)
    assert sorted(lora) == sorted(fixture.delta)


def test_ambiguous_and_foreign_names_are_not_guessed():
    arch = lf.get_arch("flux2_klein")
    assert (
        ls.place(arch, "double_blocks_0_img_attn_qkv", None, flat=True, verbatim=False).path
        == "double_blocks.0.img_attn.qkv"
    )
    assert ls.place(arch, "double_blocks_0_img_mod_lin", None, flat=True, verbatim=False) is None
    assert ls.place(arch, "layers.0.attention.to_q", None, flat=False, verbatim=False) is None  # Z-Image's


@pytest.mark.parametrize("family,name", fx.cases())
def test_inspect_reads_what_convert_reads(tmp_path, family, name):
    """`inspect` describes every fixture convert reads (LoKr and LoHa included), names only the file's own keys
    and its stored dtype, and says who wrote it; musubi's converted `img_attn_proj` names are counted as keys stock
    ComfyUI leaves unmatched, which the converted file no longer has (#47)."""
    from trainer import safetensors_io
    from trainer.lora import files, report

    fixture = fx.build(family, name, SHAPES[family])
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    safetensors_io.write(src, fixture.tensors, fixture.metadata, dtype={k: "F16" for k in fixture.tensors})
    info = report.describe(src)
    assert info["module_table"] and info["writer"] and info["kinds"] and all(info["kinds"])  # each kind named
    if any(k.endswith((".dora_scale", ".lora_magnitude_vector")) for k in fixture.tensors):  # DoRA, with its rank
        assert "dora" in info["kinds"] and all(row["rank"] for row in info["module_table"] if row["kind"] == "dora")
    assert {row["dtype"] for row in info["module_table"]} == {"F16"}
    assert set(info["comfyui_unmatched_keys"]) <= set(fixture.tensors)
    assert info["arch_fit"] is not None and info["arch_fit"].split("_")[0] == family.split("_")[0]
    if name == "musubi-tuner convert_lora.py" and family == "flux2":
        assert any("img_attn_proj" in key for key in info["comfyui_unmatched_keys"])
    files.convert_file(src, dst)
    assert report.describe(dst)["comfyui_unmatched"] == 0
    assert "written by" in report.format_description(info)


@pytest.mark.parametrize(
    "dora_key,scale_shape",
    [
        ("lora_unet_layers_0_attention_out.dora_scale", (HIDDEN, 1)),
        ("lora_unet_layers_0_attention_out.lora_magnitude_vector", (HIDDEN,)),
    ],
    ids=["lycoris", "peft"],
)
def test_convert_counts_dora_modules_among_the_files_modules(tmp_path, capsys, dora_key, scale_shape):
    """A DoRA module goes in as it is (exact under ComfyUI's names), and convert's summary counts it among the file's
    modules, named DoRA: a whole file reads N of N modules."""
    rng = np.random.default_rng(0)
    tensors = {}
    for name, (out, fan_in) in SHAPES["zimage"].items():
        if name.endswith("norm1"):
            continue
        flat = "lora_unet_" + name.replace(".", "_")
        tensors[flat + ".lora_down.weight"] = rng.standard_normal((4, fan_in), dtype=np.float32)
        tensors[flat + ".lora_up.weight"] = rng.standard_normal((out, 4), dtype=np.float32)
        tensors[flat + ".alpha"] = np.array(2.0, np.float32)
    tensors[dora_key] = rng.random(scale_shape, dtype=np.float32) + 0.5  # on layers.0.attention.out
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    safetensors_io.write(src, tensors, {})
    assert main(["convert", str(src), str(dst)]) == 0
    out = capsys.readouterr().out
    assert "5 of 5 module(s) converted: 4 LoRA, 1 DoRA" in out, out
    assert "passed through" not in out
    written, metadata = safetensors_io.read(dst)
    assert "diffusion_model.layers.0.attention.out.dora_scale" in written
    assert "5 of 5 module(s) converted: 4 LoRA, 1 DoRA" in metadata["kiln.convert_report"]
