"""trainer/run/plot.py: the loss curve a run writes as loss.png, legend, axis labels and ticks included."""

import math

from PIL import Image

from trainer.run.plot import curve_layout, loss_curve, nice_ticks, save_loss_curve

LOSSES = [0.9 - 0.004 * i + 0.05 * math.sin(i) for i in range(200)]
LRS = [1e-4 * min(1.0, (i + 1) / 20) for i in range(200)]
WHITE = (255, 255, 255)


def test_nice_ticks_are_round_numbers_covering_the_range():
    assert nice_ticks(0.0, 1.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(1, 200) == [50, 100, 150, 200]
    assert nice_ticks(0.0, 1e-4) == [0.0, 2e-5, 4e-5, 6e-5, 8e-5, 1e-4]
    assert nice_ticks(3.0, 3.0) == [3.0]
    assert nice_ticks(1, 3) == [1, 2, 3]  # steps stay whole


def test_layout_names_the_series_and_the_axes():
    layout = curve_layout(LOSSES, LRS)
    assert [label for label, _, _ in layout.legend] == ["raw loss", "smoothed loss", "learning rate"]
    assert set(layout.axis_labels) == {"step", "loss", "learning rate"}
    assert [step for step, _ in layout.x_ticks] == [50, 100, 150, 200]
    values = [value for value, _ in layout.loss_ticks]
    assert values[0] <= min(LOSSES) and values[-1] >= max(LOSSES) and len(values) >= 3
    assert [value for value, _ in layout.lr_ticks][-1] >= max(LRS)
    left, top, right, bottom = layout.box
    assert all(left <= x <= right for _, x in layout.x_ticks)
    assert all(top <= y <= bottom for _, y in layout.loss_ticks + layout.lr_ticks)
    # higher values sit higher on the image
    assert [y for _, y in layout.loss_ticks] == sorted((y for _, y in layout.loss_ticks), reverse=True)


def test_without_learning_rates_there_is_no_second_axis():
    layout = curve_layout(LOSSES, None)
    assert [label for label, _, _ in layout.legend] == ["raw loss", "smoothed loss"]
    assert layout.lr_ticks == [] and "learning rate" not in layout.axis_labels


def test_image_has_legend_swatches_and_tick_labels_where_the_layout_says():
    layout = curve_layout(LOSSES, LRS)
    image = loss_curve(LOSSES, LRS)
    for label, colour, (x0, y0, x1, y1) in layout.legend:
        assert image.getpixel(((x0 + x1) // 2, (y0 + y1) // 2)) == colour, label
    left, top, right, bottom = layout.box

    def inked(x0, y0, x1, y1):
        return any(image.getpixel((x, y)) != WHITE for x in range(x0, x1) for y in range(y0, y1))

    for step, x in layout.x_ticks:  # a label under each step tick
        assert inked(x - 8, bottom + 5, x + 8, bottom + 16), step
    for value, y in layout.loss_ticks:  # a label left of each loss tick
        assert inked(4, y - 4, left - 4, y + 4), value
    for value, y in layout.lr_ticks:  # and right of each learning-rate tick
        assert inked(right + 4, y - 4, image.width - 4, y + 4), value


def test_png_still_writes(tmp_path):
    path = save_loss_curve(tmp_path / "loss.png", LOSSES, LRS, title="run: loss")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Image.open(path).size == (800, 400)
    empty = save_loss_curve(tmp_path / "empty.png", [float("nan")], None)
    assert Image.open(empty).size == (800, 400)
