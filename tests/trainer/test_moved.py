"""trainer/moved.py: the flat layout's import paths still import for one release, warn once with the new path,
and give every public name the old module held (snapshot: tests/fixtures/flat_layout_names.json)."""

from __future__ import annotations

import importlib
import json
import sys
import warnings
from pathlib import Path

import pytest

from trainer import moved

NAMES = json.loads((Path(__file__).parents[1] / "fixtures" / "flat_layout_names.json").read_text())["modules"]


@pytest.mark.parametrize("old", sorted(moved.MOVED))
def test_an_old_module_path_imports_warns_and_holds_its_names(old):
    sys.modules.pop(f"trainer.{old}", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"trainer.{old}")
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
        f"trainer.{old} moved to trainer.{moved.MOVED[old]}; the old path goes in the next release"
    ]
    missing = [name for name in NAMES[old] if not hasattr(module, name)]
    assert not missing, f"trainer.{old} lost {missing}"


@pytest.mark.parametrize("old", sorted(moved.PACKAGES))
def test_a_package_that_took_an_old_modules_name_gives_its_names(old):
    package = importlib.import_module(f"trainer.{old}")
    missing = [name for name in NAMES[old] if not hasattr(package, name)]
    assert not missing, f"trainer.{old} lost {missing}"
    with pytest.raises(AttributeError):
        package.no_such_name  # noqa: B018


def test_the_snapshot_covers_every_old_module():
    assert set(NAMES) == set(moved.MOVED) | set(moved.PACKAGES)
