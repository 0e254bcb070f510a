"""Find and prepare a ComfyUI checkout for the tests that need one (COMFYUI_PATH).

`require_comfy()` prepares ComfyUI for a test module marked `comfyui` (the marker is what --comfyui selects
on, tests/conftest.py), before the module imports ComfyUI. Without COMFYUI_PATH it skips the module with the reason on a developer machine, and fails
it in CI (CI or KILN_REQUIRE_COMFYUI set): there every ComfyUI test must run. With COMFYUI_PATH it puts
ComfyUI on sys.path, works around PyPI's torchvision/torchaudio wheels on CPU torch, and makes ComfyUI
run on the CPU, all before anything from ComfyUI is imported. Safe to call any number of times.
./scripts/test prepares each tree of ../shared/comfyui (scripts/comfyui_tree.py) and runs these tests
against each.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from pathlib import Path

SKIP_REASON = (
    "needs ComfyUI: set COMFYUI_PATH to a ComfyUI 0.17+ checkout, or run ./scripts/test, which prepares "
    "the trees in ../shared/comfyui"
)
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
        _forget("torchvision")
    lib = torch.library.Library("torchvision", "FRAGMENT")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _torchvision_fragment = lib


class _Unavailable(types.ModuleType):
    """Stands in for a package whose compiled extension does not load: `import name` and `import
    name.sub` work, and any use raises AttributeError with the reason (so `from name import x` is an
    ImportError, which ComfyUI's optional imports catch)."""

    def __init__(self, name: str, reason: str):
        super().__init__(name)
        self.__path__ = []
        self.__spec__ = importlib.machinery.ModuleSpec(name, _UnavailableFinder(reason), is_package=True)
        self.__kiln_reason__ = reason

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        raise AttributeError(f"{self.__name__}.{attribute} is unavailable in Kiln's tests: {self.__kiln_reason__}")


class _UnavailableFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `package.anything` below an _Unavailable package (e.g. `import torchaudio.functional`)."""

    def __init__(self, reason: str, package: str = ""):
        self.reason, self.package = reason, package

    def find_spec(self, fullname, path=None, target=None):
        if self.package and fullname.startswith(self.package + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Unavailable(spec.name, self.reason)

    def exec_module(self, module):
        pass


def _torchaudio_workaround() -> None:
    """PyPI has no torchaudio built against the CPU torch the tests use (the newest there, 2.11, was
    built for torch 2.11), and its C extension then fails to load: "Could not load this library:
    .../_torchaudio.abi3.so". ComfyUI 0.17 never imports torchaudio at load time; from 0.20 on,
    `import comfy.sd` does (comfy/ldm/lightricks/vae/audio_vae.py, comfy/text_encoders/gemma4.py). A
    stand-in package lets ComfyUI load; only its audio models and nodes are lost, which no Kiln test
    uses. A torchaudio that imports is kept."""
    if "torchaudio" in sys.modules:
        return
    try:
        import torchaudio  # noqa: F401

        return
    except (ImportError, OSError) as err:  # OSError: the .so did not load
        _forget("torchaudio")
        reason = f"torchaudio failed to import here ({err})"
        sys.modules["torchaudio"] = _Unavailable("torchaudio", reason)
        sys.meta_path.insert(0, _UnavailableFinder(reason, "torchaudio"))


def _forget(package: str) -> None:
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[name]


def cpu_torch_workarounds() -> None:
    """What ComfyUI needs to start on the CPU torch wheel beside PyPI's torchvision/torchaudio wheels:
    before anything imports ComfyUI, in-process (prepare) and in a server's launcher (comfy_server.py)."""
    _torchvision_workaround()
    _torchaudio_workaround()


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
    cpu_torch_workarounds()
    from comfy.cli_args import (
        args,  # parses no argv unless comfy.options enabled it (main.py only)
    )

    if "comfy.model_management" not in sys.modules:
        # read once, at import of comfy.model_management (as `main.py --cpu`); KILN_COMFY_GPU=1 runs
        # the same tests on the GPU (bench/ and the device checks use it)
        args.cpu = not gpu()
    _prepared = path


def import_pack(submodule: str = ""):
    """This repository as ComfyUI imports a custom-node pack (`kiln_pack.<submodule>`); see trainer/cli/main.py.
    For scripts/ and bench/: the tests import `kiln_pack.<module>` with import statements (tests/conftest.py)."""
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:  # pytest puts it there; a plain script may not
        sys.path.insert(0, root)
    from trainer.cli.main import import_pack as _import

    return _import(submodule)


def gpu() -> bool:
    """KILN_COMFY_GPU=1: let ComfyUI use its GPU instead of forcing the CPU."""
    return os.environ.get("KILN_COMFY_GPU", "") == "1"


def required() -> bool:
    """In CI (CI=true, as CI sets it) or with KILN_REQUIRE_COMFYUI=1 a missing ComfyUI is a failure."""
    return any(
        os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")
        for name in ("CI", "KILN_REQUIRE_COMFYUI")
    )


def require_comfy() -> str:
    """Skip (fail in CI) without COMFYUI_PATH; else prepare ComfyUI (CPU) and return its path."""
    import pytest

    path = comfy_path()
    if path is None:
        if required():
            pytest.fail(f"this test needs ComfyUI and CI must run it: {SKIP_REASON}", pytrace=False)
        pytest.skip(SKIP_REASON, allow_module_level=True)
    prepare(path)
    return path


def version() -> str:
    """The version of the ComfyUI tree in use, e.g. '0.33.0' (its comfyui_version.py)."""
    import comfyui_version

    return comfyui_version.__version__


def at_least(wanted: str) -> bool:
    """The ComfyUI in use is `wanted` (e.g. '0.25') or newer."""

    def parts(text: str) -> tuple[int, ...]:
        return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())

    return parts(version()) >= parts(wanted)
