"""The quality pass's thresholds on real photos (tests/fixtures/photos/, see its README for their licences):
sharp photos pass, a blurred copy is flagged, a resized and re-encoded copy is a near-duplicate, and two
different photos are not (the synthetic images of test_quality.py cannot show that the thresholds suit photos)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from PIL import Image, ImageFilter

from trainer.data.folder import quality
from trainer.data.folder.scan import scan

from helpers import paths

PHOTOS = sorted(paths.PHOTOS.glob("*.jpg"))


def test_the_photos_are_there():
    assert [p.name for p in PHOTOS] == ["astronaut.jpg", "chelsea.jpg", "coffee.jpg", "rocket.jpg"]


@pytest.mark.parametrize("photo", PHOTOS, ids=lambda p: p.stem)
def test_a_sharp_photo_passes_and_its_blurred_copy_is_flagged(photo, tmp_path):
    sharp = quality.measure(photo).sharpness
    assert sharp > 5 * quality.BLURRY_ABSOLUTE
    Image.open(photo).filter(ImageFilter.GaussianBlur(2)).save(tmp_path / "blurred.png")
    assert quality.measure(tmp_path / "blurred.png").sharpness < quality.BLURRY_ABSOLUTE


@pytest.mark.parametrize("photo", PHOTOS, ids=lambda p: p.stem)
def test_a_resized_reencoded_copy_is_a_near_duplicate(photo, tmp_path):
    with Image.open(photo) as image:
        image.resize((image.width * 3 // 4, image.height * 3 // 4), Image.Resampling.LANCZOS).save(
            tmp_path / "copy.jpg", quality=60
        )
    a, b = (np.asarray([quality.measure(p).dhash], np.uint64) for p in (photo, tmp_path / "copy.jpg"))
    assert quality.hamming(a, b)[0, 0] <= quality.NEAR_DUPLICATE_BITS // 2


def test_different_photos_are_far_apart():
    hashes = np.asarray([quality.measure(p).dhash for p in PHOTOS], np.uint64)
    apart = [int(quality.hamming(hashes[[i]], hashes[[j]])[0, 0]) for i, j in itertools.combinations(range(4), 2)]
    assert min(apart) > 2 * quality.NEAR_DUPLICATE_BITS, apart


def test_a_dataset_of_the_photos_with_a_blurred_and_a_copied_one(tmp_path):
    """The whole pass: the four photos are ok; the blurred one and the copy are named, the copy with its original."""
    for photo in PHOTOS:
        (tmp_path / photo.name).write_bytes(photo.read_bytes())
    with Image.open(PHOTOS[1]) as cat:
        cat.filter(ImageFilter.GaussianBlur(2)).save(tmp_path / "cat_blurred.jpg", quality=90)
    with Image.open(PHOTOS[2]) as cup:
        cup.resize((192, 128), Image.Resampling.LANCZOS).save(tmp_path / "cup_small.jpg", quality=60)
    report = scan(tmp_path)
    found = quality.assess(report, workers=1)
    warned = {(p.code, p.file) for p in found if p.severity == "warning"}
    # The blurred cat is both blurry and (by shape) a near-duplicate of the sharp one, which is kept.
    assert ("blurry", "cat_blurred.jpg") in warned and ("near_duplicate", "cup_small.jpg") in warned
    assert not {file for _, file in warned} & {p.name for p in PHOTOS}
    # A pair names each other: the copy its original (warning), the original its copy (a note).
    verdicts = {v["path"]: v for v in quality.verdicts(report)}
    assert "copy of coffee.jpg" in " ".join(verdicts["cup_small.jpg"]["messages"])
    assert "near_duplicate" not in verdicts["coffee.jpg"]["problems"]
    assert (
        verdicts["coffee.jpg"]["note"] == "near-duplicate of cup_small.jpg; this one is the sharpest, the one to keep"
    )
