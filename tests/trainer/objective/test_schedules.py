"""trainer/objective/schedules.py: each schedule at warmup start/end, midpoint and last step; errors."""

import math

import pytest

from trainer.objective.schedules import SCHEDULES, lr_at

BASE = 1e-4


def lr(step, schedule, total=101, warmup=0, min_ratio=0.0):
    return lr_at(step, base_lr=BASE, schedule=schedule, total_steps=total, warmup_steps=warmup, min_lr_ratio=min_ratio)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine_with_warmup"])
def test_warmup_is_linear_and_ends_at_base(schedule):
    assert lr(0, schedule, warmup=10) == pytest.approx(BASE / 10)
    assert lr(4, schedule, warmup=10) == pytest.approx(BASE * 5 / 10)
    assert lr(9, schedule, warmup=10) == pytest.approx(BASE)
    assert lr(10, schedule, warmup=10) == pytest.approx(BASE)  # first post-warmup step, p = 0


def test_constant_ignores_min_ratio():
    assert [lr(s, "constant", min_ratio=0.3) for s in (0, 50, 100)] == [BASE] * 3


def test_linear_midpoint_and_exact_end():
    assert lr(0, "linear", min_ratio=0.1) == BASE
    assert lr(50, "linear", min_ratio=0.1) == pytest.approx(BASE * 0.55)
    assert lr(100, "linear", min_ratio=0.1) == 0.1 * BASE  # exactly the minimum
    assert lr(100, "linear") == 0.0


def test_linear_after_warmup_spans_remaining_steps():
    # warmup 11 of 112: p = (step - 11) / 100, so step 61 is halfway down.
    assert lr(61, "linear", total=112, warmup=11) == pytest.approx(BASE * 0.5)
    assert lr(111, "linear", total=112, warmup=11, min_ratio=0.2) == 0.2 * BASE


def test_cosine_midpoint_and_exact_end():
    assert lr(0, "cosine") == BASE
    assert lr(50, "cosine", min_ratio=0.2) == pytest.approx(BASE * (0.2 + 0.8 * 0.5))
    assert lr(25, "cosine") == pytest.approx(BASE * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr(100, "cosine", min_ratio=0.2) == 0.2 * BASE


def test_cosine_with_warmup_formula():
    total, warmup = 111, 11
    for step in (11, 30, 60, 110):
        p = (step - warmup) / (total - 1 - warmup)
        expected = BASE * 0.1 + (BASE - BASE * 0.1) * 0.5 * (1 + math.cos(math.pi * p))
        assert lr(step, "cosine_with_warmup", total, warmup, 0.1) == pytest.approx(expected, rel=1e-12)


def test_single_step_run_uses_base_lr():
    assert all(lr(0, s, total=1) == BASE for s in ("constant", "linear", "cosine"))


def test_registry_lists_all_schedules():
    assert list(SCHEDULES) == ["constant", "linear", "cosine", "cosine_with_warmup"]


def test_cosine_with_warmup_steps_points_to_cosine_with_warmup():
    with pytest.raises(ValueError, match="cosine_with_warmup"):
        lr(0, "cosine", warmup=5)


def test_cosine_with_warmup_needs_warmup():
    with pytest.raises(ValueError, match="warmup_steps"):
        lr(0, "cosine_with_warmup", warmup=0)


def test_unknown_schedule_lists_choices():
    with pytest.raises(ValueError) as err:
        lr(0, "exponential")
    assert "'exponential'" in str(err.value)
    assert all(name in str(err.value) for name in SCHEDULES)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(step=-1), "step"),
        (dict(step=101), "step"),
        (dict(total=0), "total_steps"),
        (dict(warmup=101), "warmup_steps"),
        (dict(min_ratio=1.5), "min_lr_ratio"),
    ],
)
def test_out_of_range_arguments(kwargs, name):
    args = dict(step=0, schedule="linear") | kwargs
    with pytest.raises(ValueError, match=name):
        lr(**args)


def test_bad_base_lr():
    with pytest.raises(ValueError, match="base_lr"):
        lr_at(0, base_lr=0.0, schedule="constant", total_steps=10)
