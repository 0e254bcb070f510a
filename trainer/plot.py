"""Loss curve as a PNG with Pillow alone: raw loss, smoothed loss and learning rate against step."""
from __future__ import annotations

import io
import math
from pathlib import Path

from PIL import Image, ImageDraw

from .atomic import atomic_write_bytes


def smoothed(values: list[float], factor: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average at every point; a NaN/inf value (a skipped step) is passed over."""
    out, average, weight = [], 0.0, 0.0
    for value in values:
        if math.isfinite(value):
            average = factor * average + (1 - factor) * value
            weight = factor * weight + (1 - factor)
        out.append(average / weight if weight else float("nan"))
    return out


def loss_curve(losses: list[float], lrs: list[float] | None = None, *, size=(800, 400), title="loss") -> Image.Image:
    width, height = size
    left, right, top, bottom = 60, 60, 30, 40
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle([left, top, width - right, height - bottom], outline=(180, 180, 180))
    draw.text((left, 8), title, fill=(0, 0, 0))
    finite = [v for v in losses if v == v and abs(v) != float("inf")]
    if not finite:
        draw.text((left + 10, top + 10), "no loss values yet", fill=(120, 120, 120))
        return image
    low, high = min(finite), max(finite)
    high = high if high > low else low + 1e-8
    span_x = max(len(losses) - 1, 1)

    def point(index: int, value: float, lo: float, hi: float) -> tuple[float, float]:
        x = left + (width - left - right) * index / span_x
        y = (height - bottom) - (height - top - bottom) * (value - lo) / (hi - lo)
        return x, y

    for series, colour, line in ((losses, (170, 200, 240), 1), (smoothed(losses), (20, 80, 200), 2)):
        points = [point(i, v, low, high) for i, v in enumerate(series) if v == v and abs(v) != float("inf")]
        if len(points) > 1:
            draw.line(points, fill=colour, width=line)
    if lrs:
        lr_high = max(lrs) or 1.0
        draw.line([point(i, v, 0.0, lr_high) for i, v in enumerate(lrs)], fill=(230, 120, 30), width=1)
        draw.text((width - right + 4, top), f"lr {lr_high:.1e}", fill=(230, 120, 30))
    draw.text((4, top), f"{high:.4g}", fill=(0, 0, 0))
    draw.text((4, height - bottom - 10), f"{low:.4g}", fill=(0, 0, 0))
    draw.text((left, height - bottom + 8), "step 1", fill=(0, 0, 0))
    draw.text((width - right - 60, height - bottom + 8), f"step {len(losses)}", fill=(0, 0, 0))
    return image


def save_loss_curve(path: str | Path, losses: list[float], lrs: list[float] | None = None, **kwargs) -> Path:
    buffer = io.BytesIO()
    loss_curve(losses, lrs, **kwargs).save(buffer, format="PNG")
    atomic_write_bytes(path, buffer.getvalue())
    return Path(path)
