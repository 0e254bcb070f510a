"""The flat layout's import paths (before the sub-packages, 2026-11-28), kept for one release.

`import trainer.lora_format` (or `from trainer import lora_format`) still works: it gives a module that forwards
every name to where it lives now, with one DeprecationWarning naming the new path. Another pack, a script or a
notebook written against the old layout keeps running while it moves. Remove after the next release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

# old module (relative to trainer) → the module that holds its names now
MOVED = {
    "adapter_files": "lora.adapter_files",
    "adapters": "lora.adapters",
    "companion_batch": "data.companion_batch",
    "config_checks": "config.checks",
    "config_file": "config.files",
    "console": "cli.console",
    "data.captioners": "data.captioning.models",
    "data.editing": "data.folder.editing",
    "data.images": "data.folder.images",
    "data.meta": "data.folder.meta",
    "data.quality": "data.folder.quality",
    "data.report": "data.folder.report",
    "data.review": "data.folder.review",
    "data.scan": "data.folder.scan",
    "data.uploads": "data.folder.uploads",
    "distributed": "run.distributed",
    "estimate_common": "estimate.common",
    "estimate_mlx": "estimate.mlx_step",
    "faults": "run.faults",
    "holdout": "run.holdout",
    "init_lora": "run.init_lora",
    "launch": "cli.launch",
    "logging_sinks": "run.sinks",
    "loop": "run.loop",
    "lora_cli": "cli.lora_commands",
    "lora_extract": "lora.extract",
    "lora_format": "lora.files",
    "lora_report": "lora.report",
    "lora_sources": "lora.sources",
    "lora_tools": "lora.tools",
    "pause": "run.pause",
    "plot": "run.plot",
    "preservation": "objective.preservation",
    "sample_grid": "samples.grid",
    "schedules": "objective.schedules",
    "state": "run.state",
    "targets": "lora.targets",
    "tiny_dit": "demo.tiny_dit",
    "tiny_weights": "demo.tiny_weights",
}
# names that left the module MOVED or PACKAGES sends them to: old module → {name: the module that holds it now}
ALSO = {
    "adapter_files": {"describe": "lora.report"},
    "data.scan": {"REPEAT_FOLDER": "data.folder.walk"},
    "lora_sources": {"convert_file": "lora.files"},
    "state": {"save_checkpoint": "run.checkpoint_writer"},
    "estimate": {"advice": "estimate.torch_advice", "RULES": "estimate.torch_advice"},
}
# old modules whose name is now a package's: the package forwards their names to this module of its own
PACKAGES = {"estimate": "torch_step", "objective": "flow", "demo": "run", "data.captioning": "jobs", "samples": "plan"}


def forward(package: str, old: str):
    """The module-level __getattr__ (PEP 562) of the package that took the old module `old`'s name: the names
    that module held, from the package's module PACKAGES[old]."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in ALSO.get(old, {}):  # a name that left the module PACKAGES names
            return getattr(importlib.import_module(f"{package[: -len(old)]}{ALSO[old][name]}"), name)
        return getattr(importlib.import_module(f"{package}.{PACKAGES[old]}"), name)

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: str):
        self.root = root  # the trainer package's name: `trainer`, or `<pack>.trainer` inside ComfyUI

    def find_spec(self, fullname, path=None, target=None):
        old = fullname[len(self.root) + 1 :] if fullname.startswith(self.root + ".") else ""
        return importlib.util.spec_from_loader(fullname, self) if old in MOVED else None

    def create_module(self, spec):
        old = spec.name[len(self.root) + 1 :]
        new = f"{self.root}.{MOVED[old]}"
        warnings.warn(
            f"{spec.name} moved to {new}; the old path goes in the next release", DeprecationWarning, stacklevel=2
        )
        module = types.ModuleType(spec.name, f"The old path of {new} (trainer/moved.py).")
        target, extra = importlib.import_module(new), ALSO.get(old, {})

        def __getattr__(name: str):
            if name in extra:
                return getattr(importlib.import_module(f"{self.root}.{extra[name]}"), name)
            return getattr(target, name)

        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


def install(root: str) -> None:
    """The old paths under the trainer package `root`, once per process."""
    if not any(isinstance(finder, _Finder) and finder.root == root for finder in sys.meta_path):
        sys.meta_path.append(_Finder(root))
