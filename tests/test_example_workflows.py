"""The example workflows as the template browser shows them, read from the files (no ComfyUI): each named by
its title with its picture beside it, in coloured groups that hold every node, none over another, small
enough to open readable. tests/nodes/test_saved_workflows.py checks the same in ComfyUI's own frontends.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "example_workflows"
TITLE_H = 30  # LiteGraph's title bar, above a node's pos


def _make_workflows():
    """scripts/make_workflows.py as a module (as tests/helpers/comfy_server.py loads it; no ComfyUI import)."""
    if "kiln_make_workflows" in sys.modules:
        return sys.modules["kiln_make_workflows"]
    spec = importlib.util.spec_from_file_location("kiln_make_workflows", REPO / "scripts" / "make_workflows.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


mw = _make_workflows()
TITLES = sorted(mw.TEMPLATE_TITLES.values())


def rect(node: dict) -> list[float]:
    (x, y), (w, h) = node["pos"], node["size"]
    if node.get("flags", {}).get("collapsed"):
        return [x, y - TITLE_H, 100, TITLE_H]  # at least this much of a folded node's title
    return [x, y - TITLE_H, w, h + TITLE_H]


def test_every_example_is_named_by_its_title():
    assert sorted(p.stem for p in EXAMPLES.glob("*.json")) == TITLES
    assert sorted(p.stem for p in (EXAMPLES / "api").glob("*.json")) == TITLES
    for title in TITLES:  # 1.41 prints the name again with '_' and '-' as spaces; no ':' on Windows
        assert "_" not in title and ":" not in title and len(title) <= 30, title


@pytest.mark.parametrize("title", TITLES)
def test_each_example_has_its_picture(title):
    path = EXAMPLES / f"{title}.jpg"
    assert 5_000 < path.stat().st_size < 100_000
    with Image.open(path) as picture:
        assert (picture.format, picture.size) == ("JPEG", (512, 512))


@pytest.mark.parametrize("title", TITLES)
def test_each_example_opens_readable_in_its_groups(title):
    workflow = json.loads((EXAMPLES / f"{title}.json").read_text(encoding="utf-8"))
    groups = workflow["groups"]
    assert {g["title"].split(" ")[1].rstrip(":") for g in groups if g["title"][0].isdigit()} >= {
        "Models",
        "Dataset",
        "Train",
        "Save",
    }
    assert all(g["color"] in mw.wl.COLORS.values() for g in groups)
    nodes = [(n.get("title") or n["type"], rect(n)) for n in workflow["nodes"]]
    for name, box in nodes:
        inside = [
            g["title"]
            for g in groups
            if g["bounding"][0] <= box[0]
            and g["bounding"][1] <= box[1]
            and box[0] + box[2] <= g["bounding"][0] + g["bounding"][2]
            and box[1] + box[3] <= g["bounding"][1] + g["bounding"][3]
        ]
        assert len(inside) == (0 if name == "About this workflow" else 1), (name, inside)
    for i, (name, a) in enumerate(nodes):
        for other, b in nodes[i + 1 :]:
            assert not (a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]), (
                name,
                other,
            )
    # the template browser fits the nodes (plus 10 each side) into 75 % of the window: ≥ 0.75 on 1400×900
    width = max(b[0] + b[2] for _, b in nodes) - min(b[0] for _, b in nodes) + 20
    height = max(b[1] + b[3] for _, b in nodes) - min(b[1] for _, b in nodes) + 20
    assert min(0.75 * 1400 / width, 0.75 * 900 / height) >= 0.75, (width, height)
    assert 0.8 <= workflow["extra"]["ds"]["scale"] <= 1  # a file dropped on the canvas opens at its extra.ds
