"""Caption Images' library side with a fake engine: which images get a .txt, .bak for overwritten captions,
trigger words, styles, resume after a crash or a stop, and bad files skipped and reported."""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainer.data.captioning.jobs import (
    JOURNAL,
    STYLES,
    CaptionJob,
    caption_folder,
    plan,
)


def image(root: Path, rel: str, caption: str | None = None, size=(80, 72)) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(zlib.crc32(rel.encode()))
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


class Engine:
    """caption(image, prompt): 'a picture <w>x<h>' (or what `answer` gives); records each call."""

    def __init__(self, answer=None, fail_on: int | None = None):
        self.calls: list[tuple[tuple[int, int], str]] = []
        self.answer, self.fail_on = answer, fail_on

    def __call__(self, picture, prompt):
        assert isinstance(picture, Image.Image) and picture.mode == "RGB"
        if self.fail_on is not None and len(self.calls) == self.fail_on:
            raise RuntimeError("out of memory")
        self.calls.append((picture.size, prompt))
        return self.answer(picture) if self.answer else f"a picture {picture.width}x{picture.height}"


def txt(root: Path, rel: str) -> str:
    return (root / rel).read_text(encoding="utf-8")


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.name.endswith(".tmp"))


def test_writes_a_caption_only_where_there_is_none(tmp_path):
    image(tmp_path, "a.png")
    image(tmp_path, "b.png", caption="my own words")
    image(tmp_path, "10_set/c.jpg", size=(64, 96))
    image(tmp_path, "d.png", caption="  \n")  # empty: counts as none, replaced without a .bak
    engine = Engine()
    report = caption_folder(tmp_path, engine, CaptionJob(trigger_word="zkw"))
    assert sorted(report.written) == ["10_set/c.txt", "a.txt", "d.txt"]
    assert report.kept == ["b.png"] and report.backups == []
    assert txt(tmp_path, "a.txt") == "zkw, a picture 80x72\n"
    assert txt(tmp_path, "10_set/c.txt") == "zkw, a picture 64x96\n"
    assert txt(tmp_path, "b.txt") == "my own words"
    assert not list(tmp_path.rglob("*.bak")) and leftovers(tmp_path) == []
    assert [prompt for _, prompt in engine.calls] == [STYLES["short"].prompt] * 3
    assert "3 captions written" in report.text() and "1 image(s) already captioned" in report.text()


def test_overwrite_keeps_every_old_caption_as_bak(tmp_path):
    image(tmp_path, "a.png", caption="hand written")
    job = CaptionJob(overwrite=True, prompt="Say what you see.")
    first = caption_folder(tmp_path, Engine(lambda _: "first words"), job)
    assert first.written == ["a.txt"] and first.backups == ["a.txt.bak"]
    assert txt(tmp_path, "a.txt.bak") == "hand written" and txt(tmp_path, "a.txt") == "first words\n"
    second = caption_folder(tmp_path, Engine(lambda _: "second words"), job)
    assert second.backups == ["a.txt.2.bak"]
    assert txt(tmp_path, "a.txt.bak") == "hand written" and txt(tmp_path, "a.txt.2.bak") == "first words\n"
    assert not (tmp_path / JOURNAL).exists()
    assert plan(tmp_path, CaptionJob())[1].problems == []  # the scan does not flag the .bak files


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("A photo of zkw on a beach.", "A photo of zkw on a beach."),  # already there: not added again
        ("a photo of a dog", "zkw, a photo of a dog"),
        ('Caption: "a dog\n on grass"', "zkw, a dog on grass"),
    ],
)
def test_trigger_word_inserted_once(tmp_path, answer, expected):
    image(tmp_path, "a.png")
    caption_folder(tmp_path, Engine(lambda _: answer), CaptionJob(trigger_word="zkw"))
    assert txt(tmp_path, "a.txt") == expected + "\n"


def test_tags_style_joins_tags_with_commas(tmp_path):
    image(tmp_path, "a.png")
    engine = Engine(lambda _: "- red hair\n- smile, Red Hair; outdoors.\n2. blue sky")
    caption_folder(tmp_path, engine, CaptionJob(style="tags", trigger_word="zkw"))
    assert txt(tmp_path, "a.txt") == "zkw, red hair, smile, outdoors, blue sky\n"
    assert engine.calls[0][1] == STYLES["tags"].prompt
    with pytest.raises(ValueError, match="not one of"):
        CaptionJob(style="poem")


def test_a_crash_mid_batch_leaves_whole_captions_and_a_rerun_continues(tmp_path):
    for name in "abcde":
        image(tmp_path, f"{name}.png")
    with pytest.raises(RuntimeError, match="out of memory") as crash:
        caption_folder(tmp_path, Engine(fail_on=2), CaptionJob())
    if sys.version_info >= (3, 11):  # add_note: the error says which image and that a re-run continues
        assert any("while captioning c.png" in note for note in crash.value.__notes__)
    assert sorted(p.name for p in tmp_path.glob("*.txt")) == ["a.txt", "b.txt"] and leftovers(tmp_path) == []
    engine = Engine()
    report = caption_folder(tmp_path, engine, CaptionJob())
    assert sorted(report.written) == ["c.txt", "d.txt", "e.txt"] and sorted(report.kept) == ["a.png", "b.png"]
    assert len(engine.calls) == 3


def test_an_overwrite_run_resumes_from_its_journal(tmp_path):
    for name in "abcd":
        image(tmp_path, f"{name}.png", caption=f"old {name}")
    job = CaptionJob(overwrite=True, engine="fake")
    with pytest.raises(RuntimeError):
        caption_folder(tmp_path, Engine(lambda _: "new", fail_on=2), job)
    assert json.loads((tmp_path / JOURNAL).read_text())["done"] == ["a.png", "b.png"]
    engine = Engine(lambda _: "new")
    report = caption_folder(tmp_path, engine, job)
    assert len(engine.calls) == 2 and sorted(report.resumed) == ["a.png", "b.png"]
    assert [txt(tmp_path, f"{n}.txt") for n in "abcd"] == ["new\n"] * 4
    assert [txt(tmp_path, f"{n}.txt.bak") for n in "abcd"] == [f"old {n}" for n in "abcd"]
    assert not list(tmp_path.glob("*.2.bak")) and not (tmp_path / JOURNAL).exists()
    # other settings start a new pass: every image again (and the journal of the old one is not trusted)
    (tmp_path / JOURNAL).write_text(json.dumps({"key": job.key(), "done": ["a.png", "b.png"]}))
    other = Engine(lambda _: "newer")
    caption_folder(tmp_path, other, CaptionJob(overwrite=True, engine="fake", trigger_word="zkw"))
    assert len(other.calls) == 4 and txt(tmp_path, "a.txt") == "zkw, newer\n"


def test_the_stop_button_between_images_keeps_what_is_done(tmp_path):
    for name in "abc":
        image(tmp_path, f"{name}.png")

    class Stop(Exception):
        pass

    def progress(done, total):
        if done == 2:
            raise Stop

    with pytest.raises(Stop):
        caption_folder(tmp_path, Engine(), CaptionJob(), progress=progress)
    assert sorted(p.name for p in tmp_path.glob("*.txt")) == ["a.txt", "b.txt"]
    seen = []
    caption_folder(tmp_path, Engine(), CaptionJob(), progress=lambda done, total: seen.append((done, total)))
    assert seen == [(0, 1), (1, 1)] and (tmp_path / "c.txt").is_file()


def test_bad_files_are_skipped_and_reported(tmp_path):
    image(tmp_path, "good.png")
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "notes.jpg").write_text("not an image")
    image(tmp_path, "tiny.png", size=(20, 20))
    whole = image(tmp_path, "cut.jpg", size=(96, 96)).read_bytes()
    (tmp_path / "cut.jpg").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "good copy.png").write_bytes((tmp_path / "good.png").read_bytes())
    engine = Engine()
    report = caption_folder(tmp_path, engine, CaptionJob())
    assert report.written == ["good.txt"] and len(engine.calls) == 1
    codes = {p.file: p.code for p in report.problems}
    assert codes == {
        "empty.png": "zero_byte",
        "notes.jpg": "not_an_image",
        "tiny.png": "too_small",
        "cut.jpg": "truncated",
        "good copy.png": "duplicate",
    }
    assert all(p.severity == "skipped" and p.fix for p in report.problems)
    assert "5 file(s) not captioned" in report.text() and "[truncated] cut.jpg" in report.text()


def test_no_text_from_the_engine_writes_nothing(tmp_path):
    image(tmp_path, "a.png")
    report = caption_folder(tmp_path, Engine(lambda _: "  \n "), CaptionJob(trigger_word="zkw"))
    assert report.written == [] and not (tmp_path / "a.txt").exists()
    assert [p.code for p in report.problems] == ["caption_not_generated"]


def test_a_missing_folder_is_named(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        caption_folder(tmp_path / "nope", Engine(), CaptionJob())


def test_only_captions_the_named_images(tmp_path):
    """`only` (the editor's selection): those images and no others, with overwrite too; an unknown name is an
    error that names it, never a silent skip."""
    from trainer.data.captioning.jobs import parse_only

    image(tmp_path, "a.png")
    image(tmp_path, "b.png", "old b")
    image(tmp_path, "sub/c.png")
    image(tmp_path, "d.png")
    assert parse_only(" a.png\n\nsub\\c.png \na.png") == ("a.png", "sub/c.png")
    report = caption_folder(tmp_path, Engine(), CaptionJob(only=("a.png", "sub/c.png")))
    assert sorted(report.written) == ["a.txt", "sub/c.txt"] and not (tmp_path / "d.txt").exists()
    report = caption_folder(tmp_path, Engine(), CaptionJob(overwrite=True, only=("b.png",)))
    assert report.written == ["b.txt"] and txt(tmp_path, "b.txt.bak") == "old b" and not (tmp_path / "d.txt").exists()
    assert CaptionJob(only=("b.png",)).key() != CaptionJob().key() == CaptionJob(only=()).key()
    with pytest.raises(ValueError, match="no image gone.png in this folder"):
        plan(tmp_path, CaptionJob(only=("a.png", "gone.png")))
