"""Loss curve as a PNG with Pillow alone (no matplotlib): raw loss, smoothed loss and learning rate against
step, with a legend, axis labels and labelled ticks; curve_layout says where each of them goes."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from ..atomic import atomic_write_bytes


def smoothed(values: list[float], factor: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average at every point; a NaN/inf value (a skipped step) is passed over."""
    out, average, weight = [], 0.0, 0.0
    for value in values:
        if math.isfinite(value):
            average = factor * average + (1 - factor) * value
            weight = factor * weight + (1 - factor)
        out.append(average / weight if weight else float("nan"))
    return out


RAW, SMOOTHED, LEARNING_RATE = (170, 200, 240), (20, 80, 200), (230, 120, 30)
INK, GRID, FRAME = (0, 0, 0), (236, 236, 236), (180, 180, 180)


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round values (1, 2 or 5 x 10^k apart, about `count` of them) that lie in [low, high]."""
    if not high > low:
        return [low]
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    integers = isinstance(low, int) and isinstance(high, int)  # steps: whole numbers only
    step = max(step, 1) if integers else step
    first = math.ceil(low / step - 1e-9)
    ticks = [float(f"{(first + k) * step:.12g}") for k in range(int((high - low) / step + 1e-9) + 2)]
    ticks = [t for t in ticks if low - step * 1e-9 <= t <= high + step * 1e-9]
    return [int(t) for t in ticks] if integers else ticks


def _nice_range(low: float, high: float) -> tuple[float, float]:
    """[low, high] widened to the nearest round ticks, so the axis starts and ends on a labelled value."""
    ticks = nice_ticks(low, high)
    if len(ticks) < 2:
        return low - 0.5 * (abs(low) or 1), high + 0.5 * (abs(high) or 1)
    step = ticks[1] - ticks[0]
    return math.floor(low / step + 1e-9) * step, math.ceil(high / step - 1e-9) * step


@dataclass
class CurveLayout:
    """Where loss_curve draws things, in pixels: what a test (or a caller placing its own labels) reads."""

    box: tuple[int, int, int, int]  # plot area: left, top, right, bottom
    loss_range: tuple[float, float] = (0.0, 1.0)  # the left axis, bottom to top
    lr_range: tuple[float, float] = (0.0, 1.0)  # the right axis, bottom to top
    x_ticks: list[tuple[int, int]] = field(default_factory=list)  # (step, x)
    loss_ticks: list[tuple[float, int]] = field(default_factory=list)  # (loss, y)
    lr_ticks: list[tuple[float, int]] = field(default_factory=list)  # (learning rate, y)
    legend: list[tuple[str, tuple, tuple[int, int, int, int]]] = field(default_factory=list)  # label, colour, swatch
    axis_labels: dict[str, tuple[int, int]] = field(default_factory=dict)  # text -> where it starts

    def x(self, index: int, count: int) -> float:
        left, _, right, _ = self.box
        return left + (right - left) * index / max(count - 1, 1)

    def y(self, value: float, low: float, high: float) -> float:
        _, top, _, bottom = self.box
        return bottom - (bottom - top) * (value - low) / (high - low)


def curve_layout(losses: list[float], lrs: list[float] | None = None, *, size=(800, 400)) -> CurveLayout:
    """The axes, ticks, labels and legend of a loss curve of `losses` (one per step, from step 1)."""
    width, height = size
    has_lr = bool(lrs) and any(_finite(v) for v in lrs)
    left, right, top, bottom = 64, width - (70 if has_lr else 20), 34, height - 62
    layout = CurveLayout(box=(left, top, right, bottom))
    finite = [v for v in losses if _finite(v)]
    if not finite:
        return layout
    layout.loss_range = _nice_range(min(finite), max(finite))
    layout.loss_ticks = [(v, round(layout.y(v, *layout.loss_range))) for v in nice_ticks(*layout.loss_range)]
    layout.x_ticks = [(step, round(layout.x(step - 1, len(losses)))) for step in nice_ticks(1, max(len(losses), 1))]
    series = [("raw loss", RAW), ("smoothed loss", SMOOTHED)]
    layout.axis_labels = {"loss": (4, top - 16), "step": ((left + right) // 2 - 12, bottom + 20)}
    if has_lr:
        layout.lr_range = 0.0, _nice_range(0.0, max(v for v in lrs if _finite(v)) or 1.0)[1]
        layout.lr_ticks = [(v, round(layout.y(v, *layout.lr_range))) for v in nice_ticks(*layout.lr_range)]
        series.append(("learning rate", LEARNING_RATE))
        layout.axis_labels["learning rate"] = (width - 82, top - 16)
    x, font = left, ImageFont.load_default()  # the font ImageDraw.text uses
    for label, colour in series:  # one row under the step label: swatch, label, gap
        layout.legend.append((label, colour, (x, bottom + 40, x + 20, bottom + 46)))
        x += 20 + 6 + math.ceil(font.getlength(label)) + 24
    return layout


def loss_curve(losses: list[float], lrs: list[float] | None = None, *, size=(800, 400), title="loss") -> Image.Image:
    """Raw loss (light), smoothed loss (dark) on the left axis, learning rate on the right, against step."""
    width, height = size
    layout = curve_layout(losses, lrs, size=size)
    left, top, right, bottom = layout.box
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    title_width = draw.textlength(title)
    draw.text(((width - title_width) / 2, 6), title, fill=INK)
    if not layout.loss_ticks:
        draw.rectangle([left, top, right, bottom], outline=FRAME)
        draw.text((left + 10, top + 10), "no loss values yet", fill=(120, 120, 120))
        return image
    for value, y in layout.loss_ticks:
        draw.line([(left, y), (right, y)], fill=GRID)
        label = f"{value:.4g}"
        draw.line([(left - 4, y), (left, y)], fill=INK)
        draw.text((left - 6 - draw.textlength(label), y - 5), label, fill=INK)
    for step, x in layout.x_ticks:
        draw.line([(x, top), (x, bottom)], fill=GRID)
        draw.line([(x, bottom), (x, bottom + 4)], fill=INK)
        draw.text((x - draw.textlength(str(step)) / 2, bottom + 6), str(step), fill=INK)
    for value, y in layout.lr_ticks:
        draw.line([(right, y), (right + 4, y)], fill=LEARNING_RATE)
        draw.text((right + 6, y - 5), f"{value:.2g}", fill=LEARNING_RATE)
    draw.rectangle([left, top, right, bottom], outline=FRAME)
    for series, colour, line in ((losses, RAW, 1), (smoothed(losses), SMOOTHED, 2)):
        points = [
            (layout.x(i, len(losses)), layout.y(v, *layout.loss_range)) for i, v in enumerate(series) if _finite(v)
        ]
        if len(points) > 1:
            draw.line(points, fill=colour, width=line)
    if layout.lr_ticks:
        points = [(layout.x(i, len(lrs)), layout.y(v, *layout.lr_range)) for i, v in enumerate(lrs) if _finite(v)]
        if len(points) > 1:
            draw.line(points, fill=LEARNING_RATE, width=1)
    for text, (x, y) in layout.axis_labels.items():
        draw.text((x, y), text, fill=LEARNING_RATE if text == "learning rate" else INK)
    for label, colour, (x0, y0, x1, y1) in layout.legend:
        draw.rectangle([x0, y0, x1, y1], fill=colour)
        draw.text((x1 + 6, y0 - 3), label, fill=INK)
    return image


def save_loss_curve(path: str | Path, losses: list[float], lrs: list[float] | None = None, **kwargs) -> Path:
    buffer = io.BytesIO()
    loss_curve(losses, lrs, **kwargs).save(buffer, format="PNG")
    atomic_write_bytes(path, buffer.getvalue())
    return Path(path)
