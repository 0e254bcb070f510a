"""The dataset scanner: every bad file is named with a code and a fix, nothing crashes, good files are Items."""

from __future__ import annotations

import json
import os
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainer.cli.main import main
from trainer.data.dataset import Dataset, DataSettings
from trainer.data.folder.images import load_rgb
from trainer.data.folder.report import format_report
from trainer.data.folder.scan import scan as scan_with_defaults


def image(root: Path, rel: str, size=(96, 80), mode="RGB", caption: str | bytes | None = "a photo", **save) -> Path:
    """Write an image (noise, so no two are equal) and, unless caption is None, its .txt."""
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(zlib.crc32(rel.encode()))
    pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).convert(mode).save(path, **save)
    if caption is not None:
        text = path.with_suffix(".txt")
        text.write_bytes(caption if isinstance(caption, bytes) else caption.encode())
    return path


def scan(root: Path, **options):
    """Tests use small images: buckets of 64 px, so only the tests about it see below_resolution."""
    return scan_with_defaults(root, **{"resolutions": [64], **options})


def codes(report, severity=None) -> dict[str, str]:
    """file → code, for the problems of one severity."""
    return {p.file: p.code for p in report.problems if severity in (None, p.severity)}


def items(report) -> dict[str, object]:
    return {item.path: item for item in report.items}


def test_clean_nested_folder_with_repeats(tmp_path):
    image(tmp_path, "b.png")
    image(tmp_path, "a.jpg")
    image(tmp_path, "10_char/x.png")
    image(tmp_path, "10_char/deeper/y.webp")
    image(tmp_path, "3_b/5_c/z.png")  # the nearest N_ folder wins
    image(tmp_path, ".kiln_cache/latent.png")  # hidden folders are not scanned
    report = scan(tmp_path)
    assert report.ok and report.problems == []
    assert [i.path for i in report.items] == [
        "10_char/deeper/y.webp",
        "10_char/x.png",
        "3_b/5_c/z.png",
        "a.jpg",
        "b.png",
    ]
    assert [i.repeats for i in report.items] == [10, 10, 5, 1, 1]
    item = items(report)["a.jpg"]
    assert (item.width, item.height, item.caption, item.caption_file) == (96, 80, "a photo", "a.txt")
    assert item.image_format == "JPEG" and item.mode == "RGB" and len(item.sha256) == 64
    assert scan(tmp_path, deep=True, workers=1).to_dict()["items"] == report.to_dict()["items"]


def test_every_bad_file_is_named(tmp_path):
    image(tmp_path, "good.png", size=(300, 300))
    image(tmp_path, "tiny.png", size=(1, 1))
    image(tmp_path, "small.png", size=(300, 200))
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "notes.jpg").write_text("this is not a picture")
    (tmp_path / "anim.gif").write_bytes(b"GIF89a" + bytes(20))
    (tmp_path / "phone.heic").write_bytes(bytes(40))
    (tmp_path / "gif_inside.jpg").write_bytes(b"GIF89a" + bytes(20))
    (tmp_path / "lonely.txt").write_text("a caption for nothing")
    (tmp_path / "latents.npz").write_bytes(b"PK")
    (tmp_path / "Thumbs.db").write_bytes(b"\x00")
    (tmp_path / ".DS_Store").write_bytes(b"\x00")
    (tmp_path / "clip.mp4").write_bytes(b"\x00")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub/dataset.json").write_text("{}")
    Image.new("L", (10000, 10)).save(tmp_path / "wide.png")
    report = scan(tmp_path, resolutions=[256])
    assert report.ok and list(items(report)) == ["good.png", "small.png"]
    assert codes(report, "skipped") == {
        "tiny.png": "too_small",
        "empty.png": "zero_byte",
        "notes.jpg": "not_an_image",
        "anim.gif": "unreadable_clip",  # a GIF is a clip now (clips.py): this one is broken
        "clip.mp4": "unreadable_clip",
        "phone.heic": "unsupported_format",
        "gif_inside.jpg": "unsupported_format",
        "wide.png": "too_large",
    }
    assert codes(report, "warning") == {"small.png": "below_resolution", "lonely.txt": "caption_orphan"}
    # The caption of a skipped image is named too; caches and OS files are not worth a word.
    assert codes(report, "note") == {
        "tiny.txt": "caption_unused",
        "sub/dataset.json": "dataset_json_nested",
    }
    assert all(p.message and p.fix for p in report.problems)
    assert "GIF" in next(p.message for p in report.problems if p.file == "gif_inside.jpg")
    assert codes(scan(tmp_path, resolutions=[128]), "warning") == {"lonely.txt": "caption_orphan"}


def test_conversions_are_notes(tmp_path):
    Image.new("CMYK", (80, 80), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg")
    Image.fromarray(np.full((80, 80), 40000, np.uint16)).save(tmp_path / "deep.png")
    palette = Image.new("P", (80, 80), 1)
    palette.putpalette([0, 0, 0, 200, 10, 10] + [0] * 762)
    palette.save(tmp_path / "palette.png", transparency=0)
    Image.new("LA", (80, 80), (90, 128)).save(tmp_path / "la.png")
    Image.new("L", (80, 80), 90).save(tmp_path / "grey.png")
    exif = Image.Exif()
    exif[0x0112] = 6
    image(tmp_path, "turned.jpg", size=(120, 80), caption=None, exif=exif)
    for name in ("cmyk", "deep", "palette", "la", "grey"):
        (tmp_path / f"{name}.txt").write_text(name)
    (tmp_path / "turned.txt").write_text("turned")
    report = scan(tmp_path)
    assert report.ok and not report.skipped and not report.warnings
    notes = {p.file: p for p in report.of("note")}
    assert {f: p.code for f, p in notes.items()} == {
        "cmyk.jpg": "converted",
        "deep.png": "converted",
        "palette.png": "converted",
        "la.png": "converted",
        "grey.png": "converted",
        "turned.jpg": "exif_rotated",
    }
    assert "CMYK → RGB" in notes["cmyk.jpg"].message and "16-bit" in notes["deep.png"].message
    assert "white" in notes["palette.png"].message and "white" in notes["la.png"].message
    turned = items(report)["turned.jpg"]
    assert (turned.width, turned.height) == (80, 120) and turned.notes
    assert items(report)["cmyk.jpg"].mode == "CMYK" and items(report)["cmyk.jpg"].notes == ["CMYK → RGB"]
    assert load_rgb(tmp_path / "turned.jpg").shape == (120, 80, 3)
    assert scan(tmp_path, deep=True).to_dict()["items"] == report.to_dict()["items"]


def test_truncated_jpeg_is_caught_by_the_fast_scan(tmp_path):
    path = image(tmp_path, "cut.jpg", size=(200, 200), quality=95)
    path.write_bytes(path.read_bytes()[:3000])
    image(tmp_path, "good.jpg")
    for deep in (False, True):
        report = scan(tmp_path, deep=deep)
        assert codes(report) == {"cut.jpg": "truncated", "cut.txt": "caption_unused"}
        assert list(items(report)) == ["good.jpg"]


def test_data_after_the_jpeg_end_is_not_truncation(tmp_path):
    """A phone's motion photo: a whole JPEG, then a video. The end check fails, the full decode passes."""
    path = image(tmp_path, "motion.jpg")
    path.write_bytes(path.read_bytes() + b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4)
    for deep in (False, True):
        report = scan(tmp_path, deep=deep)
        assert list(items(report)) == ["motion.jpg"] and report.problems == []


def test_damage_inside_the_data_needs_the_deep_scan(tmp_path):
    """Header and IEND intact, compressed data zeroed in the middle: only a full decode notices."""
    path = image(tmp_path, "broken.png", size=(128, 128))
    data = bytearray(path.read_bytes())
    start = data.index(b"IDAT") + 300
    data[start : start + 200] = bytes(200)
    path.write_bytes(bytes(data))
    image(tmp_path, "good.png")
    assert list(items(scan(tmp_path))) == ["broken.png", "good.png"]
    deep = scan(tmp_path, deep=True)
    assert codes(deep, "skipped") == {"broken.png": "decode_failed"} and list(items(deep)) == ["good.png"]


def test_mislabelled_jpeg_is_used_with_a_note(tmp_path):
    image(tmp_path, "really_a_jpeg.png", format="JPEG")
    report = scan(tmp_path)
    assert items(report)["really_a_jpeg.png"].image_format == "JPEG"
    assert codes(report) == {"really_a_jpeg.png": "mislabelled"}


def test_captions(tmp_path):
    image(tmp_path, "latin.png", caption=b"caf\xe9 au lait")  # Windows-1252
    image(tmp_path, "bom.png", caption=b"\xef\xbb\xbfwith a BOM\n")
    image(tmp_path, "utf16.png", caption="caf\u00e9".encode("utf-16"))  # with a BOM: read as is
    image(tmp_path, "empty.png", caption="  \n")
    image(tmp_path, "binary.png", caption=b"\x00\x01\x02\xff\xfe")
    image(tmp_path, "none.png", caption=None)
    image(tmp_path, "Upper.png", caption=None)
    (tmp_path / "upper.txt").write_text("matched regardless of case")
    report = scan(tmp_path)
    found = items(report)
    assert found["latin.png"].caption == "café au lait"
    assert found["bom.png"].caption == "with a BOM" and found["utf16.png"].caption == "café"
    assert found["empty.png"].caption == "" and found["none.png"].caption is None
    assert found["binary.png"].caption is None and found["binary.png"].caption_file == "binary.txt"
    assert found["Upper.png"].caption == "matched regardless of case"
    assert codes(report) == {
        "latin.txt": "caption_not_utf8",
        "empty.txt": "caption_empty",
        "binary.txt": "caption_not_text",
        "none.png": "caption_missing",
    }
    latin = next(p for p in report.problems if p.code == "caption_not_utf8")
    assert "0xE9 at offset 3" in latin.message and "UTF-8" in latin.fix and latin.severity == "warning"


def test_duplicates_keep_the_first_copy(tmp_path):
    first = image(tmp_path, "a/one.png")
    (tmp_path / "b").mkdir()
    (tmp_path / "b/copy.png").write_bytes(first.read_bytes())
    (tmp_path / "b/copy.txt").write_text("another caption")
    report = scan(tmp_path)
    assert list(items(report)) == ["a/one.png"] and items(report)["a/one.png"].caption == "a photo"
    duplicate = next(p for p in report.problems if p.file == "b/copy.png")
    assert duplicate.code == "duplicate" and duplicate.severity == "skipped"
    assert duplicate.message == "a byte-identical copy of a/one.png"
    assert duplicate.fix.startswith("delete one of the two; a/one.png is used, with its caption a/one.txt")
    assert codes(report) == {"b/copy.png": "duplicate", "b/copy.txt": "duplicate_caption"}
    differs = next(p for p in report.problems if p.file == "b/copy.txt")
    assert differs.severity == "warning" and "differs from a/one.txt" in differs.message
    assert "a/one.png trains with a/one.txt's text" in differs.message and "merge" in differs.fix


def test_a_duplicate_with_the_caption_is_kept_over_a_bare_first_copy(tmp_path):
    """Finder's "photo copy.png" sorts before "photo.png" (' ' < '.'): the original (the shorter name) is
    kept all the same, and a captioned copy wins over a bare one."""
    original = image(tmp_path, "photo.png", caption="a red car")
    (tmp_path / "photo copy.png").write_bytes(original.read_bytes())
    image(tmp_path, "same.png", caption="a tree")
    (tmp_path / "same copy.png").write_bytes((tmp_path / "same.png").read_bytes())
    (tmp_path / "same copy.txt").write_text("a tree")
    report = scan(tmp_path)
    assert {path: item.caption for path, item in items(report).items()} == {
        "photo.png": "a red car",
        "same.png": "a tree",
    }
    assert codes(report) == {
        "photo copy.png": "duplicate",
        "same copy.png": "duplicate",
        "same copy.txt": "duplicate_caption",
    }
    duplicate = next(p for p in report.problems if p.file == "photo copy.png")
    assert duplicate.message == "a byte-identical copy of photo.png"
    assert "photo.png is used, with its caption photo.txt" in duplicate.fix
    same = next(p for p in report.problems if p.file == "same copy.txt")  # the same text: nothing lost
    assert same.severity == "note" and "same copy.png" in same.message and "not used" in same.message
    text = format_report(report)
    assert "its image was skipped" not in text and "fix or replace the image" not in text


def test_the_dataset_keeps_the_copy_the_scan_keeps(tmp_path):
    original = image(tmp_path, "photo.png", caption="a red car")
    (tmp_path / "photo copy.png").write_bytes(original.read_bytes())
    dataset = Dataset.load(tmp_path, DataSettings(resolutions=(64,)))
    assert [item.path for item in dataset.report.items] == ["photo.png"]
    assert dataset.captions == (("a red car",),)


def test_repeat_folder_names(tmp_path):
    image(tmp_path, "2024_holiday/a.png")  # a date, not 2024 repeats
    image(tmp_path, "0_none/b.png")
    image(tmp_path, "007_bond/c.png")
    report = scan(tmp_path)
    assert {i.path: i.repeats for i in report.items} == {
        "007_bond/c.png": 7,
        "0_none/b.png": 1,
        "2024_holiday/a.png": 1,
    }
    assert codes(report) == {"2024_holiday": "repeats_out_of_range", "0_none": "repeats_out_of_range"}


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symlinks")
def test_symlink_loop_and_broken_link(tmp_path):
    image(tmp_path, "sub/a.png")
    (tmp_path / "sub/loop").symlink_to(tmp_path, target_is_directory=True)
    (tmp_path / "gone.png").symlink_to(tmp_path / "missing.png")
    report = scan(tmp_path)
    assert list(items(report)) == ["sub/a.png"]
    assert codes(report) == {"sub/loop": "symlink_loop", "gone.png": "broken_link"}


def test_dataset_json(tmp_path):
    image(tmp_path, "a.png", size=(300, 300))
    meta = {
        "name": "mine",
        "type": "character",
        "trigger_word": "ohwx",
        "resolutions": [256, 512],
        "repeats": 3,
        "trigger": "typo",
    }
    (tmp_path / "dataset.json").write_text(json.dumps(meta))
    report = scan_with_defaults(tmp_path)
    assert report.ok and report.meta.trigger_word == "ohwx" and report.meta.resolutions == [256, 512]
    assert items(report)["a.png"].repeats == 1  # dataset.json's repeats is applied by the dataset
    unknown = report.warnings[0]
    assert unknown.code == "dataset_json_unknown_key" and "did you mean 'trigger_word'" in unknown.message
    assert "below_resolution" not in codes(report).values()  # dataset.json's resolutions: smallest 256


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"name": "x",\n "type": "style"\n "repeats": 2}', "line 3"),
        ('{"repeats": "ten"}', "'repeats'"),
        ('{"resolutions": 512}', "'resolutions'"),
        ('{"repeats": true}', "'repeats'"),
        ('{"type": "charcter"}', "did you mean 'character'"),
        ('["a list"]', "JSON object"),
    ],
)
def test_bad_dataset_json_is_fatal(tmp_path, text, expected):
    image(tmp_path, "a.png")
    (tmp_path / "dataset.json").write_text(text)
    report = scan(tmp_path)
    assert not report.ok and len(report.fatal) == 1
    assert expected in report.fatal[0].message and report.fatal[0].file == "dataset.json" and report.fatal[0].fix
    assert list(items(report)) == ["a.png"]  # the images are still checked


def test_nothing_to_train(tmp_path):
    assert [p.code for p in scan(tmp_path / "nope").problems] == ["root_missing"]
    (tmp_path / "file.png").write_bytes(b"x")
    assert [p.code for p in scan(tmp_path / "file.png").problems] == ["root_not_dir"]
    (tmp_path / "empty").mkdir()
    assert [p.code for p in scan(tmp_path / "empty").fatal] == ["no_images"]
    report = scan(tmp_path)
    assert not report.ok and {p.code for p in report.problems} == {"no_images", "not_an_image"}


def test_no_pil_warning_escapes(tmp_path):
    image(tmp_path, "a.png")
    (tmp_path / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(30))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scan(tmp_path, deep=True)


def test_format_report(tmp_path):
    image(tmp_path, "5_set/a.png")
    image(tmp_path, "5_set/b.png", caption=None)
    for index in range(13):
        (tmp_path / f"empty{index:02d}.png").write_bytes(b"")
    text = format_report(scan(tmp_path))
    assert "2 usable images (10 per epoch with repeats), 13 skipped, 1 warnings" in text
    assert "5_set/: 2 images × 5 repeats" in text and "[caption_missing] 5_set/b.png" in text
    assert "… and 3 more [zero_byte]" in text and text.endswith("OK: ready to train")


def test_cli(tmp_path, capsys):
    image(tmp_path, "a.png")
    image(tmp_path, "b.png", size=(300, 300))
    assert main(["check-dataset", str(tmp_path)]) == 0
    assert "2 usable images" in capsys.readouterr().out
    assert main(["check-dataset", str(tmp_path), "--json", "--deep", "--resolutions", "256,512"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["ok"] and shown["deep"] and shown["usable"] == 2
    assert [(p["file"], p["code"]) for p in shown["warnings"]] == [("a.png", "below_resolution")]
    assert main(["check-dataset", str(tmp_path), "--json"]) == 0  # default 512: both are below it
    assert len(json.loads(capsys.readouterr().out)["warnings"]) == 2
    assert main(["check-dataset", str(tmp_path / "missing")]) == 1
    assert "root_missing" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["check-dataset", str(tmp_path), "--resolutions", "big"])


def test_jfif_is_a_jpeg(tmp_path):
    image(tmp_path, "windows_save.jfif", format="JPEG")
    report = scan(tmp_path)
    assert "windows_save.jfif" in items(report)


def test_check_dataset_shows_the_bucket_plan(tmp_path, capsys):
    image(tmp_path, "big.png", size=(1200, 800))
    for index in range(10):
        image(tmp_path, f"small/{index:02d}.png", size=(100, 100))
    assert main(["check-dataset", str(tmp_path), "--resolutions", "512,768"]) == 0
    text = capsys.readouterr().out
    assert "Buckets at 512 px (centre crop, sides multiples of 16): 11 images in 2 buckets" in text
    assert "  96x96: 10 images: small/00.png, small/01.png" in text and "small/07.png, … and 2 more" in text
    assert "  624x416: 1 image: big.png" in text
    assert "Buckets at 768 px (centre crop, sides multiples of 16): 1 image in 1 bucket" in text
    assert "    big.png 1200x800 → 936x624, crop 8 px x 0 px at (4, 0)" in text
    assert "no 768 px bucket (smaller than 768x768; it trains at a smaller resolution only): small/00.png" in text
    plan = text.split("Per image")[0]  # the bucket plan, before the per-image verdicts
    assert "small/00.png 100x100" not in plan  # 100 → 96 is a resize, no pixels cropped
    assert main(["check-dataset", str(tmp_path), "--resolutions", "512,768", "--json"]) == 0
    at_768 = json.loads(capsys.readouterr().out)["buckets"][1]
    assert at_768["resolution"] == 768 and at_768["images"] == 1 and len(at_768["smaller"]) == 10
    assert at_768["buckets"] == [
        {
            "bucket": "928x624",
            "size": [928, 624],
            "images": [
                {"path": "big.png", "size": [1200, 800], "resized": [936, 624], "offset": [4, 0], "cropped": [8, 0]}
            ],
        }
    ]


def test_check_dataset_buckets_come_from_dataset_json_or_are_not_shown(tmp_path, capsys):
    image(tmp_path, "a.png", size=(300, 200))
    image(tmp_path, "broken.png").write_bytes(b"")  # not usable: no bucket
    assert main(["check-dataset", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "Buckets" not in text
    assert main(["check-dataset", str(tmp_path), "--json"]) == 0
    assert "buckets" not in json.loads(capsys.readouterr().out)
    (tmp_path / "dataset.json").write_text('{"resolutions": [256]}')
    assert main(["check-dataset", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "Buckets at 256 px (centre crop, sides multiples of 16): 1 image in 1 bucket" in text
    assert "  288x192: 1 image: a.png" in text and "broken.png" not in text.split("Skipped")[0]


def test_list_datasets_names_the_folders_that_hold_images(tmp_path):
    """What Load Dataset's picker offers: folders under input/ with images at any depth, with counts;
    not files, not folders without images, not hidden ones."""
    from trainer.data.folder.scan import list_datasets

    Image.new("RGB", (64, 64)).save(tmp_path / "loose.png")
    (tmp_path / "portraits" / "10_me").mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (64, 64)).save(tmp_path / "portraits" / "10_me" / f"{i}.jpg")
    (tmp_path / "portraits" / "10_me" / "0.txt").write_text("me", encoding="utf-8")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x", encoding="utf-8")
    (tmp_path / ".trash").mkdir()
    Image.new("RGB", (64, 64)).save(tmp_path / ".trash" / "x.png")
    (tmp_path / "style").mkdir()
    Image.new("RGB", (64, 64)).save(tmp_path / "style" / "a.webp")
    found = list_datasets(tmp_path)
    assert [(f.name, f.images, f.captions) for f in found] == [("portraits", 3, 1), ("style", 1, 0)]
    assert [f.describe() for f in found] == ["3 images, 1 caption", "1 image, 0 captions"]
    assert list_datasets(tmp_path / "missing") == []


def test_list_datasets_counts_clips_as_clips(tmp_path):
    """A folder of clips is described by its clips, singular where one; a mixed folder names both (names only:
    the files are not read)."""
    from trainer.data.folder.scan import list_datasets

    (tmp_path / "dance").mkdir()
    (tmp_path / "dance" / "a.mp4").write_bytes(b"")
    (tmp_path / "dance" / "a.txt").write_text("x", encoding="utf-8")
    (tmp_path / "mixed").mkdir()
    for name in ("a.webm", "b.MOV", "c.png", "a.txt", "b.txt", "c.txt"):
        (tmp_path / "mixed" / name).write_bytes(b"")
    (tmp_path / "reels").mkdir()
    for i in range(2):
        (tmp_path / "reels" / f"{i}.gif").write_bytes(b"")
    found = {f.name: (f.images, f.clips, f.describe()) for f in list_datasets(tmp_path)}
    assert found == {
        "dance": (0, 1, "1 clip, 1 caption"),
        "mixed": (1, 2, "2 clips, 1 image, 3 captions"),
        "reels": (0, 2, "2 clips, 0 captions"),
    }
