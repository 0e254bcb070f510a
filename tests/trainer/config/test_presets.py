"""Presets that tell: each documents its choices in one line, shown in the preset widget's tooltip and docs."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import PRESET_LINES, PRESETS, from_dict

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_has_its_one_line_and_builds(name):
    line = PRESET_LINES[name]
    assert line.strip() and "\n" not in line and len(line) <= 200
    cfg = from_dict({"preset": name})
    assert all(getattr(cfg, key) == value for key, value in PRESETS[name].items())


def test_the_docs_list_every_preset_with_its_line():
    text = (ROOT / "docs" / "command-line.md").read_text()
    for name, line in PRESET_LINES.items():
        assert f"| `{name}` | {line} |" in text, name


def test_the_family_presets_follow_ai_toolkits_examples():
    for name in ("klein_base", "zimage_turbo"):
        assert PRESETS[name]["learning_rate"] == 1e-4 and PRESETS[name]["rank"] == 32
