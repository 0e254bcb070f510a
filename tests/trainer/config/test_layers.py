"""A config resolved from layers (defaults < preset < layers in order) and the report of where each setting came
from (Train LoRA's text); the group, advanced flag and step each setting declares."""

from __future__ import annotations

import pytest

from trainer import config as config
from trainer.config import ConfigError
from trainer.config import layers as config_layers


def test_later_layers_win_and_every_layer_wins_over_the_preset():
    resolved = config_layers.resolve(
        [("options", {"loss_weighting": "none", "ema": True, "rank": 4}), ("Train LoRA", {"rank": 8, "steps": 50})],
        preset="character",
    )
    cfg = resolved.config
    # A value set on a layer wins over the preset even when it is the default (none): no hidden comparison.
    assert cfg.loss_weighting == "none" and cfg.ema is True and cfg.rank == 8 and cfg.steps == 50
    # What no layer sets comes from the preset.
    assert cfg.weight_decay == 1e-4 and cfg.resolutions == [512, 768, 1024] and cfg.checkpoint_every == 250
    assert resolved.sources["loss_weighting"] == "options" and resolved.sources["rank"] == "Train LoRA"
    assert resolved.sources["resolutions"] == "preset character" and "ema_decay" not in resolved.sources


def test_a_layer_that_leaves_a_setting_out_keeps_the_preset():
    cfg = config_layers.resolve([("options", {"ema": True})], preset="character").config
    assert cfg.loss_weighting == "bell" and cfg.ema is True


def test_report_lists_what_differs_from_the_defaults_and_what_overrides_the_preset():
    resolved = config_layers.resolve(
        [
            ("options", {"loss_weighting": "none", "ema": True}),
            ("Train LoRA", {"steps": 50}),
            ("dataset", {"resolutions": [64]}),
        ],
        preset="character",
    )
    lines = resolved.lines()
    assert "loss_weighting = none (options; preset character: bell)" in lines  # at its default, yet listed
    assert "ema = True (options)" in lines
    assert "steps = 50 (Train LoRA; preset character: 3000)" in lines
    assert "resolutions = [64] (dataset; preset character: [512, 768, 1024])" in lines
    assert "checkpoint_every = 250 (preset character)" not in lines  # the default: not listed
    assert "weight_decay = 0.0001 (preset character)" not in lines  # the preset's value is the default
    assert "rank = 32 (preset character)" not in lines
    report = resolved.report()
    assert report.splitlines()[0] == (
        "settings (defaults < preset character < options < Train LoRA < dataset; later wins):"
    )
    assert all(line.startswith("  ") for line in report.splitlines()[1:])


def test_report_names_a_later_change_and_says_when_all_are_defaults():
    resolved = config_layers.resolve([("options", {})])
    assert resolved.report().splitlines() == ["settings (defaults < options; later wins):", "  all at their defaults"]
    moved = resolved.then(config.replace(resolved.config, rank=4, alpha=4.0), "init LoRA")
    assert moved.lines() == ["rank = 4 (init LoRA)", "alpha = 4.0 (init LoRA)"]
    assert "< options < init LoRA;" in moved.report()
    assert resolved.then(resolved.config, "init LoRA").layers == ("options",)  # nothing moved, no layer named


def test_report_shows_text_and_numbers_as_typed():
    lines = config_layers.resolve([("options", {"run_name": "me", "adam_eps": 1e-10, "targets": ["a.b"]})]).lines()
    assert lines == ["targets = ['a.b'] (options)", "adam_eps = 1e-10 (options)", "run_name = me (options)"]
    assert config_layers.shown("") == '""'


def test_resolve_checks_values_and_presets():
    with pytest.raises(ConfigError, match="rank"):
        config_layers.resolve([("options", {"rank": 0})])
    with pytest.raises(ConfigError, match="unknown preset"):
        config_layers.resolve([], preset="portrait")


def test_every_setting_declares_a_group_and_floats_a_step_finer_than_their_bounds():
    assert set(config.GROUP) == set(config.FIELDS) and set(config.GROUP.values()) <= set(config.GROUPS)
    assert config.ADVANCED <= set(config.FIELDS) and "adam_eps" in config.ADVANCED and "ema" not in config.ADVANCED
    assert all(config.FIELDS[name].type == "float" for name in config.STEPS)
    with pytest.raises(ValueError, match="setting group 'misc'"):
        config.setting(1, "help", "misc")
