"""scripts/check_shape.py and the formatter: the code as the pinned `ruff format` lays it out, each file and
function within its folder's size budget."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import check_shape  # noqa: E402


def test_every_file_and_function_is_within_its_folder_budget():
    assert check_shape.over_budget() == []


def test_the_budget_check_finds_a_long_file_and_a_long_function(tmp_path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "a.py").write_text("def f():\n" + "    x = 1\n" * 70)
    (tmp_path / "trainer" / "b.py").write_text("def g():\n    return 1\n")
    found = check_shape.over_budget(tmp_path, {"trainer": (50, 60)})
    assert found == ["trainer/a.py: 71 lines > 50", "trainer/a.py:1 f: 71 lines > 60"]


def pinned_ruff() -> str:
    found = re.search(r'"ruff==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert found, "pyproject.toml's test extra pins ruff (ruff==X.Y.Z): another version formats differently"
    return found.group(1)


def test_the_code_is_formatted_by_the_pinned_ruff():
    version = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True)
    assert version.returncode == 0, "ruff is missing: pip install -e '.[test]'"
    assert version.stdout.split()[-1] == pinned_ruff(), (
        f"{version.stdout.strip()} is not the pinned ruff {pinned_ruff()}: pip install -e '.[test]'"
    )
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, f"run `ruff format .` (the layout is the formatter's):\n{result.stdout}"
