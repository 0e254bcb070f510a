"""Fuzzing config parsing: any input gives a TrainConfig or a ConfigError with a message, nothing else."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.config import FIELDS, ConfigError, from_dict

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**12), 10**12), st.floats(allow_nan=True), st.text(max_size=12)
)
values = st.one_of(scalars, st.lists(scalars, max_size=4), st.dictionaries(st.text(max_size=5), scalars, max_size=2))
keys = st.one_of(st.sampled_from(sorted(FIELDS) + ["preset"] * 5), st.text(max_size=15))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(keys, values, max_size=6))
def test_from_dict_never_crashes(raw):
    try:
        cfg = from_dict(raw)
    except ConfigError as err:
        assert str(err) and len(str(err)) < 2000
    else:
        assert from_dict(cfg.to_dict()) == cfg  # whatever is accepted round-trips


def test_preset_of_the_wrong_type():
    for bad in ([1], {"a": 1}, 3):
        try:
            from_dict({"preset": bad})
        except ConfigError as err:
            assert "unknown preset" in str(err)
        else:
            raise AssertionError(f"preset {bad!r} accepted")
