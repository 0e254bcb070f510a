"""Image probing and decoding: every mode to 8-bit RGB, EXIF orientation, and every failure as an ImageProblem."""

from __future__ import annotations

import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from trainer.data.folder.images import (
    IMAGE_EXTENSIONS,
    ImageProblem,
    load_rgb,
    probe,
    verify,
)


def pattern(width: int = 12, height: int = 8) -> np.ndarray:
    """An RGB image with no symmetry, so every flip and rotation gives a different array. [H,W,3] uint8."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 20, y * 30, (x * 7 + y * 13) % 256], axis=-1).astype(np.uint8)


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares width×height but holds almost no data: a huge size without a huge allocation."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


def save_with_orientation(path: Path, pixels: np.ndarray, orientation: int, **options) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(pixels).save(path, exif=exif, **options)


def test_extensions():
    assert {".png", ".jpg", ".jpeg", ".jfif", ".jpe", ".webp", ".bmp", ".tif", ".tiff"} == IMAGE_EXTENSIONS


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_matches_pillow(tmp_path, orientation):
    path = tmp_path / "o.png"
    save_with_orientation(path, pattern(), orientation)
    info = probe(path)
    expected = np.asarray(ImageOps.exif_transpose(Image.open(path)).convert("RGB"))
    assert (info.width, info.height) == (expected.shape[1], expected.shape[0])
    assert np.array_equal(load_rgb(path), expected)
    assert (info.rotation != "") == (orientation != 1)


def test_exif_rotated_jpeg(tmp_path):
    """Orientation 6: stored 40 wide × 20 high, shown 20 wide × 40 high, turned 90° clockwise."""
    stored = np.zeros((20, 40, 3), np.uint8)
    stored[:, :20] = (255, 0, 0)  # left half red, right half blue
    stored[:, 20:] = (0, 0, 255)
    path = tmp_path / "rotated.jpg"
    save_with_orientation(path, stored, 6, quality=95)
    info = probe(path)
    assert (info.width, info.height, info.orientation) == (20, 40, 6)
    assert "rotated 90° clockwise" in info.rotation and info.rotation in info.notes
    pixels = load_rgb(path)
    assert pixels.shape == (40, 20, 3)
    top, bottom = pixels[5, 10].astype(int), pixels[35, 10].astype(int)
    assert top[0] > 200 and top[2] < 60  # the left (red) half is now on top
    assert bottom[2] > 200 and bottom[0] < 60


def test_cmyk_jpeg(tmp_path):
    path = tmp_path / "cmyk.jpg"
    Image.new("CMYK", (16, 12), (0, 255, 255, 0)).save(path)  # pure red in CMYK
    info = probe(path)
    assert info.mode == "CMYK" and info.conversions == ("CMYK → RGB",)
    pixels = load_rgb(path)
    assert pixels.shape == (12, 16, 3) and pixels.dtype == np.uint8
    assert pixels[6, 8, 0] > 200 and pixels[6, 8, 1] < 60


def test_16_bit_png(tmp_path):
    path = tmp_path / "deep.png"
    Image.fromarray(np.full((8, 8), 0xABCD, np.uint16)).save(path)
    info = probe(path)
    assert info.mode.startswith("I;16") and "16-bit" in info.conversions[0]
    pixels = load_rgb(path)
    assert pixels.shape == (8, 8, 3) and (pixels == 0xAB).all()


def test_palette_png_with_transparency_lands_on_white(tmp_path):
    path = tmp_path / "palette.png"
    image = Image.new("P", (8, 8), 1)
    image.putpalette([0, 0, 0, 200, 10, 10] + [0] * 762)
    image.paste(0, (0, 0, 4, 8))  # left half uses index 0: transparent
    image.save(path, transparency=0)
    info = probe(path)
    assert info.mode == "P" and "transparency composited on white" in info.conversions[0]
    pixels = load_rgb(path)
    assert (pixels[:, :4] == 255).all() and tuple(pixels[0, 6]) == (200, 10, 10)


@pytest.mark.parametrize(
    "mode, value, expected",
    [
        ("LA", (100, 0), (255, 255, 255)),  # fully transparent grey: white
        ("LA", (100, 255), (100, 100, 100)),  # opaque grey
        ("RGBA", (10, 20, 30, 255), (10, 20, 30)),
        ("L", 77, (77, 77, 77)),
        ("1", 1, (255, 255, 255)),
    ],
)
def test_modes_convert_to_rgb(tmp_path, mode, value, expected):
    path = tmp_path / f"{mode}.png"
    Image.new(mode, (8, 8), value).save(path)
    info = probe(path)
    assert info.mode == mode and info.conversions
    pixels = load_rgb(path)
    assert pixels.shape == (8, 8, 3) and tuple(pixels[4, 4]) == expected


def test_float_tiff(tmp_path):
    path = tmp_path / "float.tif"
    Image.fromarray(np.full((8, 8), 0.5, np.float32)).save(path)
    assert probe(path).mode == "F"
    assert tuple(load_rgb(path)[0, 0]) == (128, 128, 128)


def test_arrays_are_writable(tmp_path):
    path = tmp_path / "rgb.png"
    Image.fromarray(pattern()).save(path)
    assert load_rgb(path).flags.writeable


@pytest.mark.parametrize(
    "content, code",
    [
        (b"", "zero_byte"),
        (b"hello, I am a caption\n", "not_an_image"),
        (b"GIF89a" + bytes(40), "unsupported_format"),
        (b"\x00\x00\x00\x18ftypheic" + bytes(40), "unsupported_format"),
        (b"\x89PNG\r\n\x1a\n" + bytes(40), "decode_failed"),
    ],
)
def test_unopenable_files(tmp_path, content, code):
    path = tmp_path / "x.jpg"
    path.write_bytes(content)
    with pytest.raises(ImageProblem) as caught:
        probe(path)
    assert caught.value.code == code and caught.value.fix


def test_truncated_jpeg_probes_but_does_not_decode(tmp_path):
    path = tmp_path / "cut.jpg"
    noisy = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noisy).save(path, quality=95)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert probe(path).width == 64  # the header is intact
    for decode in (verify, load_rgb):
        with pytest.raises(ImageProblem) as caught:
            decode(path)
        assert caught.value.code == "truncated"


@pytest.mark.parametrize("size", [(10000, 10), (10, 9000), (20000, 20000), (9500, 9500)])
def test_huge_images_are_refused_before_decoding(tmp_path, size):
    """Side over 8192 or over 64 MP; 20000² is past PIL's own bomb limit, 9500² past its warning."""
    path = tmp_path / "huge.png"
    path.write_bytes(png_header(*size))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a PIL DecompressionBombWarning must not escape either
        for read in (probe, load_rgb):
            with pytest.raises(ImageProblem) as caught:
                read(path)
            assert caught.value.code == "too_large"


def test_real_wide_image_is_refused(tmp_path):
    path = tmp_path / "wide.png"
    Image.new("L", (10000, 10)).save(path)
    with pytest.raises(ImageProblem, match="too large"):
        probe(path)
