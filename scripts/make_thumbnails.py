#!/usr/bin/env python3
"""Draw the template browser's picture of each example workflow: example_workflows/<title>.jpg.

Both ComfyUI frontends show a custom-node template with `<file name>.jpg` from beside its `.json` (served at
/api/workflow_templates/<pack>/<file name>.jpg) and a placeholder without one. Each picture is the workflow's
own map, drawn from its UI file: the coloured groups with their names, the nodes (folded ones as title bars)
and the links in ComfyUI's link colours; the card prints the title under it. A map rather than a canvas
screenshot: at card size (256 px) a screenshot's text is unreadable, the groups still are.

    python scripts/make_thumbnails.py            # (re)draw every picture; needs only Pillow
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from PIL import Image, ImageColor, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "example_workflows"
SIZE, MARGIN, HEADER, FOOTER = 512, 16, 72, 48  # square, as both frontends' cards show it
BACKGROUND, NODE, NODE_EDGE, TEXT, MUTED = "#161618", "#2c2c30", "#4a4a50", "#f2f2f2", "#9a9aa2"
TITLE_H = 30  # LiteGraph's node title bar, above `pos`
# ComfyUI's default link colours by type (its dark palette); other types are grey.
LINK_COLORS = {
    "MODEL": "#B39DDB",
    "CLIP": "#FFD500",
    "VAE": "#FF6E6E",
    "LATENT": "#FF9CF9",
    "IMAGE": "#64B5F6",
    "CONDITIONING": "#FFA931",
    "MASK": "#81C784",
}
FONT_FILES = (
    "DejaVuSans-Bold.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf",
    "/Library/Fonts/Arial Bold.ttf",
    "C:/Windows/Fonts/arialbd.ttf",
)


def font(size: int) -> ImageFont.ImageFont:
    for name in FONT_FILES:
        try:
            return ImageFont.truetype(name, size)
        except OSError:
            continue
    return ImageFont.load_default(size)  # Pillow's own scalable font


def node_rects(workflow: dict) -> dict[int, tuple[list[float], bool, str]]:
    """id → ([x, y, w, h] on the canvas, title bar included; folded?; fill colour)."""
    rects = {}
    for node in workflow["nodes"]:
        (x, y), (w, h) = node["pos"], node["size"]
        folded = bool(node.get("flags", {}).get("collapsed"))
        rect = [x, y - TITLE_H, min(w, 200) if folded else w, TITLE_H if folded else h + TITLE_H]
        rects[node["id"]] = (rect, folded, node.get("bgcolor", NODE))
    return rects


def draw_map(image: Image.Image, workflow: dict, box: tuple[int, int, int, int]) -> None:
    """The workflow's groups, nodes and links, scaled into box (left, top, right, bottom)."""
    rects = node_rects(workflow)
    spans = [g["bounding"] for g in workflow["groups"]] + [r for r, _, _ in rects.values()]
    left, top = min(s[0] for s in spans), min(s[1] for s in spans)
    right, bottom = max(s[0] + s[2] for s in spans), max(s[1] + s[3] for s in spans)
    scale = min((box[2] - box[0]) / (right - left), (box[3] - box[1]) / (bottom - top))
    dx = box[0] + ((box[2] - box[0]) - (right - left) * scale) / 2 - left * scale
    dy = box[1] + ((box[3] - box[1]) - (bottom - top) * scale) / 2 - top * scale

    def at(x: float, y: float) -> tuple[float, float]:
        return x * scale + dx, y * scale + dy

    layer = Image.new("RGBA", image.size, (0, 0, 0, 0))
    draw = ImageDraw.Draw(layer)
    for group in workflow["groups"]:
        x, y, w, h = group["bounding"]
        color = ImageColor.getrgb(group["color"])[:3]
        draw.rounded_rectangle([*at(x, y), *at(x + w, y + h)], radius=5, fill=(*color, 90), outline=(*color, 255))
    for link in workflow["links"]:
        _, origin, out_slot, target, in_slot, kind = link
        (ox, oy, ow, _), o_folded, _ = rects[origin]
        (tx, ty, _, _), t_folded, _ = rects[target]
        start = at(ox + ow, oy + (15 if o_folded else TITLE_H + 10 + 20 * out_slot))
        end = at(tx, ty + (15 if t_folded else TITLE_H + 10 + 20 * in_slot))
        draw.line(bezier(start, end), fill=LINK_COLORS.get(kind, "#888888"), width=2)
    for (x, y, w, h), folded, fill in rects.values():
        draw.rounded_rectangle([*at(x, y), *at(x + w, y + h)], radius=3 if folded else 4, fill=fill, outline=NODE_EDGE)
        if not folded:  # the title bar
            draw.line([at(x, y + TITLE_H), at(x + w, y + TITLE_H)], fill=NODE_EDGE)
    label = font(13)
    for group in workflow["groups"]:  # names last, over the nodes' tops: the group's title bar is that thin
        x, y = at(*group["bounding"][:2])
        text, room = group["title"], group["bounding"][2] * scale - 8
        while len(text) > 1 and draw.textlength(text, font=label) > room:
            text = text[:-2] + "…"
        draw.text((x + 4, y + 1), text, font=label, fill=TEXT, stroke_width=2, stroke_fill=BACKGROUND)
    image.alpha_composite(layer)


def bezier(start, end, steps: int = 24) -> list[tuple[float, float]]:
    """LiteGraph's spline link: horizontal tangents at both ends."""
    (x0, y0), (x3, y3) = start, end
    bend = max(abs(x3 - x0) * 0.5, 12)
    x1, x2 = x0 + bend, x3 - bend
    points = []
    for i in range(steps + 1):
        t = i / steps
        a, b, c, d = (1 - t) ** 3, 3 * (1 - t) ** 2 * t, 3 * (1 - t) * t * t, t**3
        points.append((a * x0 + b * x1 + c * x2 + d * x3, a * y0 + b * y0 + c * y3 + d * y3))
    return points


def thumbnail(workflow: dict) -> Image.Image:
    """The map, under a band the frontend 1.49 covers with its "Node graph" badge; the card prints the title."""
    image = Image.new("RGBA", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    draw_map(image, workflow, (MARGIN, HEADER, SIZE - MARGIN, SIZE - FOOTER))
    face = font(20)
    label = "Kiln · LoRA training"
    draw.text(((SIZE - draw.textlength(label, font=face)) / 2, SIZE - FOOTER + 12), label, font=face, fill=MUTED)
    return image.convert("RGB")


def main() -> int:
    files = sorted(EXAMPLES.glob("*.json"))
    if not files:
        print(f"no workflows in {EXAMPLES}", file=sys.stderr)
        return 1
    for path in files:
        workflow = json.loads(path.read_text(encoding="utf-8"))
        target = path.with_suffix(".jpg")
        thumbnail(workflow).save(target, "JPEG", quality=82, optimize=True, progressive=True)
        print(f"wrote {target.relative_to(ROOT)} ({target.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
