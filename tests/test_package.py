"""The registry zip, as comfy-cli builds it (`comfy node pack`, what `comfy node publish` uploads) and
`comfy node validate`, the registry's own checks.

The pack is built in a copy of this working tree (tracked files and untracked ones git does not ignore,
as `git ls-files` lists them) with a run folder, caches, byte code and node_modules left in it the way a
developer's checkout has them. The zip must hold what a ComfyUI user needs (the entry point, nodes/,
trainer/, web/, the example workflows, the project files) and nothing of runs/, caches, tests or
benchmarks; unpacked on its own, the trainer library imports and its command line answers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "DO_NOT_TRACK": "1"}  # comfy-cli asks no consent question and sends nothing


def comfy_cli() -> list[str]:
    found = shutil.which("comfy")
    if found:
        return [found]
    try:
        import comfy_cli  # noqa: F401
    except ImportError:
        pytest.fail("comfy-cli is not installed: pip install -e '.[test]' installs it", pytrace=False)
    return [sys.executable, "-m", "comfy_cli"]


def tracked_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sorted({name for name in listed.split("\0") if name and (REPO / name).is_file()})


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, set[str]]:
    work = tmp_path_factory.mktemp("pack") / "kiln"
    for name in tracked_files():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, work / name)
    # What a developer's checkout holds besides its files: all of it is ignored and must stay out.
    for junk in (
        "runs/demo/demo_lora.safetensors",
        "runs/comfyui/venv-0.33.0-x/bin/python",
        "example_workflows/.kiln_cache/latents.safetensors",
        "trainer/__pycache__/loop.cpython-311.pyc",
        "node_modules/playwright-core/package.json",
        "kiln.egg-info/PKG-INFO",
    ):
        (work / junk).parent.mkdir(parents=True, exist_ok=True)
        (work / junk).write_bytes(b"not for the registry")
    for command in (["init", "-q"], ["add", "-A"]):
        subprocess.run(["git", *command], cwd=work, check=True, capture_output=True)
    done = subprocess.run(
        [*comfy_cli(), "node", "pack"], cwd=work, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and (work / "node.zip").is_file(), done.stdout + done.stderr
    with zipfile.ZipFile(work / "node.zip") as archive:
        names = set(archive.namelist())
        unpacked = tmp_path_factory.mktemp("custom_nodes") / "kiln"
        archive.extractall(unpacked)
    return unpacked, names


def test_the_zip_holds_what_a_user_needs(packed):
    _, names = packed
    needed = {
        "__init__.py",
        "headless.py",
        "pyproject.toml",
        "requirements.txt",
        "README.md",
        "LICENSE",
        "scripts/demo",
    }
    needed |= {
        name
        for name in tracked_files()
        if name.startswith(("nodes/", "trainer/", "web/", "example_workflows/")) and not name.endswith(".pyc")
    }
    assert {"nodes/train_nodes.py", "trainer/run/loop.py", "web/kiln_dashboard.js"} <= needed
    assert any(name.startswith("example_workflows/api/") for name in needed)
    assert sorted(needed - names) == []


def test_the_zip_holds_nothing_of_runs_caches_or_tests(packed):
    _, names = packed
    unwanted = [
        name
        for name in names
        if name.startswith(("runs/", "tests/", "bench/", ".ci/", "node_modules/", ".git/"))
        or any(part in ("__pycache__", ".kiln_cache") or part.endswith(".egg-info") for part in Path(name).parts)
        or name.endswith(".pyc")
        or name in ("scripts/test", "package.json")
    ]
    assert unwanted == []


def test_the_unpacked_zip_runs_on_its_own(packed):
    unpacked, _ = packed
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "--help"],
        cwd=unpacked,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert done.returncode == 0 and "check-dataset" in done.stdout, done.stderr[-2000:]
    imported = subprocess.run(
        [
            sys.executable,
            "-c",
            "import trainer.run.loop, trainer.data, trainer.lora.files, "
            "trainer.backends.torch_backend.backend; print('ok')",
        ],
        cwd=unpacked,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert imported.stdout.strip() == "ok", imported.stderr[-2000:]


def test_comfy_node_validate_is_clean():
    """The registry's checks (ruff S102/S307/E702: exec, eval, `;`-joined statements). comfy-cli only warns
    (it runs ruff with --exit-zero), so the warning text is what fails here."""
    done = subprocess.run(
        [*comfy_cli(), "node", "validate"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300
    )
    said = done.stdout + done.stderr  # rich prints to stderr when it is not a terminal
    assert done.returncode == 0, said
    assert "All validation checks passed" in said and "warning" not in said.lower(), said
