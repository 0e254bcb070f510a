"""The sample grid: a run's validation samples in one labelled picture, prompts across, sampling steps down.

`<run>/samples/grid.png` is rewritten (atomically) at each sampling step from every sample so far, so
one look shows how each prompt changed as training went on. Cells are thumbnails (CELL_PX, aspect
kept); the labels are drawn with Pillow's built-in font (nothing downloaded). A resumed run starts its
grid from the sample files already in the folder (`step-NNNNNN-pK.png`, trainer/samples/plan.py; a video
model's `.webp` clips show their first frame).
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_bytes
from . import clips
from .plan import SAMPLES_DIR

GRID_NAME = "grid.png"
CELL_PX = 256  # a cell's longest side
MAX_ROWS = 32  # the newest sampling steps shown; older rows drop off (their files stay)
HEADER_PX = 36  # the prompts' row
LABEL_PX = 96  # the steps' column
GAP_PX = 4
BACKGROUND, INK = (24, 24, 24), (230, 230, 230)
_SAMPLE_FILE = re.compile(r"^step-(\d{6,})-p(\d+)\.(png|webp)$")


def _thumbnail_source(image):
    """A PIL image (an animated one's first frame), or an IMAGE array [H,W,3] in 0..1 (a clip [T,H,W,3]: its
    first frame), as an RGB PIL image."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = image[0] if np.ndim(image) == 4 else image
        pixels = np.clip(255.0 * np.asarray(image, dtype=np.float32), 0, 255).round().astype(np.uint8)
        image = Image.fromarray(pixels)
    return image.convert("RGB")


def _thumbnail(image):
    """A PIL image, or an IMAGE array [H,W,3] in 0..1, as a cell thumbnail."""
    picture = _thumbnail_source(image)
    picture.thumbnail((CELL_PX, CELL_PX))
    return picture


def _fit(draw, text: str, width: int, font) -> str:
    """`text` cut (with …) to fit `width` px in `font`."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "…", font=font) > width:
        text = text[:-1]
    return text + "…"


class SampleGrid:
    """The cells of one run's grid, by step and prompt index; `write` renders and saves it."""

    def __init__(self, run_dir: str | Path, prompts: list[str]):
        self.folder = Path(run_dir) / SAMPLES_DIR
        self.prompts = list(prompts)
        self.cells: dict[int, dict[int, object]] = {}  # step → prompt index → thumbnail

    @property
    def path(self) -> Path:
        return self.folder / GRID_NAME

    def add(self, step: int, index: int, image) -> None:
        if not 0 <= index < len(self.prompts):
            raise ValueError(f"{self.path}: sample {index} has no column (the grid has {len(self.prompts)} prompt(s))")
        self.cells.setdefault(step, {})[index] = _thumbnail(image)

    def load_existing(self) -> SampleGrid:
        """The sample files already in <run>/samples/ (a resumed run's earlier steps)."""
        from PIL import Image

        for path in sorted(self.folder.glob("step-*-p*.*")) if self.folder.is_dir() else []:
            match = _SAMPLE_FILE.match(path.name)
            if match and int(match.group(2)) < len(self.prompts):
                with Image.open(path) as image:
                    self.add(int(match.group(1)), int(match.group(2)), image)
        return self

    def render(self):
        """The grid as a PIL image: a header row of prompts, a column of steps, one row per sampling step."""
        from PIL import Image, ImageDraw, ImageFont

        steps = sorted(self.cells)[-MAX_ROWS:]
        columns = max(len(self.prompts), 1)
        heights = [max((c.height for c in self.cells[s].values()), default=CELL_PX) for s in steps]
        width = LABEL_PX + columns * (CELL_PX + GAP_PX)
        grid = Image.new("RGB", (width, HEADER_PX + sum(h + GAP_PX for h in heights)), BACKGROUND)
        draw, font = ImageDraw.Draw(grid), ImageFont.load_default()
        if len(self.cells) > len(steps):
            draw.text((4, 4), f"newest {len(steps)} of {len(self.cells)}", fill=INK, font=font)
        for column, prompt in enumerate(self.prompts):
            left = LABEL_PX + column * (CELL_PX + GAP_PX)
            draw.text(
                (left + 2, HEADER_PX // 2 - 6),
                _fit(draw, f"{column + 1}. {prompt}", CELL_PX - 4, font),
                fill=INK,
                font=font,
            )
        top = HEADER_PX
        for step, height in zip(steps, heights):
            draw.text(
                (4, top + height // 2 - 6), f"step {step}" + (" (base)" if step == 0 else ""), fill=INK, font=font
            )
            for column, cell in self.cells[step].items():
                left = LABEL_PX + column * (CELL_PX + GAP_PX)
                grid.paste(cell, (left + (CELL_PX - cell.width) // 2, top + (height - cell.height) // 2))
            top += height + GAP_PX
        return grid

    def save_sample(self, step: int, index: int, image) -> Path:
        """A sample without a prompt's settings (a graph's Validation Settings) as its own PNG, atomically; a
        video model's clip ([T,H,W,3]) as an animated WebP of the same name."""
        from .plan import sample_path

        if clips.is_clip(image):
            return clips.save_clip(sample_path(self.folder.parent, step, index, len(self.prompts), ".webp"), image)
        buffer = io.BytesIO()
        _thumbnail_source(image).save(buffer, format="PNG", compress_level=4)
        path = sample_path(self.folder.parent, step, index, len(self.prompts))
        atomic_write_bytes(path, buffer.getvalue())
        return path

    def write(self):
        """Render and save <run>/samples/grid.png atomically; the picture (PIL), for a front end to show."""
        picture, buffer = self.render(), io.BytesIO()
        picture.save(buffer, format="PNG", compress_level=4)
        atomic_write_bytes(self.path, buffer.getvalue())
        return picture
