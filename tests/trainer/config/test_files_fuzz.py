"""Fuzzing config files through the CLI's loader (config.load, as `python -m trainer train/estimate` read
them): random TOML and JSON of every type, random bytes, odd suffixes. Each gives a TrainConfig or a
ConfigError that names the file; whatever loads survives save → load unchanged (in both formats)."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from trainer import config as config_module
from trainer.cli.main import main
from trainer.config import FIELDS, ConfigError
from trainer.config import files as config_file

# Any scalar value, with the ones that broke TOML round trips made common: emoji, DEL, quotes, backslashes.
text = st.text(st.one_of(st.characters(codec="utf-8"), st.sampled_from('😀\U0001f525\x7f\x01"\\é')), max_size=12)
scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True),
    text,
    st.sampled_from(["flux2_klein", "demo", "adamw", "mlx", "torch", "cosine", "bf16", "none"]),
)
values = st.one_of(
    scalars,
    st.lists(scalars, max_size=3),
    st.lists(st.integers(1, 4096), max_size=3),
    st.dictionaries(st.sampled_from(["a", "b"]), scalars, max_size=2),
    st.datetimes().map(lambda d: ("datetime", d.isoformat())),
)
keys = st.one_of(
    st.sampled_from(sorted(FIELDS) + ["preset"]), st.text(st.characters(codec="utf-8"), min_size=1, max_size=10)
)


def toml_value(value) -> str:
    if isinstance(value, tuple):  # a TOML datetime, written bare
        return value[1]
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return config_file._toml_value(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return "[" + ", ".join(toml_value(v) for v in value) + "]"


TYPED = {
    "int": st.integers(0, 5000),
    "float": st.floats(-1, 10),
    "bool": st.booleans(),
    "str": text,
    "list[str]": st.lists(text, max_size=3),
    "list[int]": st.lists(st.sampled_from([256, 512, 768]), max_size=3),
    "list[str | dict]": st.lists(
        st.one_of(
            text,
            st.fixed_dictionaries(
                {"prompt": text},
                optional={"seed": st.integers(0, 10), "cfg": st.floats(0, 30), "width": st.sampled_from([64, 512])},
            ),
        ),
        max_size=2,
    ),
}


@st.composite
def tables(draw) -> dict:
    """Mostly well-typed values for real keys (so many files load and reach save), else anything."""
    table = {}
    free_text = sorted(k for k in FIELDS if config_module.KIND[k] == "str" and k not in config_module.CHOICES)
    for key in draw(st.lists(st.one_of(keys, st.sampled_from(free_text)), max_size=5, unique=True)):
        kind = config_module.KIND.get(key)
        table[key] = draw(TYPED[kind]) if kind and draw(st.integers(0, 3)) else draw(values)
    return table


@st.composite
def config_files(draw) -> tuple[str, bytes]:
    table = draw(tables())
    kind = draw(st.sampled_from(["toml", "json", "garbage", "cut"]))
    if kind == "toml":
        body = "".join(f"{json.dumps(k, ensure_ascii=False)} = {toml_value(v)}\n" for k, v in table.items())
        return ".toml", body.encode("utf-8")
    plain = {k: (v[1] if isinstance(v, tuple) else v) for k, v in table.items()}
    if kind == "json":
        return ".json", json.dumps(plain).encode()  # NaN and Infinity included, as Python writes them
    if kind == "cut":
        whole = json.dumps(plain).encode()
        return draw(st.sampled_from([".json", ".toml"])), whole[: draw(st.integers(0, len(whole)))]
    return draw(st.sampled_from([".toml", ".json", ".TOML", ".yaml", ""])), draw(st.binary(max_size=60))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config_files())
@example((".json", json.dumps({"trigger_word": "ohwx 😀", "run_name": "del\x7f"}).encode()))  # once unsaveable as TOML
def test_config_files_load_or_fail_naming_the_file(file):
    suffix, data = file
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"run{suffix}"
        path.write_bytes(data)
        try:
            cfg = config_file.load(path)
        except ConfigError as err:
            assert str(err).startswith(str(path)) and len(str(err)) < 3000
            return
        for again in ("again.toml", "again.json"):  # what loads, saves and loads back the same
            config_file.save(cfg, Path(folder) / again)
            assert config_file.load(Path(folder) / again) == cfg


def test_the_cli_reports_bad_config_files_as_errors_not_tracebacks(tmp_path, capsys):
    cases = {
        "a.toml": b'steps = "many"\n',
        "b.json": b"[1, 2]",
        "c.toml": b"\xff\xfe\x00garbage",
        "d.json": b'{"rank": 1e999}',
        "e.toml": b"rnak = 4\n",
        "f.json": b'{"trigger_word": "\\ud800"}',
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        for command in (
            ["train", str(tmp_path / name)],
            ["estimate", str(tmp_path / name), "--variant", "flux2-klein-4b"],
        ):
            assert main(command) == 2, (name, command)
            err = capsys.readouterr().err
            assert err.startswith(f"error: {tmp_path / name}") and "Traceback" not in err, err
    assert "did you mean 'rank'" in _error_for(tmp_path / "e.toml")


def _error_for(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        config_file.load(path)
    return str(caught.value)
