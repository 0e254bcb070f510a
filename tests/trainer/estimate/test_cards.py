"""trainer/estimate/cards.py: the named cards, the predicted step time, and `estimate --memory-gb`'s plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.estimate.cards import CARDS, card_plan, near, predict, predict_plan, rate, step_flops
from trainer.estimate.common import get_dims
from trainer.estimate.torch_step import estimate

ROOT = Path(__file__).resolve().parents[3]


def test_the_cards_facts_are_sane():
    for card in CARDS.values():
        assert 8 <= card.memory_gib <= 141 and card.bf16 > 0 and card.int8 >= 2 * card.bf16, card
        assert card.bandwidth > 0 and 10 <= card.host_gbps <= 60, card
        ampere = card.name.startswith("RTX 30")
        assert (card.fp8 == 0) if ampere else (card.fp8 == pytest.approx(2 * card.bf16, rel=0.01)), card
    assert CARDS["RTX 4060 Ti 16GB"].host_gbps == 12.5  # PCIe 4.0 x8
    assert {c.name for c in near(16)} >= {"RTX 4060 Ti 16GB", "RTX 4080", "RTX 5080"}
    assert not {c.name for c in near(16)} & {"RTX 3090", "RTX 4090", "RTX 3060 12GB"}


def test_the_rate_follows_the_base_and_what_the_card_has():
    ampere, ada = CARDS["RTX 3090"], CARDS["RTX 4090"]
    assert rate(ada, "bf16", False) == ada.bf16 and rate(ada, "fp8", False) == ada.fp8
    assert rate(ada, "bf16", True) == ada.fp8 and rate(ada, "int8", False) == ada.int8
    assert rate(ampere, "fp8", True) == ampere.bf16  # no fp8 on Ampere: the base computes in bf16


def _h200_rows():
    rows = json.loads((ROOT / "bench/results.json").read_text())
    return [
        r
        for r in rows
        if "H200" in r.get("device", "")
        and r.get("commit", "").startswith("b73b35f")
        and r.get("resolution") == 1024
        and r.get("kiln_settings") == {}
    ]


def test_the_h200_reproduces_its_calibration_rows():
    rows = _h200_rows()
    assert {r["variant"] for r in rows} == {"zimage", "flux2-klein-4b"}
    for row in rows:
        flops = step_flops(get_dims(row["variant"]), 1024, recompute=0.0, text=row["text_tokens"])  # budget auto → 1
        assert flops == pytest.approx(row["model_tflop_per_step"] * 1e12, rel=0.03)  # the bench's own count
        predicted = predict(CARDS["H200 (reference)"], flops, 0).seconds
        assert predicted == pytest.approx(row["kiln_s_per_step"], rel=0.10), row["variant"]


def test_streaming_every_z_image_block_over_a_pcie_x8_link_is_copy_bound():
    """At 512 px with nothing recomputed (checkpoint_budget 1, which fits 16 GiB with every block streamed) the
    4060 Ti's 22.9 GB of copies a step over PCIe 4.0 x8 outlast its compute; at 1024 px its compute is slower."""
    card = CARDS["RTX 4060 Ti 16GB"]
    settings = estimate("zimage", resolution=512, stream_blocks=34).settings
    plan = card_plan(settings, card.memory_gib, budget=1.0)
    assert plan.streamed == 34 and plan.host_bytes > 11 * 2**30 and plan.total <= 16 * 2**30
    predicted = predict_plan(card, settings, plan)
    assert predicted.bound == "copy" and predicted.seconds >= 2 * plan.host_bytes / 12.5e9
    wide = estimate("zimage", resolution=1024, stream_blocks=34).settings
    assert predict_plan(card, wide, card_plan(wide, card.memory_gib, budget=0.0)).bound == "compute"
    # the whole base resident at 1024 px on a 4090: nothing to copy, compute-bound
    settings = estimate("zimage", resolution=1024).settings
    plan = card_plan(settings, 24)
    assert plan.streamed == 0 and predict_plan(CARDS["RTX 4090"], settings, plan).bound == "compute"


def test_a_card_too_small_streams_the_fewest_blocks_that_fit():
    """As a run's stream_blocks auto decides (runs_in: the step x AUTO_SAFETY and a margin beside the weights)."""
    from trainer.estimate.torch_step import runs_in

    settings = estimate("zimage", resolution=1024).settings
    plan = card_plan(settings, 12)
    assert 0 < plan.streamed < plan.blocks == 34 and plan.total <= 12 * 2**30
    planned = estimate(**{**settings, "stream_blocks": plan.streamed, "checkpoint_budget": 0.0})
    fewer = estimate(**{**settings, "stream_blocks": plan.streamed - 1, "checkpoint_budget": 0.0})
    assert runs_in(planned, 12 * 2**30) and not runs_in(fewer, 12 * 2**30)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "trainer", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_the_cli_prints_the_plan_and_the_labelled_table(tmp_path):
    config = tmp_path / "zimage.toml"
    config.write_text('arch = "zimage_turbo"\nresolutions = [512, 1024]\n')
    plain, sixteen, every = (
        _cli("estimate", config, *a) for a in ((), ("--memory-gb", 16), ("--memory-gb", 16, "--cards", "all"))
    )
    assert plain.returncode == sixteen.returncode == every.returncode == 0, sixteen.stderr
    assert "predicted" not in plain.stdout and "the plan on" not in plain.stdout
    out = sixteen.stdout
    assert "the plan on a 16 GiB card as a run's auto makes it" in out
    assert "predicted (not measured) step time on cards with about 16 GiB" in out
    table = out[out.index("predicted (not measured)") :].splitlines()[2:]
    assert {line[2:21].strip() for line in table} == {c.name for c in CARDS.values() if c.memory_gib == 16}
    assert all("predicted" in line for line in table) and not any("RTX 4090" in line for line in table)
    assert all(line.rstrip().endswith(("compute", "copy")) for line in table)
    assert "RTX 4090" in every.stdout and "RTX 3060 12GB" in every.stdout


def test_a_clips_step_counts_its_frames():
    """Wan 2.1 1.3B at 480 px: 81 frames are 21 latent frames, so the Linears' FLOPs grow about 21-fold (the
    caption's 512 tokens stay), and attention, quadratic in the tokens, faster still."""
    dims = get_dims("wan2.1-t2v-1.3b")
    image, clip = step_flops(dims, 480), step_flops(dims, 480, frames=81)
    assert 21 * image < clip < 21 * 21 * image
    settings = estimate("wan2.1-t2v-1.3b", resolution=480, frames=81).settings
    card = CARDS["RTX 4090"]
    plan = card_plan(settings, 24)
    assert plan.streamed is not None  # the 1.3B fits a 24 GiB card
    assert predict_plan(card, settings, plan).seconds > predict_plan(card, {**settings, "frames": 1}, plan).seconds


def test_the_cli_shows_base_quantize_autos_int8_plan_where_bf16_cannot_fit(tmp_path):
    """base_quantize auto (the default) stores the base in int8 where the run does not fit in bf16 even with every
    block streamed (memory_plan.storage); the estimate shows that plan after the bf16 one, and only then."""
    small, chosen = tmp_path / "auto.toml", tmp_path / "none.toml"
    small.write_text('arch = "qwen_image"\nresolutions = [1024]\n')
    chosen.write_text('arch = "qwen_image"\nresolutions = [1024]\nbase_quantize = "none"\n')
    auto, none, roomy = (
        _cli("estimate", small, "--memory-gb", 4),
        _cli("estimate", chosen, "--memory-gb", 4),
        _cli("estimate", small, "--memory-gb", 80),
    )
    assert auto.returncode == none.returncode == roomy.returncode == 0, auto.stderr
    assert "base_quantize auto → int8 (in bf16 the run does not fit 4 GiB even streamed)" in auto.stdout
    assert auto.stdout.count("the plan on a 4 GiB card") == 2
    assert "base_quantize auto" not in none.stdout and "base_quantize auto" not in roomy.stdout


def test_the_cli_shows_the_plan_with_the_block_inputs_on_the_host_where_nothing_else_fits(tmp_path):
    """Wan 14B at 640 px x 81 frames on 24 GiB: 43 GiB even with every block streamed, under 24 with the kept
    inputs on the host (offload_activations auto, as the memory plan decides); off, the plan says it does not fit.
    Where the exact plan fits, the int8 alternative beside it (Flux2 Dev on 16 GiB) is shown too."""
    wan, off, dev = tmp_path / "wan.toml", tmp_path / "off.toml", tmp_path / "dev.toml"
    wan.write_text('arch = "wan21_t2v"\nresolutions = [640]\n')
    off.write_text('arch = "wan21_t2v"\nresolutions = [640]\noffload_activations = false\nbase_quantize = "none"\n')
    dev.write_text('arch = "flux2_dev"\nresolutions = [512]\nrank = 64\noptimizer = "adamw8bit"\n')
    common = ("--variant", "wan2.1-t2v-14b", "--frames", 81, "--memory-gb", 24)
    auto, none, both = (
        _cli("estimate", wan, *common),
        _cli("estimate", off, *common),
        _cli("estimate", dev, "--memory-gb", 16),
    )
    assert auto.returncode == none.returncode == both.returncode == 0, auto.stderr
    assert "offload_activations auto → on" in auto.stdout and auto.stdout.count("the plan on a 24 GiB card") == 2
    assert "offload_activations" not in none.stdout and "does not fit even with every block streamed" in none.stdout
    assert "offload_activations auto → on" in both.stdout and "or with the base rounded to int8 instead" in both.stdout
