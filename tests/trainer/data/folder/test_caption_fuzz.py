"""Fuzzing captions and file names: text in any encoding (UTF-8, with BOM, UTF-16, Windows-1252) or
random bytes, under random Unicode file names. Nothing escapes as an exception, every file is an item
or named in a problem that says the fix, and a caption that is valid text comes back as written."""

from __future__ import annotations

import codecs
import io
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from trainer.data.folder.scan import scan

_buffer = io.BytesIO()
Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(_buffer, "PNG")
PNG = _buffer.getvalue()

# File names as people make them: spaces, accents, CJK, emoji, dots, dashes; never '/', NUL or a dot first.
name_chars = st.characters(codec="utf-8", exclude_characters="/\\\x00", exclude_categories=("Cs", "Cc"))
stems = st.text(name_chars, min_size=1, max_size=24).filter(
    lambda s: not s.startswith(".") and s.strip() == s and len(s.encode()) < 200
)
printable = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=40)
ENCODINGS = {
    "utf-8": lambda t: t.encode(),
    "utf-8-sig": lambda t: codecs.BOM_UTF8 + t.encode(),
    "utf-16": lambda t: t.encode("utf-16"),
}


@st.composite
def captions(draw) -> tuple[bytes, str | None]:
    """(file bytes, the text the scan must read back, or None when any reading is acceptable)."""
    kind = draw(st.sampled_from([*ENCODINGS, "cp1252", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=60)), None
    text = draw(printable)
    if kind == "cp1252":
        return text.encode("cp1252", errors="replace"), None
    clean = not any(0x7F <= ord(ch) < 0xA0 for ch in text)
    return ENCODINGS[kind](text), text.strip() if clean else None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        stems, st.tuples(st.sampled_from([".png", ".PNG"]), st.one_of(st.none(), captions())), min_size=1, max_size=5
    )
)
def test_captions_and_names_of_any_kind(files):
    with tempfile.TemporaryDirectory() as folder:
        root, written, expected = Path(folder), set(), {}
        for stem, (suffix, caption) in files.items():
            (root / f"{stem}{suffix}").write_bytes(PNG)
            written.add(f"{stem}{suffix}")
            if caption is not None:
                (root / f"{stem}.txt").write_bytes(caption[0])
                written.add(f"{stem}.txt")
                expected[f"{stem}{suffix}"] = caption[1]
        report = scan(root, resolutions=[64], workers=2)
        items = {item.path: item for item in report.items}
        named = {problem.file for problem in report.problems}
        assert set(items) | {i.caption_file for i in items.values() if i.caption_file} | named == written
        for problem in report.problems:
            assert problem.message.strip() and problem.fix.strip() and problem.file in written, problem
        for path, text in expected.items():
            if text is not None and path in items and text != "":
                assert items[path].caption == text, (path, text)
