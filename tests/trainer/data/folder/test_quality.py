"""The quality pass: near-duplicates, blur, long captions, verdict lines (trainer/data/folder/quality.py)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFilter

from trainer.archs import ARCHS, get_arch
from trainer.data.dataset import Dataset, DataSettings
from trainer.data.folder import quality
from trainer.data.folder.scan import scan


def photo(seed: int, size=(640, 480)) -> Image.Image:
    """Shapes on a coloured ground with a little grain: edges like a photo's, different for each seed."""
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", size, tuple(int(v) for v in rng.integers(0, 255, 3)))
    draw = ImageDraw.Draw(image)
    for _ in range(40):
        x, y = int(rng.integers(0, size[0])), int(rng.integers(0, size[1]))
        draw.ellipse(
            [x, y, x + int(rng.integers(10, 200)), y + int(rng.integers(10, 200))],
            fill=tuple(int(v) for v in rng.integers(0, 255, 3)),
        )
    grain = rng.normal(0, 6, (size[1], size[0], 3))
    return Image.fromarray(np.clip(np.asarray(image) + grain, 0, 255).astype(np.uint8))


def test_dhash_reference_values():
    """Bit order as imagehash's dhash: 1 where the right neighbour is brighter; first row first, MSB first."""
    rising = np.tile(np.arange(9, dtype=np.float32) * 20, (8, 1))
    assert quality.dhash(rising) == 2**64 - 1
    assert quality.dhash(rising[:, ::-1]) == 0
    rows = rising.copy()
    rows[1::2] = rows[1::2, ::-1]  # even rows rise, odd rows fall: bytes ff 00 ff 00 ...
    assert quality.dhash(rows) == 0xFF00FF00FF00FF00


def test_near_duplicates_found_and_different_images_not(tmp_path):
    original = photo(1)
    original.save(tmp_path / "a.png")
    original.resize((320, 240), Image.Resampling.LANCZOS).save(tmp_path / "a_small.jpg", quality=60)
    photo(2).save(tmp_path / "b.png")
    photo(3).save(tmp_path / "c.png")
    report = scan(tmp_path)
    problems = quality.assess(report)
    near = [p for p in problems if p.code == "near_duplicate"]
    assert [(p.file, "a.png" in p.message) for p in near] == [("a_small.jpg", True)]
    measures = {n: quality.measure(tmp_path / n) for n in ("a.png", "b.png", "c.png")}
    values = np.asarray([m.dhash for m in measures.values()], dtype=np.uint64)
    distances = quality.hamming(values, values)
    assert distances[0, 1] > quality.NEAR_DUPLICATE_BITS and distances[1, 2] > quality.NEAR_DUPLICATE_BITS


def test_groups_link_transitively():
    assert quality.near_duplicate_groups([0b0, 0b111, 0b111111, 2**64 - 1], bits=3) == [[0, 1, 2]]


def test_blur_detected_on_blurred_copy_not_on_sharp(tmp_path):
    sharp = photo(4)
    sharp.save(tmp_path / "sharp.png")
    sharp.filter(ImageFilter.GaussianBlur(3)).save(tmp_path / "blurred.png")
    for seed in range(5, 9):
        photo(seed).save(tmp_path / f"other{seed}.png")
    report = scan(tmp_path)
    blurry = [p.file for p in quality.assess(report) if p.code == "blurry"]
    assert blurry == ["blurred.png"]


def test_relative_blur_among_sharp_images(tmp_path):
    """Softer than a fifth of the dataset's median: flagged though above the absolute floor."""
    for seed in range(5):
        photo(seed).save(tmp_path / f"p{seed}.png")
    photo(9).filter(ImageFilter.GaussianBlur(0.7)).save(tmp_path / "soft.png")
    report = scan(tmp_path)
    soft = quality.measure(tmp_path / "soft.png").sharpness
    median = np.median([quality.measure(tmp_path / f"p{s}.png").sharpness for s in range(5)])
    assert quality.BLURRY_ABSOLUTE < soft < quality.BLURRY_RELATIVE * median
    problems = [p for p in quality.assess(report) if p.code == "blurry"]
    assert [p.file for p in problems] == ["soft.png"] and "median" in problems[0].message


def test_long_captions_flagged_with_each_arch_limit(tmp_path):
    photo(1).save(tmp_path / "short.png")
    (tmp_path / "short.txt").write_text("a red bicycle against a brick wall")
    photo(2).save(tmp_path / "long.png")
    (tmp_path / "long.txt").write_text("word " * 420)  # ~483 tokens: over Flux2 Dev's 470 only
    photo(3).save(tmp_path / "longer.png")
    (tmp_path / "longer.txt").write_text("word " * 1000)  # over every family's
    assert quality.estimate_tokens("word " * 420) == 483
    report = scan(tmp_path)
    long = {
        p.file: p
        for p in quality.assess(report, limits=quality.token_limits(ARCHS.values()))
        if p.code == "caption_long"
    }
    assert sorted(long) == ["long.txt", "longer.txt"]
    assert "flux2_dev's 470" in long["long.txt"].message and "flux2_klein" not in long["long.txt"].message
    assert "qwen_image's 1024" in long["longer.txt"].message
    klein = scan(tmp_path)
    only = quality.assess(klein, limits=quality.token_limits([get_arch("flux2_klein")]))
    assert [p.file for p in only if p.code == "caption_long"] == ["longer.txt"]


def test_token_estimate_counts_cjk_per_character():
    assert quality.estimate_tokens("") == 0
    assert quality.estimate_tokens("猫がいる") == quality.estimate_tokens("a b c d")


def test_verdict_lines_and_small_images(tmp_path):
    photo(1).save(tmp_path / "good.png")
    photo(1).filter(ImageFilter.GaussianBlur(4)).save(tmp_path / "bad.png")
    photo(2, (300, 200)).save(tmp_path / "tiny.png")
    for name in ("good", "bad", "tiny"):
        (tmp_path / f"{name}.txt").write_text(f"a {name} photo")
    dataset = Dataset.load(tmp_path, DataSettings(resolutions=(256, 512), quality=True))
    text = dataset.report_text()
    lines = {line.split()[0]: line for line in text.split("Per image")[1].splitlines()[1:] if line.startswith("  ")}
    assert lines["good.png"].endswith(" ok — near-duplicate of bad.png; this one is the sharpest, the one to keep")
    assert "512: 640x480" not in lines["good.png"]
    assert "[256: 288x208 crop 0x8, 512: 576x432]" in lines["good.png"]
    assert "near_duplicate, blurry" in lines["bad.png"] and "fix:" in lines["bad.png"]
    assert "below_resolution" in lines["tiny.png"] and "[256: 288x192, 512: none, too small]" in lines["tiny.png"]
    assert "(1 of 3 ok)" in text
    assert (tmp_path / ".kiln_cache" / quality.CACHE_FILE).is_file()


def test_cache_skips_decoding_unchanged_images(tmp_path, monkeypatch):
    photo(1).save(tmp_path / "a.png")
    photo(2).save(tmp_path / "b.png")
    cache = tmp_path / "cache.json"
    first = [p.line() for p in quality.assess(scan(tmp_path), cache_file=cache)]
    monkeypatch.setattr(quality, "measure", lambda path: pytest.fail(f"decoded {path} again"))
    assert [p.line() for p in quality.assess(scan(tmp_path), cache_file=cache)] == first


def test_check_dataset_cli_prints_verdicts(tmp_path, capsys):
    from trainer.cli.main import main

    photo(1).save(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("word " * 420)
    assert main(["check-dataset", str(tmp_path), "--resolutions", "256", "--arch", "flux2_klein"]) == 0
    out = capsys.readouterr().out
    assert "Per image (1 of 1 ok):" in out and "a.png 640x480 [256: 288x208 crop 0x8] ok" in out
    assert main(["check-dataset", str(tmp_path), "--resolutions", "256", "--arch", "flux2_dev"]) == 0
    assert "caption_long" in capsys.readouterr().out
