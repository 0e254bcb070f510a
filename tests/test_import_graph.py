"""The shape of the code (docs/architecture.md): the import graph of trainer/ and nodes/, read with `ast` (imports
inside functions included), has no circles; no module imports another module's private name; the pack root
(headless.py, the pack's __init__) is reached from trainer/cli/ alone; the trainer never reaches nodes/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "nodes")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    found["headless"] = ROOT / "headless.py"
    found[""] = ROOT / "__init__.py"
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of a module of the pack in the file.
    `from pkg import mod` counts as importing pkg.mod; `from mod import name` as importing mod (name recorded)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if name == "":
        package = []
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            for alias in node.names:
                child = f"{target}.{alias.name}" if target else alias.name
                if child in known:
                    found.append((child, None, node.lineno))
                else:
                    found.append((target, alias.name, node.lineno))
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for target, _, _ in imports(name, path, known):
            if target in known and target != name:
                edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert cycles(graph()) == []


def test_no_private_names_cross_modules():
    known = modules()
    crossing = [
        f"{name}:{line} imports {target}.{imported}"
        for name, path in known.items()
        for target, imported, line in imports(name, path, known)
        if imported and imported.startswith("_") and not imported.startswith("__") and target != name
    ]
    assert crossing == []


def test_pack_root_reached_from_trainer_cli_only():
    edges = graph()
    reaching = sorted(
        name
        for name, targets in edges.items()
        if targets & {"headless", ""} and not name.startswith("trainer.cli") and name not in ("", "headless")
    )
    assert reaching == []


def test_trainer_never_imports_nodes():
    edges = graph()
    assert (
        sorted(
            f"{n} -> {t}"
            for n, targets in edges.items()
            if n.startswith("trainer")
            for t in targets
            if t.startswith("nodes") or t in ("", "headless") and not n.startswith("trainer.cli")
        )
        == []
    )
