"""Where the nodes of an example workflow sit on the canvas, and the coloured groups around them.

Pure geometry on UI-format node dicts (scripts/make_workflows.py builds them): no ComfyUI import.

The frontends open a template from the template browser with `fitView()` over the nodes' bounding box at 75 %
of the canvas (both 1.41 and 1.49 ignore the file's `extra.ds` for templates), so the zoom a template opens
at is 0.75 × canvas / bounding box. A template opens readable (scale ≥ 0.75 on a 1400×900 window) only if
its nodes fit in about 1380×880 canvas units: the layout packs the groups in columns and folds (collapses)
the plumbing nodes (encoders, decoders, latents, the 54-widget Training Options), keeping expanded what a
user sets: model files, the dataset, Train LoRA, the LoRA's name, the prompt, the result images.
"""

from __future__ import annotations

from dataclasses import dataclass

TITLE_H = 30  # LiteGraph's node title bar, above a node's `pos`
SLOT_H, WIDGET_H, MULTILINE_H = 20, 24, 54  # the frontends' computeSize: a socket row, a widget, a text box
COL_W, GAP_X = 270, 40  # an expanded node's width (the frontends' default), between two columns
GAP_Y, FOLDED_GAP = 24, 10  # below an expanded node of a group, below a folded one
GROUP_PAD, GROUP_HEAD, GROUP_GAP = 12, 46, 24  # group frame around its nodes; its title bar; between two groups
FONT = 24
VIEW = (1400, 900)  # the window the layout is made for (README's screenshots, the browser test)
NODES_H = 840  # the nodes' height that still opens at 0.75 × 900 / (840 + 20) = 0.78
NOTE_MIN_H = 120
DASHBOARD_W, DASHBOARD_H = 400, 60  # Train LoRA's dashboard: its minimum width, its height when idle (one line)

# Nodes that show an image get room for it (the frontends size them to their widgets only).
IMAGE_HEIGHTS = {"SaveImage": 160, "PreviewImage": 150, "LoadImage": 120}

# Group colours from the frontends' own group palette (LGraphCanvas.node_colors[*].groupcolor).
COLORS = {"models": "#3f789e", "dataset": "#b58b2a", "train": "#a1309b", "save": "#8A8", "test": "#b06634"}


@dataclass
class Box:
    """One group: its title, its colour (a COLORS key), the grid column it starts in, and its nodes as
    columns (left to right) of node ids (top to bottom); one grid column per node column. A Box without a
    title is placed the same way but framed by no group (the About note)."""

    title: str | None
    kind: str
    col: int
    columns: list[list[str]]


def node_size(class_type: str, sockets: int, outputs: int, widgets: int, multiline: int) -> list[int]:
    """A node's size as the frontends compute it (LGraphNode.computeSize), for the width of a grid column;
    `widgets` counts the rows the frontend draws (a seed's control widget, a button an extension adds)."""
    if class_type == "MarkdownNote":
        return [COL_W, NOTE_MIN_H]  # place() stretches it down to what its column has left
    if class_type in IMAGE_HEIGHTS:
        return [COL_W, IMAGE_HEIGHTS[class_type]]
    height = max(sockets, outputs, 1) * SLOT_H + widgets * WIDGET_H + multiline * (MULTILINE_H - WIDGET_H)
    height += 14 if widgets else 6
    if class_type == "CLIPTextEncode":
        height = max(height, 110)
    if class_type == "KilnTrainLoRA":
        return [DASHBOARD_W, height + DASHBOARD_H]
    return [COL_W, height]


def _box_height(node: dict, folded: bool) -> int:
    """Canvas height a node takes, title bar included (a folded node is its title bar)."""
    return TITLE_H if folded else TITLE_H + node["size"][1]


def place(nodes: dict[str, dict], boxes: list[Box], folded: set[str]) -> list[dict]:
    """Set each node's `pos` (and `flags.collapsed` for the folded ones); return the UI format's groups.
    Boxes are packed like a skyline: each starts below whatever is already in the grid columns it spans."""
    placed = [nid for box in boxes for column in box.columns for nid in column]
    if sorted(placed) != sorted(nodes):
        raise ValueError(f"the layout must place every node once; placed {placed}, nodes {sorted(nodes)}")
    widths: dict[int, int] = {}  # a grid column is as wide as its widest expanded node
    for box in boxes:
        for offset, column in enumerate(box.columns):
            for nid in column:
                if nid not in folded:
                    widths[box.col + offset] = max(widths.get(box.col + offset, 0), nodes[nid]["size"][0])
    lefts = [sum(widths.get(c, COL_W) + GAP_X for c in range(col)) for col in range(max(widths) + 2)]
    skyline: dict[int, int] = {}
    groups = []
    for box in boxes:
        span = range(box.col, box.col + len(box.columns))
        top = max((skyline.get(c, 0) for c in span), default=0)
        bottom = top + (GROUP_HEAD if box.title else 0)
        for offset, column in enumerate(box.columns):
            bottom = max(
                bottom,
                _stack(
                    nodes,
                    column,
                    folded,
                    lefts[box.col + offset],
                    widths.get(box.col + offset),
                    top + (GROUP_HEAD if box.title else 0),
                ),
            )
        for c in span:
            skyline[c] = bottom + GROUP_PAD + GROUP_GAP
        if box.title:
            left, right = lefts[box.col] - GROUP_PAD, lefts[span[-1] + 1] - GAP_X + GROUP_PAD
            groups.append(
                {
                    "id": len(groups) + 1,
                    "title": box.title,
                    "bounding": [left, top, right - left, bottom + GROUP_PAD - top],
                    "color": COLORS[box.kind],
                    "font_size": FONT,
                    "flags": {},
                }
            )
    return groups


def _stack(nodes: dict[str, dict], column: list[str], folded: set[str], x: int, width: int | None, y: int) -> int:
    """Place a column's nodes top to bottom from y, expanded ones as wide as the column; the bottom reached."""
    bottom = y
    for nid in column:
        node = nodes[nid]
        node["pos"] = [x, y + TITLE_H]
        if node["type"] == "MarkdownNote":
            node["size"][1] = max(NOTE_MIN_H, GROUP_HEAD + NODES_H - y - TITLE_H)
        if nid in folded:
            node["flags"] = {"collapsed": True}
        elif width:
            node["size"][0] = width
        y += _box_height(node, nid in folded)
        bottom = y
        y += FOLDED_GAP if nid in folded else GAP_Y
    return bottom


def view(nodes: dict[str, dict], groups: list[dict], folded: set[str]) -> dict:
    """extra.ds for a workflow opened from a file (drag and drop, Workflow → Open): the whole graph, groups
    included, in what a VIEW-sized window leaves of the canvas, at most 1:1."""
    rects = [g["bounding"] for g in groups]
    for nid, node in nodes.items():
        x, y = node["pos"]
        rects.append([x, y - TITLE_H, node["size"][0], _box_height(node, nid in folded)])
    left, top = min(r[0] for r in rects), min(r[1] for r in rects)
    right, bottom = max(r[0] + r[2] for r in rects), max(r[1] + r[3] for r in rects)
    # the frontends draw over the canvas: the sidebar on the left, the tabs and toolbars on top
    area_left, area_top, area_right, area_bottom = 70, 100, VIEW[0] - 20, VIEW[1] - 20
    width, height = area_right - area_left, area_bottom - area_top
    scale = min(1.0, width / (right - left), height / (bottom - top))
    offset = [
        (area_left + (width - (right - left) * scale) / 2) / scale - left,
        (area_top + (height - (bottom - top) * scale) / 2) / scale - top,
    ]  # screen = (canvas + offset) × scale
    return {"scale": round(scale, 3), "offset": [round(offset[0], 1), round(offset[1], 1)]}
