"""Tiny models and data built in the tests: nothing is downloaded, everything runs on CPU in seconds.

`--comfyui without|only` splits the suite by the `comfyui` marker: a test module that needs ComfyUI says
`pytestmark = pytest.mark.comfyui` (and calls helpers.comfy_env.require_comfy() before importing ComfyUI), the rest
is the library, wherever the file lives. ./scripts/test runs the library once and the ComfyUI tests once per
ComfyUI tree, each in that tree's own Python environment.

Shared code lives in the `helpers` package (tests/helpers/); test modules import it, never each other. The pack is
loaded once here as `kiln_pack` (as ComfyUI loads a custom-node folder), so tests import its modules with static
import statements, `from kiln_pack.nodes import run`, that a rename follows.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

# tests/ on sys.path: `from helpers import ...` in the library and the node tests alike (and in their child processes).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import florence
from helpers.tiny_runs import tiny_config, tiny_data, tiny_model
from trainer.cli.main import import_pack

import_pack()  # the pack's root __init__ imports nothing: loading it costs nothing and runs none of its nodes


@pytest.fixture(autouse=True)
def _compile_cache_in_tmp(monkeypatch, tmp_path_factory):
    """Compiled blocks set up in a test cache into a temporary folder, never the developer's ~/.cache:
    checkpointing.keep_compiled leaves a TORCHINDUCTOR_CACHE_DIR set to anything but inductor's default (which
    importing torch._dynamo has already written into it), and monkeypatch undoes what a test changes."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "inductor"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)


@pytest.fixture
def make_model():
    return tiny_model


@pytest.fixture
def make_data():
    return tiny_data


@pytest.fixture
def make_config():
    return tiny_config


# ---------------------------------------------------------------- a tiny captioner


@pytest.fixture(scope="session")
def tiny_florence(tmp_path_factory) -> Path:
    pytest.importorskip(
        "transformers", reason="the transformers captioner's tests need transformers (pip install -e '.[test]')"
    )
    return florence.write_tiny_florence(tmp_path_factory.mktemp("models") / "LLM" / "Florence-2-tiny")


# ---------------------------------------------------------------- the library / ComfyUI split


def pytest_configure(config):
    """In CI a test never skips for a missing optional package (MLX, diffusers, peft, tensorboard, wandb,
    transformers, aiohttp): ./scripts/test installs them all, so a skip there means an install step is missing."""
    from helpers import comfy_env

    if not comfy_env.required():
        return
    skip_when_missing = pytest.importorskip

    def importorskip(modname, *args, **kwargs):
        try:
            return skip_when_missing(modname, *args, **kwargs)
        except pytest.skip.Exception as skipped:
            pytest.fail(
                f"CI: {modname} is missing here ({skipped}); ./scripts/test installs it (pip install -e "
                "'.[test]', and mlx[cpu] off Apple Silicon)",
                pytrace=False,
            )

    pytest.importorskip = importorskip


def pytest_addoption(parser):
    parser.addoption(
        "--comfyui",
        choices=("with", "without", "only"),
        default="with",
        help="with: every test (ComfyUI tests skip without COMFYUI_PATH); without: only the tests that "
        "need no ComfyUI; only: only those that do (marked comfyui)",
    )


def needs_comfyui(path: Path) -> bool:
    """The module sets `pytestmark = pytest.mark.comfyui` (or a list holding it), read without importing it: a ComfyUI
    module imports ComfyUI at its top, which the library's environment lacks."""
    if path.suffix != ".py" or not path.name.startswith("test_"):
        return False
    marks = [
        node.value
        for node in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, ast.Assign)
        and any(isinstance(target, ast.Name) and target.id == "pytestmark" for target in node.targets)
    ]
    return bool(marks) and "mark.comfyui" in ast.unparse(marks[-1])  # the last assignment is the one pytest reads


def pytest_ignore_collect(collection_path: Path, config):
    part = config.getoption("--comfyui")
    if part == "with" or not collection_path.is_file() or not collection_path.name.startswith("test_"):
        return None
    return True if needs_comfyui(collection_path) != (part == "only") else None


def pytest_collection_modifyitems(config, items):
    """A test marked comfyui elsewhere than its module's pytestmark goes to the same part."""
    part = config.getoption("--comfyui")
    if part == "with":
        return
    keep = [item for item in items if (item.get_closest_marker("comfyui") is not None) == (part == "only")]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep


# Used by tests/nodes/ and tests/test_headless.py alike, so here at the root.
@pytest.fixture
def same_kernels():
    """Training options under which two runs on the GPU (KILN_COMFY_GPU=1) may be compared bit for bit: torch's
    deterministic algorithms, strictly (only then do flash attention's and cuDNN's backward take their
    deterministic paths: otherwise LoRA weights were up to ~3e-4 apart after 8 steps of two equal runs on an
    H200), and flash attention. Set CUBLAS_WORKSPACE_CONFIG=:4096:8 for the process too. On the CPU runs are
    bitwise as they are: {}."""
    from helpers import comfy_env

    if not comfy_env.gpu():
        yield {}
        return
    import torch

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield {"attention": "flash"}
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
