"""trainer/estimate/mlx_step.py: the MLX memory model for Macs (quantized bases, unfused attention, working sets)."""

import pytest

from trainer.estimate.common import GIB, format_estimate
from trainer.estimate.mlx_step import (
    ATTENTION_KEPT,
    estimate_mlx,
    mlx_budget_gib,
    working_set_gib,
)
from trainer.estimate.torch_step import estimate


def test_quantized_bases_shrink_the_weights():
    sizes = {
        base: estimate_mlx("flux2-klein-9b", resolution=512, base_dtype=base).weights
        for base in ("fp32", "bf16", "int8", "int4")
    }
    assert sizes["fp32"] == 2 * sizes["bf16"]
    # block Linears are ~97 % of Klein 9B: int8 a little over half of bf16, int4 a little over a quarter
    assert 0.5 < sizes["int8"] / sizes["bf16"] < 0.56
    assert 0.28 < sizes["int4"] / sizes["bf16"] < 0.34


def test_unfused_attention_makes_activations_quadratic_without_checkpointing():
    """Each block keeps heads x L^2 softmax probabilities: 4x the tokens is ~16x the attention bytes."""
    small, large = (estimate_mlx("zimage", resolution=r, gradient_checkpointing=False).activations for r in (512, 1024))
    tokens = (1024 + 512, 4096 + 512)
    assert large / small > (tokens[1] / tokens[0]) ** 1.5
    per_block = ATTENTION_KEPT * 30 * tokens[1] ** 2
    assert estimate_mlx("zimage", resolution=1024, gradient_checkpointing=False).activations > 30 * per_block
    on = estimate_mlx("zimage", resolution=1024, gradient_checkpointing=True).activations
    assert on < 0.2 * large and on > per_block


def test_mlx_differs_from_cuda_where_it_should():
    cuda = estimate("flux2-klein-4b", resolution=1024)
    mlx = estimate_mlx("flux2-klein-4b", resolution=1024)
    assert mlx.weights == cuda.weights and mlx.lora == cuda.lora and mlx.optimizer == cuda.optimizer
    assert mlx.activations > cuda.activations  # unfused attention vs flash attention
    assert mlx.workspace < cuda.workspace  # no CUDA context


@pytest.mark.parametrize("setting,match", [({"base_dtype": "fp8"}, "decoded"), ({"optimizer": "lion"}, "one of")])
def test_torch_only_settings_are_refused(setting, match):
    with pytest.raises(ValueError, match=match):
        estimate_mlx("zimage", resolution=512, **setting)


def test_adamw8bit_on_mlx_counts_the_fp32_adamw_that_runs():
    adamw, adam8 = (estimate_mlx("zimage", resolution=512, optimizer=o) for o in ("adamw", "adamw8bit"))
    assert adam8.optimizer == adamw.optimizer == 8 * adamw.lora_params
    assert any("trains as fp32 adamw on MLX" in note for note in adam8.notes)


def test_mac_working_sets():
    assert working_set_gib(32) == pytest.approx(21.33, abs=0.01)  # 2/3 below 48 GB
    assert working_set_gib(64) == 48 and working_set_gib(128) == 96
    assert mlx_budget_gib(64) == pytest.approx(0.95 * 48)


def test_format_says_which_mac_and_what_to_change():
    est = estimate_mlx("zimage", resolution=1024)
    text = format_estimate(est, device_memory_gb=32)
    assert "does not fit in a 32 GB Mac" in text and "backend mlx" in text
    assert "base_quantize int8" in text and text.rstrip().endswith("(fits)")
    assert "fits in a 128 GB Mac" in format_estimate(est, device_memory_gb=128)
    assert est.total / GIB > mlx_budget_gib(32)


def test_a_family_without_an_mlx_port_is_refused():
    with pytest.raises(ValueError, match="qwen-image has no MLX port .*backend torch"):
        estimate_mlx("qwen-image", resolution=1024)


def test_edit_training_counts_the_reference_images_tokens():
    """As estimate.py: each reference adds the target's tokens to every block's sequence (and its attention
    matrices); the final layer runs on the target's tokens only."""
    plain, edit = (estimate_mlx("flux2-klein-4b", resolution=512, reference_images=n) for n in (0, 2))
    assert edit.tokens - plain.tokens == 2 * 32 * 32
    assert edit.activations > 2 * plain.activations and edit.weights == plain.weights
    assert edit.workspace > plain.workspace
    assert "(2 reference images included)" in edit.notes[0]
