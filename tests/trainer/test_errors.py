"""Kiln's exceptions as a user meets them (trainer/errors.py): named `kiln.<Class>`, not by the file path under
which ComfyUI imports the pack, and "did you mean" hints in the messages."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from trainer.errors import KilnError, did_you_mean

ROOT = Path(__file__).resolve().parents[2]


def comfy_type_name(klass: type) -> str:
    """What ComfyUI's execution error shows as exception_type (module + qualified name, bare for builtins)."""
    return klass.__qualname__ if klass.__module__ == "builtins" else f"{klass.__module__}.{klass.__qualname__}"


def exception_classes() -> list[tuple[str, str, list[str]]]:
    """(module, class, base names) of every class in trainer/ whose name says it is an error."""
    found = []
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Exception")):
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                found.append((module, node.name, [ast.unparse(b) for b in node.bases]))
    return found


def test_every_trainer_exception_is_named_kiln_dot_class():
    classes = exception_classes()
    assert len(classes) >= 6, classes  # ConfigError, TargetError, SafetensorsError, DatasetError, ...
    for module, name, _ in classes:
        klass = getattr(importlib.import_module(module), name)
        assert issubclass(klass, KilnError) and issubclass(klass, ValueError), (module, name)
        assert comfy_type_name(klass) == f"kiln.{name}", (module, comfy_type_name(klass))


def test_an_exception_keeps_its_message_and_is_caught_as_value_error():
    from trainer.config import ConfigError, from_dict

    try:
        from_dict({"rnak": 4})
    except ValueError as error:
        assert type(error) is ConfigError and "did you mean 'rank'" in str(error), error
    else:
        raise AssertionError("a misspelt key was accepted")


def test_did_you_mean_names_the_closest_candidates():
    assert did_you_mean("my_charcter", ["my_character", "my_style", "people"]) == "; did you mean 'my_character'?"
    assert (
        did_you_mean("styl", ["style", "styles", "stale", "people"]) == "; did you mean 'style', 'styles' or 'stale'?"
    )
    assert did_you_mean("zzz", ["my_character"]) == ""
    assert did_you_mean("x", []) == ""
