#!/usr/bin/env python3
"""Prepare a ComfyUI source tree for Kiln's tests: a working copy and a Python environment for it.

    python scripts/comfyui_tree.py TREE WORKDIR      # prints shell lines: COMFYUI_PATH=... COMFYUI_PYTHON=...

ComfyUI is not on PyPI, so the tests run against source trees (../shared/comfyui/v0.17 and v0.33).
For one tree this:
  1. copies it to WORKDIR/ComfyUI: ComfyUI writes into its own folder (user/, output/, temp/, and the
     in-process tests' folder_paths point there), and the source trees stay read-only fixtures;
  2. makes a virtual environment for it that sees the packages of the Python running this script (the
     installed CPU torch, pytest, MLX and Kiln's test tools; from a virtual or conda environment too) and
     installs the tree's requirements.txt into it with torch held at the installed version (`-c`
     constraints): otherwise pip replaces the CPU torch with a multi-gigabyte CUDA build. Each ComfyUI version pins its own frontend, comfy-kitchen and
     comfy-aimdo, so each gets its own environment.
The environment is cached under runs/comfyui/ (keyed by the requirements, the Python, its environment
and the torch version) and reused while it is complete; a half-built one is never reused (it is marked ready only at
the end). PyPI's torchvision/torchaudio wheels do not load against the CPU torch: tests/helpers/comfy_env.py
works around that at run time, in the tests and in the server launcher.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "runs" / "comfyui"
# What the tests never need from a tree, anywhere in it, and what a run leaves at its root (a tree used by
# hand, say). Only at the root: comfy_api/input/ is ComfyUI's own code.
NOT_COPIED_ANYWHERE = shutil.ignore_patterns("__pycache__", "*.pyc", ".git")
NOT_COPIED_AT_ROOT = {"user", "output", "temp", "input"}


def version_of(tree: Path) -> str:
    """ComfyUI's own version string (comfyui_version.py), e.g. '0.33.0'."""
    source = tree / "comfyui_version.py"
    if not source.is_file():
        raise SystemExit(f"{tree} is not a ComfyUI tree: no comfyui_version.py")
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
            return str(ast.literal_eval(node.value))
    raise SystemExit(f"{source} sets no __version__")


def torch_version(python: str = sys.executable) -> str:
    """The torch version installed for `python`, without its local tag (2.13.0+cpu → 2.13.0)."""
    done = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('torch'))"], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"torch is not installed for {python}; ./scripts/test installs it first")
    return done.stdout.strip().split("+")[0]


def copy_tree(tree: Path, workdir: Path) -> Path:
    target = workdir / "ComfyUI"
    if target.exists():
        shutil.rmtree(target)

    def ignore(folder: str, names: list[str]) -> set[str]:
        left_out = set(NOT_COPIED_ANYWHERE(folder, names))
        return left_out | (NOT_COPIED_AT_ROOT & set(names)) if Path(folder) == tree else left_out

    shutil.copytree(tree, target, ignore=ignore, symlinks=True)
    for sub in ("custom_nodes", "models", "input", "output", "user"):
        (target / sub).mkdir(exist_ok=True)
    return target


def environment(tree: Path, version: str) -> Path:
    """The cached virtual environment for this tree's requirements (built when missing): its python."""
    requirements = (tree / "requirements.txt").read_bytes()
    torch = torch_version()
    # sys.prefix: a virtual or conda environment's tree environment sees that environment's packages (below)
    key = hashlib.sha256(requirements + f"|{sys.version}|{sys.prefix}|{torch}".encode()).hexdigest()[:12]
    venv = CACHE / f"venv-{version}-{key}"
    python = venv / "bin" / "python"
    if (venv / ".ready").is_file() and python.is_file():
        return python
    if venv.exists():
        shutil.rmtree(venv)  # a half-built one from an interrupted run
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    see_packages_of_this_python(python)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write(f"torch=={torch}\n")
    try:
        print(
            f"[comfyui] installing ComfyUI {version}'s requirements (torch held at {torch})",
            file=sys.stderr,
            flush=True,
        )
        subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "-r",
                str(tree / "requirements.txt"),
                "-c",
                constraints.name,
            ],
            check=True,
        )
    finally:
        os.unlink(constraints.name)
    held = torch_version(str(python))
    if held != torch:
        raise SystemExit(f"installing ComfyUI's requirements changed torch {torch} -> {held}")
    (venv / ".ready").write_text(f"ComfyUI {version}, torch {torch}\n", encoding="utf-8")
    return python


def see_packages_of_this_python(python: Path) -> None:
    """`--system-site-packages` shows the base interpreter's packages: run from a virtual environment (or a conda
    one), the tree's environment would not see what that environment installed (Kiln's test extra, MLX). A .pth
    file puts this interpreter's own site-packages after the tree's, so the tree's pins (frontend, kitchen) win."""
    import site

    ours = [*site.getsitepackages(), site.getusersitepackages()]
    done = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True, text=True, check=True
    )
    theirs = Path(done.stdout.strip())
    lines = [folder for folder in ours if Path(folder).is_dir() and Path(folder).resolve() != theirs.resolve()]
    (theirs / "kiln_outer_site_packages.pth").write_text("".join(f"{folder}\n" for folder in lines), encoding="utf-8")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    tree, workdir = Path(argv[0]).resolve(), Path(argv[1]).resolve()
    version = version_of(tree)
    workdir.mkdir(parents=True, exist_ok=True)
    python = environment(tree, version)
    copy = copy_tree(tree, workdir)
    for name, value in (("COMFYUI_PATH", copy), ("COMFYUI_PYTHON", python), ("COMFYUI_VERSION", version)):
        print(f"{name}={shlex.quote(str(value))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
