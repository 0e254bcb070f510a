"""The size budget of Kiln's code, read on the formatted files (`ruff format --check` holds the layout).

    python scripts/check_shape.py          prints each file or function over its folder's budget; exit 1 if any

The library and the nodes keep to 400 lines a file and 60 a function: past that a module holds two concepts
and a function two steps. The benchmark harnesses and the build scripts get a stated larger budget: each is one
long recipe read top to bottom (a GPU run's rows, a workflow's nodes), and splitting it would scatter the recipe.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = {  # folder: (lines per file, lines per function)
    "trainer": (400, 60),
    "nodes": (400, 60),
    "bench": (2000, 200),
    "scripts": (1200, 120),
}


def over_budget(root: Path = ROOT, budgets: dict[str, tuple[int, int]] = BUDGETS) -> list[str]:
    """One line per file or function over its folder's budget, e.g. "trainer/x.py:12 train: 75 lines > 60"."""
    found = []
    for folder, (file_lines, function_lines) in budgets.items():
        for path in sorted((root / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            text = path.read_text(encoding="utf-8")
            name = path.relative_to(root).as_posix()
            if (count := len(text.splitlines())) > file_lines:
                found.append(f"{name}: {count} lines > {file_lines}")
            for node in ast.walk(ast.parse(text, filename=name)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > function_lines:
                        found.append(f"{name}:{node.lineno} {node.name}: {length} lines > {function_lines}")
    return found


def main() -> int:
    found = over_budget()
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} over budget: split by concept (a module per concept, a function per step)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
