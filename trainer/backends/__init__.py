"""Backends are imported lazily here and nowhere else (MLX is optional)."""

from __future__ import annotations

import importlib

_BACKENDS = {
    "torch": (".torch_backend.backend", "TorchBackend"),
    "mlx": (".mlx_backend.backend", "MlxBackend"),
}

_INSTALL_HINT = {
    "torch": "install PyTorch (ComfyUI brings it)",
    "mlx": "install MLX: pip install 'kiln-lora[mlx]' (Apple Silicon), or 'mlx[cpu]' on Linux",
}


def get_backend(name: str):
    """A fresh backend instance by name ("torch" or "mlx")."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {list(_BACKENDS)}")
    module_name, class_name = _BACKENDS[name]
    try:
        # Relative: inside ComfyUI this package is `<pack folder>.trainer.backends`, not `trainer.backends`.
        module = importlib.import_module(module_name, __package__)
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in ("torch", "mlx"):
            raise RuntimeError(f"backend {name!r} needs {err.name}: {_INSTALL_HINT[name]}") from err
        if err.name == f"{__package__}{module_name.rsplit('.', 1)[0]}":
            raise RuntimeError(f"backend {name!r} is not part of this Kiln version yet; use backend 'torch'") from err
        raise
    return getattr(module, class_name)()
