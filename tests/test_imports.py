"""The trainer never imports ComfyUI (DESIGN.md): importing every trainer module loads no comfy module."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_importing_trainer_loads_no_comfy_module():
    code = (
        "import sys, pkgutil, importlib, trainer\n"
        "for m in pkgutil.walk_packages(trainer.__path__, 'trainer.'):\n"
        "    if 'mlx_backend' in m.name or m.name.endswith('__main__'):\n"
        "        continue\n"
        "    importlib.import_module(m.name)\n"
        "import trainer.cli.main\n"
        "bad = sorted(n for n in sys.modules if n == 'comfy' or n.startswith(('comfy.', 'comfy_api', 'folder_paths')))\n"
        "print(len([n for n in sys.modules if n.startswith('trainer')]))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) > 15  # the walk really imported the library


def test_trainer_package_import_is_light():
    """`import trainer` alone must not pull torch (the MLX path and the CLI's --help stay fast)."""
    code = "import sys, trainer, trainer.config, trainer.lora.files; assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ComfyUI's own modules; comfy_api (the node-definition API) is what nodes are written in, so it is allowed.
COMFYUI_MODULES = (
    "comfy",
    "comfy_extras",
    "comfy_execution",
    "folder_paths",
    "server",
    "execution",
    "nodes",
    "latent_preview",
    "node_helpers",
)
DOOR = ROOT / "nodes" / "comfy"


def _comfyui_imports(path: Path) -> list[str]:
    """`import X` / `from X import` of a ComfyUI module anywhere in a file (also inside functions), and
    sys.modules lookups of one by name (a server or executor reached without importing it)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "modules"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        else:
            continue
        found += [
            f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names if name.split(".")[0] in COMFYUI_MODULES
        ]
    return found


def test_only_the_door_imports_comfyui():
    """nodes/comfy/ is the one door to ComfyUI (DESIGN.md): no other module of the pack imports comfy,
    comfy_extras, folder_paths or server, or looks one up in sys.modules."""
    sources = [*ROOT.glob("trainer/**/*.py"), *ROOT.glob("nodes/**/*.py"), ROOT / "headless.py", ROOT / "__init__.py"]
    outside = [p for p in sources if DOOR not in p.parents]
    assert len(outside) > 40 and any(p.name == "run.py" for p in outside)  # the scan saw the pack
    offending = [hit for path in outside for hit in _comfyui_imports(path)]
    assert offending == [], f"ComfyUI reached outside nodes/comfy/ (move it into the door): {offending}"
    assert any(_comfyui_imports(p) for p in DOOR.glob("*.py"))  # the scan finds what the door does import
