"""Find and prepare a ComfyUI checkout for the tests that need one (COMFYUI_PATH).

`require_comfy()` skips the calling test (or module) with a clear reason when
COMFYUI_PATH is unset; otherwise it puts ComfyUI on sys.path, works around a
CUDA-only torchvision wheel on CPU torch, and makes ComfyUI run on the CPU, all
before anything from ComfyUI is imported. Safe to call any number of times.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

SKIP_REASON = "set COMFYUI_PATH to a ComfyUI 0.17+ checkout to run this test"
_prepared: str | None = None
_torchvision_fragment = None  # kept alive: dropping the Library would deregister the schemas


def comfy_path() -> str | None:
    """COMFYUI_PATH if set and non-empty, else None."""
    value = os.environ.get("COMFYUI_PATH", "").strip()
    return value or None


def _torchvision_workaround() -> None:
    """PyPI's torchvision may be a CUDA build whose C++ ops do not load against CPU torch, and then
    `import torchvision` fails with "operator torchvision::nms does not exist" (ComfyUI imports it at
    start). Declaring the two op schemas its Python side looks up lets the import succeed; the ops
    themselves stay unavailable, which nothing Kiln's tests run needs."""
    global _torchvision_fragment
    if "torchvision" in sys.modules:
        return
    import torch

    try:
        torch._C._dispatch_has_kernel_for_dispatch_key("torchvision::nms", "Meta")
        return  # the real ops are registered: nothing to do
    except RuntimeError:
        pass
    try:
        import torchvision  # noqa: F401  (a working CPU build imports fine)
        return
    except Exception:  # noqa: BLE001
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    lib = torch.library.Library("torchvision", "FRAGMENT")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _torchvision_fragment = lib


def prepare(path: str) -> None:
    """sys.path + torchvision workaround + CPU mode; must run before `import comfy.model_management`."""
    global _prepared
    if _prepared == path:
        return
    root = str(Path(path).resolve())
    if not Path(root, "comfy", "model_management.py").is_file():
        raise RuntimeError(f"COMFYUI_PATH={path!r} is not a ComfyUI checkout (no comfy/model_management.py)")
    if root not in sys.path:
        sys.path.insert(0, root)
    _torchvision_workaround()
    from comfy.cli_args import args  # parses no argv unless comfy.options enabled it (main.py only)

    if "comfy.model_management" not in sys.modules:
        # read once, at import of comfy.model_management (as `main.py --cpu`); KILN_COMFY_GPU=1 runs
        # the same tests on the GPU (bench/ and the device checks use it)
        args.cpu = not gpu()
    _prepared = path


def import_pack(submodule: str = ""):
    """This repository as ComfyUI imports a custom-node pack (`kiln_pack.<submodule>`); see trainer/__main__.py."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:  # pytest puts it there; a plain script may not
        sys.path.insert(0, root)
    from trainer.__main__ import import_pack as _import

    return _import(submodule)


def gpu() -> bool:
    """KILN_COMFY_GPU=1: let ComfyUI use its GPU instead of forcing the CPU."""
    return os.environ.get("KILN_COMFY_GPU", "") == "1"


def require_comfy() -> str:
    """Skip without COMFYUI_PATH; else prepare ComfyUI (CPU) and return its path."""
    import pytest

    path = comfy_path()
    if path is None:
        pytest.skip(SKIP_REASON, allow_module_level=True)
    prepare(path)
    return path
