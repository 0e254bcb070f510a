"""The sample grid (trainer/samples/grid.py): prompts across, sampling steps down, labelled, written atomically."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from trainer.samples import grid as sample_grid
from trainer.samples.grid import CELL_PX, GAP_PX, HEADER_PX, LABEL_PX, SampleGrid
from trainer.samples.plan import sample_path


def solid(value: float, height: int = 64, width: int = 64) -> np.ndarray:
    return np.full((height, width, 3), value, np.float32)


def test_grid_has_a_column_per_prompt_a_row_per_step_and_labels(tmp_path):
    grid = SampleGrid(tmp_path, ["a photo of ohwx", "ohwx in a garden"])
    for step, shade in ((0, 0.2), (250, 0.5), (500, 0.9)):
        for index in range(2):
            grid.add(step, index, solid(shade + 0.05 * index))
    picture = grid.write()
    assert grid.path == tmp_path / "samples" / "grid.png" and grid.path.is_file()
    assert not list(grid.path.parent.glob(".*"))  # no temp file left
    with Image.open(grid.path) as saved:
        # a row is as tall as its tallest sample (64 px here: never upscaled), a column CELL_PX wide
        assert saved.size == (LABEL_PX + 2 * (CELL_PX + GAP_PX), HEADER_PX + 3 * (64 + GAP_PX))
        assert np.array_equal(np.asarray(saved), np.asarray(picture))
    pixels = np.asarray(picture)
    # cell (row 1 = step 250, column 1): the 64 px sample centred in its column
    top, left = HEADER_PX + (64 + GAP_PX), LABEL_PX + (CELL_PX + GAP_PX)
    centre = pixels[top + 32, left + CELL_PX // 2]
    assert np.array_equal(centre, [round(255 * 0.55)] * 3)  # its pixels, as they were
    assert np.array_equal(pixels[top + 2, left + 2], sample_grid.BACKGROUND)  # outside the 64 px sample

    # labels are drawn (Pillow's own font, maybe anti-aliased): the header and the step column hold ink
    def inked(region) -> bool:
        return bool((region.max(axis=-1) > max(sample_grid.BACKGROUND) + 100).any())

    assert inked(pixels[:HEADER_PX, LABEL_PX : LABEL_PX + CELL_PX])
    for row in range(3):
        band = pixels[HEADER_PX + row * (64 + GAP_PX) : HEADER_PX + (row + 1) * (64 + GAP_PX), :LABEL_PX]
        assert inked(band)


def test_step_labels_differ_by_step(tmp_path):
    """The label column says which step a row is: two grids that differ only in their steps differ there."""
    pictures = []
    for step in (10, 20):
        grid = SampleGrid(tmp_path / str(step), ["p"])
        grid.add(step, 0, solid(0.5))
        pictures.append(np.asarray(grid.render()))
    assert not np.array_equal(pictures[0][:, :LABEL_PX], pictures[1][:, :LABEL_PX])
    assert np.array_equal(pictures[0][:, LABEL_PX:], pictures[1][:, LABEL_PX:])


def test_a_resumed_run_starts_from_the_sample_files_and_old_rows_drop_off(tmp_path, monkeypatch):
    first = SampleGrid(tmp_path, ["one", "two"])
    for step in (100, 200):
        for index in range(2):
            first.save_sample(step, index, solid(0.3))
    assert sample_path(tmp_path, 100, 1, 2).is_file()
    again = SampleGrid(tmp_path, ["one", "two"]).load_existing()
    assert sorted(again.cells) == [100, 200] and sorted(again.cells[200]) == [0, 1]
    monkeypatch.setattr(sample_grid, "MAX_ROWS", 1)
    assert again.render().height == HEADER_PX + 64 + GAP_PX  # the newest row only


def test_a_sample_without_a_column_is_refused(tmp_path):
    with pytest.raises(ValueError, match="sample 2 has no column"):
        SampleGrid(tmp_path, ["a", "b"]).add(0, 2, solid(0.1))


def test_tall_samples_keep_their_aspect(tmp_path):
    grid = SampleGrid(tmp_path, ["tall"])
    grid.add(1, 0, solid(1.0, height=512, width=256))
    cell = grid.cells[1][0]
    assert (cell.width, cell.height) == (CELL_PX // 2, CELL_PX)


def test_a_clip_is_saved_as_an_animated_webp_and_read_back_as_its_first_frame(tmp_path):
    """A video model's sample [T,H,W,3] goes where a PNG would, as an animated WebP; a resumed grid reads it."""
    rng = np.random.default_rng(0)
    clip = rng.random((5, 24, 40, 3), dtype=np.float32)
    grid = SampleGrid(tmp_path, ["a", "b"])
    path = grid.save_sample(250, 1, clip)
    assert path == tmp_path / "samples" / "step-000250-p1.webp"
    with Image.open(path) as saved:
        assert (saved.n_frames, saved.size, saved.is_animated) == (5, (40, 24), True)
    assert grid.save_sample(250, 0, clip[0]).suffix == ".png"  # one frame is an image
    assert set(SampleGrid(tmp_path, ["a", "b"]).load_existing().cells[250]) == {0, 1}
