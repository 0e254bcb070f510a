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
        "import trainer.__main__\n"
        "bad = sorted(n for n in sys.modules if n == 'comfy' or n.startswith(('comfy.', 'comfy_api', 'folder_paths')))\n"
        "print(len([n for n in sys.modules if n.startswith('trainer')]))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) > 15  # the walk really imported the library


def test_trainer_package_import_is_light():
    """`import trainer` alone must not pull torch (the MLX path and the CLI's --help stay fast)."""
    code = "import sys, trainer, trainer.config, trainer.lora_format; assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
