"""Fuzzing the scanner: random bytes named as images and captions never escape as an exception,
and every file comes back as an Item (image or caption) or named in a Problem."""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from trainer.data.folder.scan import scan


def _encoded(fmt: str) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 255, (72, 80, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt)
    return buffer.getvalue()


REAL = [_encoded(fmt) for fmt in ("PNG", "JPEG", "WEBP")]


@st.composite
def image_bytes(draw) -> bytes:
    """Pure noise, or a real image cut short or with a span overwritten: the damage a dataset meets."""
    kind = draw(st.sampled_from(["noise", "cut", "overwrite", "intact"]))
    if kind == "noise":
        return draw(st.binary(max_size=300))
    real = draw(st.sampled_from(REAL))
    if kind == "cut":
        return real[: draw(st.integers(0, len(real)))]
    if kind == "overwrite":
        start = draw(st.integers(0, len(real) - 1))
        return real[:start] + draw(st.binary(min_size=1, max_size=64)) + real[start + 64 :]
    return real


names = st.sampled_from(["a", "b", "sub/c", "3_rep/d", "3_rep/deeper/e"])
images = st.dictionaries(st.tuples(names, st.sampled_from([".png", ".jpg", ".webp"])), image_bytes(), max_size=6)
captions = st.dictionaries(names, st.one_of(st.binary(max_size=40), st.text(max_size=20).map(str.encode)), max_size=5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(images, captions)
def test_every_file_is_accounted_for(image_files, caption_files):
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        written = set()
        for (stem, suffix), data in image_files.items():
            written.add(_write(root, stem + suffix, data))
        for stem, data in caption_files.items():
            written.add(_write(root, stem + ".txt", data))
        reports = [scan(root, resolutions=[64], workers=2), scan(root, deep=True, resolutions=[64], workers=2)]
        for report in reports:
            used = {item.path for item in report.items} | {i.caption_file for i in report.items if i.caption_file}
            named = {problem.file for problem in report.problems} - {""}
            assert used | named == written
            skipped = {problem.file for problem in report.skipped}
            assert not skipped & {item.path for item in report.items}
            assert report.ok == bool(report.items)
        fast, deep = ({item.path for item in report.items} for report in reports)
        assert deep <= fast  # the deep scan is the stricter one


def _write(root: Path, rel: str, data: bytes) -> str:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return rel
