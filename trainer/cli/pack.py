"""The pack root (headless.py, beside nodes/) reached from the command line: the one door from trainer/ to it."""

from __future__ import annotations

import sys
from pathlib import Path


def headless():
    """The pack's headless front end (headless.py, beside nodes/), for ComfyUI architectures, whose
    model code is ComfyUI's. The library itself never imports ComfyUI or nodes/."""
    import importlib.util
    import os

    path = os.environ.get("COMFYUI_PATH", "").strip()
    if not path and importlib.util.find_spec("comfy") is None:
        raise SystemExit(
            "this architecture trains ComfyUI's own model code, and ComfyUI is not importable here: "
            "set COMFYUI_PATH to a ComfyUI checkout (0.17 or newer) and run again, "
            "or use arch 'demo' to try the trainer without it"
        )
    if path and path not in sys.path:
        sys.path.insert(0, path)
    return import_pack("headless")


PACK = "kiln_pack"


def import_pack(name: str = ""):
    """This repository imported as a package (`kiln_pack.<name>`), the way ComfyUI imports
    custom_nodes/<folder>: `nodes` then never shadows ComfyUI's own `nodes` module."""
    import importlib
    import importlib.util

    if PACK not in sys.modules:
        root = Path(__file__).resolve().parents[2]  # trainer/cli/main.py → the pack root
        spec = importlib.util.spec_from_file_location(
            PACK, root / "__init__.py", submodule_search_locations=[str(root)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACK] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{PACK}.{name}" if name else PACK)
