"""TrainConfig: presets, file round trips and every error path."""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from trainer import config as config
from trainer.config import (
    BOUNDS,
    CHOICES,
    FIELDS,
    HELP,
    PRESETS,
    ConfigError,
    TrainConfig,
    from_dict,
)
from trainer.config import files as config_file


def test_defaults_are_valid():
    assert config.validate(TrainConfig()) == TrainConfig()


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_valid_and_applied(name):
    cfg = from_dict({}, preset=name)
    for key, value in PRESETS[name].items():
        assert getattr(cfg, key) == value
    assert from_dict({"preset": name, "rank": 4}).rank == 4  # the user's keys win over the preset


def test_preset_values_follow_ai_toolkit():
    character = from_dict({}, preset="character")
    assert (character.rank, character.learning_rate, character.weight_decay) == (32, 1e-4, 1e-4)
    assert character.resolutions == [512, 768, 1024] and character.caption_dropout == 0.05
    assert character.gradient_checkpointing and character.mixed_precision == "bf16"
    assert from_dict({}, preset="style").content_or_style == "style"


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'portrait'.*character"):
        from_dict({}, preset="portrait")


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match=r"'learning_rte' \(did you mean 'learning_rate'\?\)"):
        from_dict({"learning_rte": 1e-4})


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("rank", "32", "rank must be int, got str"),
        ("rank", 32.0, "rank must be int, got float"),
        ("rank", True, "rank must be int, got a boolean"),
        ("ema", 1, "ema must be bool, got int"),
        ("learning_rate", "1e-4", "learning_rate must be float, got str"),
        ("learning_rate", float("nan"), "learning_rate must be a finite number"),
        ("targets", "attn.qkv", "targets must be list\\[str\\], got str"),
        ("targets", ["attn.qkv", 3], "element 3 is int"),
        ("resolutions", [512, "768"], "element '768' is str"),
    ],
)
def test_wrong_types(key, value, message):
    with pytest.raises(ConfigError, match=message):
        from_dict({key: value})


def test_int_accepted_where_float_expected():
    assert from_dict({"learning_rate": 1}).learning_rate == 1.0


@pytest.mark.parametrize("key", sorted(BOUNDS))
def test_every_bound_is_enforced(key):
    low, high = BOUNDS[key]
    kind = config.KIND[key]
    below = low - 1 if kind in ("int", "list[int]") else low - abs(low) * 0.5 - 1e-9
    value = [int(below)] if kind == "list[int]" else (int(below) if kind == "int" else below)
    with pytest.raises(ConfigError, match=f"{key} must be in"):
        from_dict({key: value})
    above = [int(high) + 1] if kind == "list[int]" else (int(high) + 1 if kind == "int" else high * 2 + 1)
    with pytest.raises(ConfigError, match=f"{key} must be in"):
        from_dict({key: above})


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_every_choice_is_enforced(key):
    with pytest.raises(ConfigError, match=f"{key} must be one of"):
        from_dict({key: "no-such-choice"})


@pytest.mark.parametrize(
    "values,message",
    [
        ({"steps": 10, "warmup_steps": 10}, "warmup_steps \\(10\\) must be below steps"),
        ({"lr_schedule": "cosine", "warmup_steps": 5}, "use 'cosine_with_warmup'"),
        ({"lr_schedule": "cosine_with_warmup"}, "needs warmup_steps > 0"),
        ({"optimizer": "prodigy"}, "set learning_rate to 1.0"),
        ({"backend": "mlx", "arch": "generic", "targets": ["x"]}, "use backend 'torch'"),
        ({"backend": "mlx", "optimizer": "lion", "learning_rate": 3e-5}, "PyTorch-only; use one of adamw, adamw8bit"),
        ({"optimizer": "schedulefree", "lr_schedule": "linear"}, "set lr_schedule to constant"),
        ({"base_quantize": "int4"}, "for backend .mlx."),
        ({"arch": "generic"}, "has no default targets"),
        ({"resolutions": [512, 512]}, "without repeats"),
        ({"resolutions": [520]}, "multiples of 16"),
        ({"targets": ["  "]}, "empty pattern"),
        ({"targets": ["re:(unclosed"]}, "not a valid regular expression"),
    ],
)
def test_incompatible_combinations(values, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(values)


def test_adamw8bit_is_accepted_on_mlx():
    """The MLX backend trains it as fp32 AdamW, saying so in the log (it was refused before)."""
    assert from_dict({"backend": "mlx", "optimizer": "adamw8bit"}).optimizer == "adamw8bit"


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_save_load_round_trip(tmp_path, suffix):
    cfg = from_dict(
        {
            "rank": 8,
            "targets": ["attn.qkv", "re:layers\\.\\d+\\.x"],
            "trigger_word": 'a "quoted" ñame',
            "resolutions": [512, 768],
            "learning_rate": 1e-5 * 3,
            "ema": True,
        },
        preset="style",
    )
    path = tmp_path / f"run{suffix}"
    config_file.save(cfg, path)
    assert config_file.load(path) == cfg
    assert not list(tmp_path.glob(".*tmp"))


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("rank = [", encoding="utf-8")
    with pytest.raises(ConfigError, match="bad.toml: not valid TOML"):
        config_file.load(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"rank": 0}))
    with pytest.raises(ConfigError, match="wrong.json: rank must be in 1..256, got 0"):
        config_file.load(wrong)
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="list.json: the top level must be a table"):
        config_file.load(listing)
    with pytest.raises(ConfigError, match="must end in .toml or .json"):
        config_file.load(tmp_path / "x.yaml")
    with pytest.raises(ConfigError, match="missing.toml: cannot read config"):
        config_file.load(tmp_path / "missing.toml")
    latin = tmp_path / "latin.toml"
    latin.write_bytes("trigger_word = 'caf\xe9'".encode("latin-1"))
    with pytest.raises(ConfigError, match="latin.toml: cannot read config"):
        config_file.load(latin)


@pytest.mark.parametrize("name", list(FIELDS))
def test_every_setting_has_help_text(name):
    """The nodes show HELP as each TrainConfig widget's tooltip (Training Options shows all but a few)."""
    text = HELP[name].strip()
    assert text and text.lower() not in (name, name.replace("_", " ")), (
        f'{name}: no help text beyond its name; write it beside the default: {name} = setting(default, "...")'
    )


def test_help_text_is_there_without_the_source(tmp_path):
    """An install of bytecode only (a zip, a compiled wheel): the help comes from the fields, not from reading
    config.py, which inspect.getsource cannot do there."""
    package = Path(config.__file__).parents[1]  # trainer/ (config is a package)
    bundle = tmp_path / "trainer.zip"
    with zipfile.ZipFile(bundle, "w") as archive:
        for source in package.rglob("*.py"):
            name = source.relative_to(package.parent)
            compiled = tmp_path / "pyc" / name.with_suffix(".pyc")  # named for a .py that is not there
            py_compile.compile(str(source), cfile=str(compiled), dfile=str(bundle / name), doraise=True)
            archive.write(compiled, name.with_suffix(".pyc").as_posix())
    probe = (
        "import inspect, json\nfrom trainer import config\n"
        "try:\n    inspect.getsource(config.TrainConfig)\nexcept OSError:\n    source = False\n"
        "else:\n    source = True\n"
        "print(json.dumps({'file': config.__file__, 'source': source, 'help': config.HELP}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(bundle)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["file"].startswith(str(bundle)) and not seen["source"], f"config.py was readable: {seen['file']}"
    assert seen["help"] == HELP
