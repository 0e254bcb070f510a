"""LoRA tools (trainer/lora/tools.py, lora_extract.py, `python -m trainer merge|resize|extract`) against a
dense reference: the weighted sum of scale·B@A, its truncated SVD (numpy, float64), the true difference
of two models. Small random matrices; nothing downloaded."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from trainer.cli import main as cli
from trainer.lora.extract import ModelFile, extract
from trainer.lora.files import LoraWeights, load_lora, save_lora
from trainer.lora.tools import RankRule, dense_delta, merge, resize


def lora_weights(rng, out_features, in_features, rank, alpha) -> LoraWeights:
    return LoraWeights(
        rng.standard_normal((rank, in_features)).astype(np.float32),
        rng.standard_normal((out_features, rank)).astype(np.float32),
        alpha,
    )


def relative(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def truncated(matrix: np.ndarray, rank: int) -> tuple[np.ndarray, float]:
    """Best rank-`rank` approximation (Eckart–Young) and the energy fraction it keeps."""
    U, s, Vt = np.linalg.svd(matrix, full_matrices=False)
    return (U[:, :rank] * s[:rank]) @ Vt[:rank], float(np.sum(s[:rank] ** 2) / np.sum(s**2))


@pytest.fixture
def two_loras():
    rng = np.random.default_rng(0)
    first = {"blocks.0.qkv": lora_weights(rng, 48, 32, 4, 2.0), "blocks.0.proj": lora_weights(rng, 32, 32, 2, 1.0)}
    second = {"blocks.0.qkv": lora_weights(rng, 48, 32, 8, 16.0), "blocks.1.mlp": lora_weights(rng, 64, 32, 8, 8.0)}
    return first, second


def reference(loras, weights, name) -> np.ndarray:
    return sum(w * dense_delta(lora, name) for lora, w in zip(loras, weights) if name in lora)


# ---------------------------------------------------------------- merge


def test_exact_merge_is_the_weighted_sum_to_1e6(two_loras):
    weights = [0.7, -1.3]
    merged, report = merge(two_loras, weights)
    assert set(merged) == {"blocks.0.qkv", "blocks.0.proj", "blocks.1.mlp"}
    for name, w in merged.items():
        assert relative(dense_delta(merged, name), reference(two_loras, weights, name)) < 1e-6, name
        assert w.alpha == w.rank  # scales folded into B: scale 1
    assert merged["blocks.0.qkv"].rank == 12 and report.kept == 1.0
    assert any("only some inputs" in note and "blocks.1.mlp" in note for note in report.notes)


def test_merge_to_a_rank_is_the_truncated_svd_of_the_dense_sum(two_loras):
    weights = [1.0, 0.5]
    merged, report = merge(two_loras, weights, RankRule(3))
    dense = reference(two_loras, weights, "blocks.0.qkv")
    best, kept = truncated(dense, 3)
    assert merged["blocks.0.qkv"].rank == 3
    assert relative(dense_delta(merged, "blocks.0.qkv"), best) < 1e-5
    module = next(m for m in report.modules if m.name == "blocks.0.qkv")
    assert module.kept == pytest.approx(kept, abs=1e-9) and module.rank_in == 12
    assert merged["blocks.0.proj"].rank == 2 and any("fewer than 3" in note for note in report.notes)


def test_merge_refuses_loras_of_different_models_and_all_zero_weights(two_loras):
    rng = np.random.default_rng(1)
    other = {"blocks.0.qkv": lora_weights(rng, 40, 32, 4, 4.0)}
    with pytest.raises(ValueError, match=r"blocks\.0\.qkv.*different|one model"):
        merge([two_loras[0], other], [1, 1], sources=["a.safetensors", "b.safetensors"])
    with pytest.raises(ValueError, match="non-zero weight"):
        merge(two_loras, [0, 0])
    merged, report = merge(two_loras, [1, 0], sources=["a", "b"])
    assert set(merged) == set(two_loras[0]) and any("left out: b" in note for note in report.notes)


# ---------------------------------------------------------------- resize


def test_resize_to_full_rank_is_exact_and_to_a_lower_rank_is_eckart_young(two_loras):
    lora = two_loras[1]
    full, report = resize(lora, RankRule(64))
    for name in lora:
        assert relative(dense_delta(full, name), dense_delta(lora, name)) < 1e-6
        assert full[name].rank == lora[name].rank and full[name].alpha == full[name].rank
    assert report.kept == pytest.approx(1.0, abs=1e-12)
    small, report = resize(lora, RankRule(3))
    for name in lora:
        best, kept = truncated(dense_delta(lora, name), 3)
        assert relative(dense_delta(small, name), best) < 1e-5
        assert next(m for m in report.modules if m.name == name).kept == pytest.approx(kept, abs=1e-9)


SINGULAR = np.array([10.0, 5.0, 2.0, 1.0, 0.5, 0.1])


def constructed(singular=SINGULAR, out_features=40, in_features=30) -> dict[str, LoraWeights]:
    """A LoRA whose delta has exactly these singular values (orthonormal U, V; alpha 2·rank: scale 2)."""
    rng = np.random.default_rng(3)
    U = np.linalg.qr(rng.standard_normal((out_features, len(singular))))[0]
    V = np.linalg.qr(rng.standard_normal((in_features, len(singular))))[0]
    rank = len(singular)
    return {"m": LoraWeights(V.T.astype(np.float32), (U * singular / 2).astype(np.float32), 2.0 * rank)}


# Closed forms on σ = 10, 5, 2, 1, 0.5, 0.1 (Σσ² = 130.26, Σσ = 18.6):
#   sv_ratio t keeps σ > 10/t;  sv_fro t keeps the fewest with Σσ² ≥ t²·130.26;  sv_cumulative t: Σσ ≥ t·18.6
@pytest.mark.parametrize(
    "method, value, cap, expected",
    [
        ("sv_ratio", 4.0, None, 2),  # σ > 2.5: 10, 5
        ("sv_ratio", 6.0, None, 3),  # σ > 1.67: 10, 5, 2
        ("sv_ratio", 1000.0, None, 6),
        ("sv_fro", 0.9, None, 2),  # 125/130.26 = 0.960 ≥ 0.81 (100/130.26 = 0.768 is not)
        ("sv_fro", 0.99, None, 3),  # 129/130.26 = 0.990 ≥ 0.9801
        ("sv_cumulative", 0.8, None, 2),  # 15/18.6 = 0.806
        ("sv_cumulative", 0.9, None, 3),  # 17/18.6 = 0.914
        ("sv_cumulative", 0.99, 2, 2),  # 18.5/18.6 needs 5; the cap says 2
    ],
)
def test_dynamic_rank_picks_what_the_criterion_says(method, value, cap, expected):
    lora = constructed()
    resized, report = resize(lora, RankRule(cap, method, value))
    assert resized["m"].rank == expected
    assert report.modules[0].kept == pytest.approx(np.sum(SINGULAR[:expected] ** 2) / np.sum(SINGULAR**2), abs=1e-9)
    kept_singular = np.linalg.svd(dense_delta(resized, "m"), compute_uv=False)[:expected]
    np.testing.assert_allclose(kept_singular, SINGULAR[:expected], rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "give a rank"),
        ({"rank": 0}, "rank must"),
        ({"method": "sv_fro", "value": 1.5}, "out of range"),
        ({"method": "sv_ratio", "value": 0.5}, "out of range"),
        ({"method": "svd_knee", "value": 1}, "unknown rank method"),
    ],
)
def test_rank_rules_refuse_what_they_cannot_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RankRule(**kwargs)


# ---------------------------------------------------------------- extract


def models(seed=0, rank=3):
    """(base, tuned, true deltas): two Linear weights changed by known rank-`rank` deltas, one unchanged (and
    requiring grad, as a model's parameters may), a norm scale changed, a key only in tuned."""
    generator = torch.Generator().manual_seed(seed)
    base = {
        "a.weight": torch.randn(48, 32, generator=generator),
        "b.weight": torch.randn(32, 64, generator=generator),
        "c.weight": torch.randn(16, 16, generator=generator).requires_grad_(),
        "norm.scale": torch.ones(32),
        "a.bias": torch.zeros(48),
    }
    deltas = {
        name: torch.randn(base[f"{name}.weight"].shape[0], rank, generator=generator)
        @ torch.randn(rank, base[f"{name}.weight"].shape[1], generator=generator)
        * 0.05
        for name in "ab"
    }
    tuned = {k: v.clone() for k, v in base.items()}
    for name, delta in deltas.items():
        tuned[f"{name}.weight"] += delta
    tuned["norm.scale"] *= 1.02
    tuned["extra.weight"] = torch.ones(4, 4)
    return base, tuned, {k: v.numpy().astype(np.float64) for k, v in deltas.items()}


@pytest.mark.parametrize("svd", ["full", "lowrank"])
def test_extract_recovers_a_known_low_rank_difference(svd):
    base, tuned, deltas = models()
    lora, report = extract(base, tuned, RankRule(3), svd=svd)
    assert set(lora) == {"a", "b"}
    for name, delta in deltas.items():
        assert relative(dense_delta(lora, name), delta) < 1e-5 and lora[name].alpha == lora[name].rank == 3
    assert report.kept == pytest.approx(1.0, abs=1e-9)
    notes = " | ".join(report.notes)
    assert "1 weight matrices are equal" in notes
    assert "1 other tensors differ" in notes and "norm.scale (2%)" in notes  # reported, not dropped unsaid
    assert "only in tuned" in notes and "extra.weight" in notes


def test_extract_truncates_like_eckart_young_and_reports_a_clamp_honestly():
    base, tuned, deltas = models(rank=6)
    lora, report = extract(base, tuned, RankRule(2))
    best, kept = truncated(deltas["a"], 2)
    assert relative(dense_delta(lora, "a"), best) < 1e-4
    assert next(m for m in report.modules if m.name == "a").kept == pytest.approx(kept, abs=1e-5)
    clamped, report = extract(base, tuned, RankRule(2), clamp_quantile=0.5)
    for module in report.modules:
        actual = 1 - np.sum((deltas[module.name] - dense_delta(clamped, module.name)) ** 2) / np.sum(
            deltas[module.name] ** 2
        )
        assert module.kept == pytest.approx(actual, abs=1e-5) and module.kept < kept


def test_extract_checks_its_inputs():
    base, tuned, _ = models()
    with pytest.raises(ValueError, match="not the same architecture"):
        extract(base, {**tuned, "c.weight": torch.zeros(16, 8)}, RankRule(2))
    with pytest.raises(ValueError, match="no differing weight matrix"):
        extract(base, base, RankRule(2))
    with pytest.raises(ValueError, match="needs a rank"):
        extract(base, tuned, RankRule(None, "sv_fro", 0.9))
    with pytest.raises(ValueError, match="above min_diff 1"):  # both changed by about 9% of their norm
        extract(base, tuned, RankRule(2), min_diff=1.0)
    assert set(extract(base, tuned, RankRule(2), min_diff=0.01)[0]) == {"a", "b"}


def test_model_files_read_lazily_with_prefixes_and_scaled_float8(tmp_path):
    import safetensors.torch

    weight = torch.randn(8, 4)
    scale = weight.abs().max() / 448
    safetensors.torch.save_file(
        {
            "model.diffusion_model.x.weight": (weight / scale).to(torch.float8_e4m3fn),
            "model.diffusion_model.x.weight_scale": scale.reshape(()),
            "first_stage_model.y.weight": torch.ones(2),
        },
        tmp_path / "ckpt.safetensors",
    )
    model = ModelFile(tmp_path / "ckpt.safetensors")
    assert list(model) == ["x.weight"]
    torch.testing.assert_close(model["x.weight"], weight, rtol=0.07, atol=scale.item())


# ---------------------------------------------------------------- the command line


def test_cli_merge_resize_extract_write_files_that_match_the_reference(tmp_path, two_loras, capsys):
    save_lora(
        tmp_path / "a.safetensors",
        two_loras[0],
        arch=None,
        dtype="fp32",
        metadata={"kiln.trigger_words": json.dumps(["ohwx"])},
    )
    save_lora(tmp_path / "b.safetensors", two_loras[1], arch=None, dtype="fp32", metadata={})
    merged_path = tmp_path / "merged.safetensors"
    assert (
        cli.main(
            [
                "merge",
                str(merged_path),
                f"{tmp_path / 'a.safetensors'}:0.5",
                str(tmp_path / "b.safetensors"),
                "--dtype",
                "fp32",
            ]
        )
        == 0
    )
    assert "energy kept 100.00%" in capsys.readouterr().out
    merged, metadata = load_lora(merged_path)
    for name in merged:
        assert relative(dense_delta(merged, name), reference(two_loras, [0.5, 1.0], name)) < 1e-6
    assert json.loads(metadata["kiln.trigger_words"]) == ["ohwx"]
    assert json.loads(metadata["kiln.lora_tool"])["inputs"][0] == {"file": "a.safetensors", "weight": 0.5}
    assert cli.main(["merge", str(merged_path), str(tmp_path / "a.safetensors")]) == 2  # exists: refused
    assert "--overwrite" in capsys.readouterr().err

    assert (
        cli.main(
            [
                "resize",
                str(merged_path),
                str(tmp_path / "small.safetensors"),
                "--sv-fro",
                "0.9",
                "--rank",
                "4",
                "--json",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    report = json.loads(printed[: printed.rindex("}") + 1])
    assert all(m["rank"] <= 4 for m in report["modules"]) and 0 < report["kept"] < 1

    import safetensors.torch

    base, tuned, deltas = models()
    for name, state in (("base", base), ("tuned", tuned)):
        safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / f"{name}.safetensors")
    out = tmp_path / "extracted.safetensors"
    assert (
        cli.main(
            [
                "extract",
                str(tmp_path / "base.safetensors"),
                str(tmp_path / "tuned.safetensors"),
                str(out),
                "--rank",
                "3",
                "--dtype",
                "fp32",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert "norm.scale" in capsys.readouterr().out
    extracted, _ = load_lora(out)
    for name, delta in deltas.items():
        assert relative(dense_delta(extracted, name), delta) < 1e-5


def test_cli_input_weights_parse_and_keep_drive_letters():
    from trainer.cli.lora_commands import _input

    assert _input("style.safetensors:0.7") == ("style.safetensors", 0.7)
    assert _input("x.safetensors:-1") == ("x.safetensors", -1.0)
    assert _input(r"C:\loras\x.safetensors") == (r"C:\loras\x.safetensors", 1.0)
