"""trainer/lora/files.py: key layouts, diffusers split/fuse, files, metadata."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from trainer import safetensors_io
from trainer.archs import DiffusersRule, get_arch
from trainer.lora import files as lf
from trainer.lora import report as lora_report
from trainer.lora.files import LoraWeights

from helpers.lora_cases import CASES, FLUX2_MODULES, HIDDEN, RANK, ZIMAGE_MODULES, delta, lora_metadata, make_lora


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for path, w in a.items():
        assert np.array_equal(w.A, b[path].A), path
        assert np.array_equal(w.B, b[path].B), path
        assert w.alpha == b[path].alpha, path


def assert_same_effect(a: dict, b: dict, rtol=1e-6):
    """The same B@A·scale per module; the diffusers export folds the scale into B (alpha = rank)."""
    assert sorted(a) == sorted(b)
    for path, w in a.items():
        assert np.allclose(delta(b[path]), delta(w), rtol=rtol, atol=rtol * np.abs(delta(w)).max()), path


FOLDS = {"diffusers"}  # the formats that write no alpha: scale 1, alpha/rank folded into B


@pytest.mark.parametrize("arch_name,modules", CASES)
@pytest.mark.parametrize("fmt", list(lf.FORMATS))
def test_key_round_trip(arch_name, modules, fmt):
    lora = make_lora(modules)
    tensors = lf.to_tensors(lora, fmt, arch_name)
    back, detected = lf.from_tensors(tensors, arch=arch_name, module_names=list(modules))
    assert detected == fmt
    if fmt in FOLDS:
        assert not any(k.endswith(".alpha") for k in tensors)
        assert all(w.alpha == w.rank for w in back.values())
        assert_same_effect(lora, back)
    else:
        assert_same(lora, back)


def test_key_names():
    w = make_lora({"double_blocks.0.img_attn.qkv": (3 * HIDDEN, HIDDEN)})
    assert sorted(lf.to_tensors(w, "comfy", "flux2_klein")) == [
        "diffusion_model.double_blocks.0.img_attn.qkv.alpha",
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight",
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight",
    ]
    assert sorted(lf.to_tensors(w, "kohya", "flux2_klein")) == [
        "lora_unet_double_blocks_0_img_attn_qkv.alpha",
        "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
        "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight",
    ]
    assert lf.to_tensors(w, "comfy", None)["diffusion_model.double_blocks.0.img_attn.qkv.alpha"].shape == ()


def test_diffusers_split_is_exact_shares_A_and_folds_the_scale():
    lora = make_lora(FLUX2_MODULES)
    tensors = lf.to_tensors(lora, "diffusers", "flux2_klein")
    qkv = lora["double_blocks.0.img_attn.qkv"]
    for i, part in enumerate(["to_q", "to_k", "to_v"]):
        base = f"transformer.transformer_blocks.0.attn.{part}"
        assert np.array_equal(
            tensors[base + ".lora_B.weight"], qkv.B[i * HIDDEN : (i + 1) * HIDDEN] * np.float32(qkv.scale)
        )
        assert np.array_equal(tensors[base + ".lora_A.weight"], qkv.A)
    txt = [f"transformer.transformer_blocks.0.attn.add_{p}_proj.lora_B.weight" for p in "qkv"]
    txt_qkv = lora["double_blocks.0.txt_attn.qkv"]
    assert np.array_equal(np.concatenate([tensors[k] for k in txt]), txt_qkv.B * np.float32(txt_qkv.scale))
    assert "transformer.single_transformer_blocks.1.attn.to_qkv_mlp_proj.lora_A.weight" in tensors
    assert "transformer.single_transformer_blocks.1.attn.to_out.lora_B.weight" in tensors
    assert "transformer.transformer_blocks.0.attn.to_out.0.lora_A.weight" in tensors
    assert "transformer.transformer_blocks.1.ff_context.linear_out.lora_B.weight" in tensors
    # diffusers refuses or ignores `.alpha` keys (#19): none are written, the scale is in B.
    assert not [k for k in tensors if not k.endswith((".lora_A.weight", ".lora_B.weight"))]
    assert all(k.startswith("transformer.") for k in tensors)


def test_folding_the_scale_into_bf16():
    """A power-of-two scale folds exactly; any other costs one more bf16 rounding of B·scale."""
    rng = np.random.default_rng(1)
    A, B = rng.standard_normal((RANK, HIDDEN), dtype=np.float32), rng.standard_normal((HIDDEN, RANK), dtype=np.float32)
    for alpha, exact in ((2.0 * RANK, True), (RANK / 4, True), (0.75 * RANK, False)):
        w = LoraWeights(_bf16(A), _bf16(B), alpha)  # as Kiln's comfy file holds it
        tensors = lf.to_tensors({"layers.0.attention.out": w}, "diffusers", "zimage")
        B_folded = _bf16(tensors["transformer.layers.0.attention.to_out.0.lora_B.weight"])  # as the file holds it
        folded = LoraWeights(_bf16(A), B_folded, float(RANK))
        if exact:
            assert np.array_equal(delta(folded), delta(w)), alpha
        else:
            error = np.abs(delta(folded) - delta(w)).max() / np.abs(delta(w)).max()
            assert 0 < error < 2**-8, error


def test_zimage_diffusers_names():
    keys = lf.to_tensors(make_lora(ZIMAGE_MODULES), "diffusers", "zimage")
    for name in [
        "layers.3.attention.to_q",
        "layers.3.attention.to_v",
        "layers.3.attention.to_out.0",
        "layers.3.feed_forward.w2",
        "noise_refiner.0.feed_forward.w1",
    ]:
        assert f"transformer.{name}.lora_B.weight" in keys


def _foreign_qkv(ranks=(2, 3, 5), alphas=(1.0, 6.0, None), seed=3):
    """A diffusers file from another trainer: q/k/v with their own A, ranks and alphas."""
    rng = np.random.default_rng(seed)
    tensors, parts = {}, []
    for name, rank, alpha in zip(["to_q", "to_k", "to_v"], ranks, alphas):
        base = f"transformer.layers.3.attention.{name}"
        A = rng.standard_normal((rank, HIDDEN), dtype=np.float32)
        B = rng.standard_normal((HIDDEN, rank), dtype=np.float32)
        tensors |= {base + ".lora_A.weight": A, base + ".lora_B.weight": B}
        if alpha is not None:
            tensors[base + ".alpha"] = np.array(alpha, np.float32)
        parts.append(LoraWeights(A, B, rank if alpha is None else alpha))  # no alpha: scale 1
    return tensors, parts


def test_block_diagonal_fusion_keeps_the_product():
    tensors, parts = _foreign_qkv()
    lora, fmt = lf.from_tensors(tensors, arch="zimage")
    fused = lora["layers.3.attention.qkv"]
    assert fmt == "diffusers" and fused.A.shape == (10, HIDDEN) and fused.B.shape == (3 * HIDDEN, 10)
    expected = np.concatenate([delta(p) for p in parts])
    assert np.allclose(delta(fused), expected, atol=1e-6, rtol=1e-6)


def test_fusion_fills_missing_parts_with_zero_rows():
    tensors, parts = _foreign_qkv()
    tensors = {k: v for k, v in tensors.items() if ".to_k." not in k}
    fused = lf.from_tensors(tensors, arch="zimage")[0]["layers.3.attention.qkv"]
    got = delta(fused)
    assert np.allclose(got[:HIDDEN], delta(parts[0]), atol=1e-6)
    assert not got[HIDDEN : 2 * HIDDEN].any()
    assert np.allclose(got[2 * HIDDEN :], delta(parts[2]), atol=1e-6)


def test_split_sizes_and_rules_without_groups():
    """Unequal splits (split_sizes) and paths without a block index also map both ways."""
    base = get_arch("flux2_klein")
    arch = dataclasses.replace(
        base,
        diffusers_rules=base.diffusers_rules
        + (
            DiffusersRule(r"img_in", ("x_embedder",)),
            DiffusersRule(r"double_blocks\.(\d+)\.img_mod\.lin", ("m.{0}.a", "m.{0}.b"), split_sizes=(16, 48)),
        ),
    )
    lora = make_lora({"img_in": (HIDDEN, 128), "double_blocks.2.img_mod.lin": (64, HIDDEN)})
    tensors = lf.to_tensors(lora, "diffusers", arch)
    assert tensors["transformer.m.2.b.lora_B.weight"].shape == (48, RANK)
    assert_same_effect(lora, lf.from_tensors(tensors, arch=arch)[0])


def test_diffusers_export_needs_rules():
    with pytest.raises(ValueError, match="diffusers export needs an arch with diffusers names"):
        lf.to_tensors(make_lora(FLUX2_MODULES), "diffusers", "generic")
    with pytest.raises(ValueError, match=r"final_layer\.adaLN_modulation\.1: no plain diffusers name.*scale, shift"):
        lf.to_tensors(make_lora({"final_layer.adaLN_modulation.1": (HIDDEN, 128)}), "diffusers", "flux2_klein")
    with pytest.raises(ValueError, match="no diffusers name"):
        lf.to_tensors(make_lora({"not_a_module": (HIDDEN, 128)}), "diffusers", "flux2_klein")


def test_diffusers_export_names_modules_outside_the_block_rules():
    """Embedders, modulation and final layers go out under their diffusers names and come back (#47)."""
    modules = {"img_in": (HIDDEN, 128), "double_stream_modulation_img.lin": (6 * HIDDEN, HIDDEN)}
    tensors = lf.to_tensors(make_lora(modules), "diffusers", "flux2_klein")
    assert {k.rsplit(".lora_", 1)[0] for k in tensors} == {
        "transformer.x_embedder",
        "transformer.double_stream_modulation_img.linear",
    }
    assert sorted(lf.from_tensors(tensors, arch="flux2_klein")[0]) == sorted(modules)
    zimage = {"layers.0.adaLN_modulation.0": (4 * HIDDEN, HIDDEN), "x_embedder": (HIDDEN, 64)}
    tensors = lf.to_tensors(make_lora(zimage), "diffusers", "zimage")
    assert {k.rsplit(".lora_", 1)[0] for k in tensors} == {
        "transformer.layers.0.adaLN_modulation.0",
        "transformer.all_x_embedder.2-1",
    }


def test_diffusers_split_needs_divisible_rows():
    with pytest.raises(ValueError, match="not divisible into the 3"):
        lf.to_tensors(make_lora({"layers.0.attention.qkv": (100, HIDDEN)}), "diffusers", "zimage")


def test_kohya_names_are_placed_by_the_arch_or_the_module_names():
    """'_' for '.' is undone by the arch's module patterns (the arch detected from the names when the file
    does not say), or by the model's module names; a name among neither is an error that lists it."""
    lora = make_lora(FLUX2_MODULES)
    tensors = lf.to_tensors(lora, "kohya", "flux2_klein")
    assert_same(lf.from_tensors(tensors)[0], lora)
    with pytest.raises(ValueError, match="fit no module.*lora_unet_double_blocks_0_txt_attn_qkv"):
        lf.from_tensors(tensors, module_names=["double_blocks.0.img_attn.qkv"])
    unknown = lf.to_tensors({"head.out_proj": lora["double_blocks.0.img_attn.proj"]}, "kohya", None)
    with pytest.raises(ValueError, match="no LoRA keys.*lora_unet_head_out_proj"):
        lf.from_tensors(unknown)
    assert list(lf.from_tensors(unknown, module_names=["head.out_proj", "head.out"])[0]) == ["head.out_proj"]


def test_comfy_accepts_down_up_and_missing_alpha():
    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((RANK, 8), dtype=np.float32), rng.standard_normal((16, RANK), dtype=np.float32)
    lora, _ = lf.from_tensors(
        {"diffusion_model.img_in.lora_down.weight": A, "diffusion_model.img_in.lora_up.weight": B}
    )
    assert lora["img_in"].alpha == RANK and lora["img_in"].scale == 1.0  # ComfyUI: no alpha → scale 1


@pytest.mark.parametrize(
    "tensors,message",
    [
        ({}, "no LoRA keys"),
        ({"model.weight": np.ones((2, 2))}, "no LoRA keys"),
        (
            {"diffusion_model.x.lora_A.weight": np.ones((4, 8)), "diffusion_model.x.lora_B.weight": np.ones((8, 3))},
            "rank 4 but B has 3 columns",
        ),
        (
            {
                "diffusion_model.x.lora_A.weight": np.ones((4, 8, 1, 1)),
                "diffusion_model.x.lora_B.weight": np.ones((8, 4)),
            },
            "2-D",
        ),
        ({"diffusion_model.x.lora_A.weight": np.ones((4, 8))}, "no lora_B/lora_up"),
        (
            {
                "diffusion_model.x.lora_A.weight": np.ones((4, 8)),
                "diffusion_model.x.lora_B.weight": np.ones((8, 4)),
                "diffusion_model.x.dora_scale": np.ones(8),
            },
            "dora_scale",
        ),
        (
            {
                "diffusion_model.double_blocks.0.img_attn.proj.lora_A.weight": np.ones((4, 8)),
                "diffusion_model.double_blocks.0.img_attn.proj.lora_B.weight": np.ones((8, 4)),
                "lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": np.ones((4, 8)),
                "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": np.ones((8, 4)),
            },
            "two modules.*name",
        ),
    ],
)
def test_bad_tensors(tensors, message):
    with pytest.raises(ValueError, match=message) as error:
        lf.from_tensors(tensors, source="bad.safetensors")
    assert "bad.safetensors" in str(error.value)


# ---------------------------------------------------------------- files


def _bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).float().numpy()


@pytest.mark.parametrize("fmt", list(lf.FORMATS))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_save_load(tmp_path, fmt, dtype):
    lora = make_lora(FLUX2_MODULES)
    path = tmp_path / "lora.safetensors"
    lf.save_lora(path, lora, arch="flux2_klein", fmt=fmt, dtype=dtype, metadata=lora_metadata())
    back, metadata = lf.load_lora(path)  # arch and kohya module names come from the metadata
    round_ = _bf16 if dtype == "bf16" else (lambda x: x)
    assert sorted(back) == sorted(lora)
    for path_, w in lora.items():
        if fmt in FOLDS:  # B·scale stored, rounded once to the file's dtype
            assert np.array_equal(back[path_].A, round_(w.A)) and back[path_].alpha == w.rank
            assert np.array_equal(back[path_].B, round_(w.B * np.float32(w.scale)))
            continue
        assert np.array_equal(back[path_].A, round_(w.A)) and np.array_equal(back[path_].B, round_(w.B))
        assert back[path_].alpha == w.alpha
    header, _ = safetensors_io.read_header(path)
    assert all(e["dtype"] == "F32" and e["shape"] == [] for k, e in header.items() if k.endswith(".alpha"))
    assert {e["dtype"] for k, e in header.items() if not k.endswith(".alpha")} == {dtype.upper().replace("FP", "F")}
    assert metadata["kiln.format"] == fmt and os.listdir(tmp_path) == ["lora.safetensors"]


def test_metadata_contents():
    metadata = lora_metadata()
    assert all(isinstance(v, str) for v in metadata.values())
    assert metadata["kiln.arch"] == "flux2_klein" and metadata["kiln.steps"] == "500"
    assert json.loads(metadata["kiln.config"]) == {"rank": RANK, "lr": 1e-4}
    assert json.loads(metadata["kiln.trigger_words"]) == ["ohwx person", "kiln"]
    assert metadata["modelspec.sai_model_spec"] == "1.0.0"
    assert metadata["modelspec.architecture"].endswith("/lora")
    assert metadata["modelspec.title"] == "My LoRA" and metadata["modelspec.description"] == "test run"
    assert metadata["modelspec.trigger_phrase"] == "ohwx person, kiln"
    assert metadata["modelspec.date"][:4].isdigit() and "T" in metadata["modelspec.date"]
    assert metadata["kiln.version"]
    with pytest.raises(TypeError, match="'seed'"):
        lf.build_metadata(arch_name="zimage", config={}, steps=1, trigger_words=[], title="t", extra={"seed": 1})


def test_describe(tmp_path):
    path = tmp_path / "lora.safetensors"
    lf.save_lora(path, make_lora(ZIMAGE_MODULES), arch="zimage", fmt="diffusers", metadata=lora_metadata())
    info = lora_report.describe(path)
    assert info["format"] == "diffusers" and info["modules"] == 6  # qkv split into 3
    assert info["ranks"] == [RANK] and info["alphas"] == [float(RANK)]  # scales 2..2.75 folded into B
    assert info["dtypes"] == ["BF16"] and info["metadata"]["kiln.arch"] == "zimage"  # no F32 alpha scalars


def test_describe_lists_each_module_with_dotted_paths(tmp_path):
    path = tmp_path / "lora.safetensors"
    lf.save_lora(path, make_lora(ZIMAGE_MODULES), arch="zimage", fmt="kohya", metadata=lora_metadata())
    info = lora_report.describe(path)
    rows = {row["name"]: row for row in info["module_table"]}
    assert sorted(rows) == sorted(ZIMAGE_MODULES)  # kohya's '_' names back as module paths (kiln.module_paths)
    assert {row["dtype"] for row in rows.values()} == {"BF16"} and {row["rank"] for row in rows.values()} == {RANK}
    assert (
        info["parameters"]
        == sum(row["parameters"] for row in rows.values())
        == sum(RANK * (i + o) for i, o in ZIMAGE_MODULES.values())
    )


def test_export_between_formats(tmp_path):
    lora = make_lora(ZIMAGE_MODULES)
    src, mid, dst = (tmp_path / f"{n}.safetensors" for n in ("src", "kohya", "diffusers"))
    metadata = lf.build_metadata(arch_name="zimage", config={}, steps=1, trigger_words=[], title="t")
    lf.save_lora(src, lora, arch="zimage", dtype="fp32", metadata=metadata)
    lf.export(src, mid, "kohya")
    lf.export(mid, dst, "diffusers")  # arch from "kiln.arch", module names from "kiln.module_paths"
    back, metadata = lf.load_lora(dst)
    assert_same_effect(lora, back)
    assert_same(lora, lf.load_lora(mid)[0])
    assert metadata["kiln.format"] == "diffusers" and "kiln.module_paths" not in metadata
