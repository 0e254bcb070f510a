"""Reading training images safely: a cheap header probe, and a full decode to 8-bit RGB.

Every failure comes out as an ImageProblem with a stable code and a fix, never
as one of PIL's many exception types: one bad file must not stop a dataset.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".jfif", ".jpe", ".webp", ".bmp", ".tif", ".tiff"})
# Clips (clips.py reads them): extension → the container it should hold, as a report names it.
CLIP_FORMATS = {".mp4": "MP4", ".webm": "WebM", ".mov": "QuickTime", ".mkv": "Matroska", ".gif": "GIF"}
# What each extension should hold (MPO is how PIL names many camera JPEGs).
EXTENSION_FORMATS = {
    ".png": ("PNG",),
    ".jpg": ("JPEG", "MPO"),
    ".jpeg": ("JPEG", "MPO"),
    ".jfif": ("JPEG", "MPO"),
    ".jpe": ("JPEG", "MPO"),
    ".webp": ("WEBP",),
    ".bmp": ("BMP",),
    ".tif": ("TIFF",),
    ".tiff": ("TIFF",),
}
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "TIFF")  # what Image.open may try; MPO comes via JPEG
MAX_SIDE = 8192
MAX_PIXELS = 8192 * 8192  # 64 MP: beyond this a file is treated as a decompression bomb

# EXIF orientation → the transpose that shows the image upright (as ImageOps.exif_transpose).
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_ORIENTATION_WORDS = {
    2: "mirrored",
    3: "rotated 180°",
    4: "flipped vertically",
    5: "mirrored and rotated 90°",
    6: "rotated 90° clockwise",
    7: "mirrored and rotated 90°",
    8: "rotated 90° counter-clockwise",
}

# File signatures, to name what a file really is when PIL will not open it.
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"8BPS", "PSD"),
    (b"%PDF", "PDF"),
    (b"\xff\x0a", "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL ", "JPEG XL"),
    (b"\x00\x00\x01\x00", "ICO"),
)
_FTYP_BRANDS = {
    b"heic": "HEIC",
    b"heix": "HEIC",
    b"hevc": "HEIC",
    b"mif1": "HEIF",
    b"msf1": "HEIF",
    b"avif": "AVIF",
    b"avis": "AVIF",
}


class ImageProblem(Exception):
    """Why one image cannot be used: a stable code, a message and what to do."""

    def __init__(self, code: str, message: str, fix: str):
        super().__init__(message)
        self.code, self.message, self.fix = code, message, fix


@dataclass(frozen=True)
class ImageInfo:
    """What the header says. width/height are as displayed, i.e. after EXIF orientation."""

    width: int
    height: int
    format: str  # PIL's format name: "PNG", "JPEG", "MPO", ...
    mode: str  # PIL's mode as stored: "RGB", "CMYK", "I;16", "P", ...
    orientation: int = 1  # EXIF orientation tag; 1 is upright
    conversions: tuple[str, ...] = ()  # what load_rgb converts: "CMYK → RGB", "palette → RGB", ...

    @property
    def rotation(self) -> str:
        """What load_rgb does for the EXIF orientation ("" when upright)."""
        if self.orientation not in _TRANSPOSE:
            return ""
        return f"{_ORIENTATION_WORDS[self.orientation]} (EXIF orientation {self.orientation})"

    @property
    def notes(self) -> tuple[str, ...]:
        """Everything load_rgb does to the stored pixels, for Item.notes."""
        return self.conversions + ((self.rotation,) if self.rotation else ())


def probe(path: str | Path, data: bytes | None = None) -> ImageInfo:
    """Header only, no pixel decode. `data` is the file's bytes when the caller already read them."""
    with _open(path, data) as image:
        return _info(image)


def load_rgb(path: str | Path, data: bytes | None = None) -> np.ndarray:
    """The image upright as uint8 [H, W, 3]: EXIF applied, any mode converted, alpha composited on white."""
    with _open(path, data) as image:
        info = _info(image)
        try:
            upright = image.transpose(_TRANSPOSE[info.orientation]) if info.orientation in _TRANSPOSE else image
            return _to_rgb(upright)
        except Exception as err:  # PIL raises many types for broken data; all mean the same here
            raise _decode_problem(err, info.format) from err


def load_grey(path: str | Path, max_side: int) -> np.ndarray:
    """The image upright as float32 luminance [H, W] in 0..255 (ITU-R 601, PIL's "L"), shrunk to at most
    `max_side` px a side; a JPEG is decoded straight to grey at a reduced scale, so this stays cheap."""
    with _open(path, None) as image:
        info = _info(image)
        try:
            image.draft("L", (max_side, max_side))  # JPEG only: decode at 1/2, 1/4 or 1/8 scale, as grey
            grey = (
                image.convert("L")
                if image.mode in ("L", "RGB", "CMYK", "YCbCr")
                else Image.fromarray(_to_rgb(image)).convert("L")
            )
            if info.orientation in _TRANSPOSE:
                grey = grey.transpose(_TRANSPOSE[info.orientation])
            grey.thumbnail((max_side, max_side), Image.Resampling.BOX)
        except Exception as err:  # see load_rgb
            raise _decode_problem(err, info.format) from err
    return np.asarray(grey, dtype=np.float32)


def load_mask(path: str | Path, alpha: bool = False) -> np.ndarray | None:
    """A loss mask upright as float32 [H, W] in 0..1: the file's luminance (white trains, black does not),
    or with alpha=True the image's alpha channel (None when it has none)."""
    with _open(path, None) as image:
        info = _info(image)
        if alpha and not _has_alpha(image):
            return None
        try:
            upright = image.transpose(_TRANSPOSE[info.orientation]) if info.orientation in _TRANSPOSE else image
            grey = upright.convert("RGBA").getchannel("A") if alpha else Image.fromarray(_to_rgb(upright)).convert("L")
        except Exception as err:  # see load_rgb
            raise _decode_problem(err, info.format) from err
    return np.asarray(grey, dtype=np.float32) / 255.0


def verify(path: str | Path, data: bytes | None = None) -> ImageInfo:
    """Decode every pixel (to catch truncation and corrupt data) without converting it."""
    with _open(path, data) as image:
        info = _info(image)
        try:
            image.load()
        except Exception as err:  # see load_rgb
            raise _decode_problem(err, info.format) from err
    return info


def sniff(head: bytes) -> str | None:
    """The format a file's first bytes announce, or None."""
    for signature, name in _SIGNATURES:
        if head.startswith(signature):
            return name
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[4:8] == b"ftyp":
        return _FTYP_BRANDS.get(head[8:12], "MP4/QuickTime")
    return None


def _open(path: str | Path, data: bytes | None) -> Image.Image:
    """Image.open restricted to the formats we train on (PIL reads only the header); failures → ImageProblem."""
    try:
        head = data[:16] if data is not None else _head(Path(path))
    except OSError as err:
        raise ImageProblem(
            "unreadable",
            f"cannot read the file: {err.strerror or err}",
            "check the file's permissions, or copy it out of the cloud/network folder",
        ) from err
    if not head:
        raise ImageProblem("zero_byte", "the file is empty (0 bytes)", "re-export or re-download it, or delete it")
    try:
        image = Image.open(Path(path) if data is None else io.BytesIO(data), formats=SUPPORTED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise _too_large("past PIL's decompression-bomb limit") from err
    except Exception as err:  # UnidentifiedImageError, SyntaxError, struct.error, ...
        raise _unopenable(head, Path(path).name, err) from err
    if image.width > MAX_SIDE or image.height > MAX_SIDE or image.width * image.height > MAX_PIXELS:
        image.close()
        raise _too_large(f"{image.width}×{image.height} px")
    if image.width < 1 or image.height < 1:
        image.close()
        raise ImageProblem("decode_failed", f"the header says {image.width}×{image.height} px", "re-export the image")
    return image


def _head(path: Path) -> bytes:
    with path.open("rb") as file:
        return file.read(16)


def _info(image: Image.Image) -> ImageInfo:
    orientation = _orientation(image)
    width, height = image.size
    if orientation >= 5:  # 5–8 turn the image by 90°: displayed sides swap
        width, height = height, width
    return ImageInfo(width, height, image.format or "", image.mode, orientation, tuple(_conversions(image)))


def _orientation(image: Image.Image) -> int:
    """EXIF orientation 1–8, read without decoding pixels (PNG's getexif would load the whole image)."""
    if image.format == "PNG" and "exif" not in image.info:
        return 1
    try:
        value = image.getexif().get(0x0112, 1)
    except Exception:  # noqa: BLE001 — broken EXIF blocks are common; the pixels are still fine
        return 1
    return value if isinstance(value, int) and value in _TRANSPOSE else 1


def _conversions(image: Image.Image) -> list[str]:
    mode, transparent = image.mode, "transparency" in image.info
    if mode == "RGB":
        notes = ["16-bit → 8-bit"] if ";16" in _rawmode(image) else []
        return notes + (["transparent colour composited on white"] if transparent else [])
    words = {
        "CMYK": "CMYK → RGB",
        "P": "palette → RGB",
        "L": "grayscale → RGB",
        "1": "1-bit → RGB",
        "I": "32-bit integer grayscale → 8-bit RGB",
        "F": "32-bit float grayscale → 8-bit RGB",
        "RGBA": "RGBA → RGB",
        "LA": "grayscale with alpha (LA) → RGB",
        "PA": "palette with alpha → RGB",
        "YCbCr": "YCbCr → RGB",
        "LAB": "Lab → RGB",
    }
    note = "16-bit grayscale → 8-bit RGB" if mode.startswith("I;16") else words.get(mode, f"{mode} → RGB")
    if _has_alpha(image):
        note += ", transparency composited on white"
    return [note]


def _rawmode(image: Image.Image) -> str:
    """How the decoder reads the data, e.g. 'RGB;16B' for a 16-bit RGB PNG that PIL reduces to 8 bits."""
    tile = getattr(image, "tile", None) or []
    args = tile[0][3] if tile and len(tile[0]) > 3 else ""
    return args if isinstance(args, str) else str(args[0]) if isinstance(args, tuple) and args else ""


def _has_alpha(image: Image.Image) -> bool:
    return image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info


def _to_rgb(image: Image.Image) -> np.ndarray:
    """Decode and convert to uint8 [H, W, 3]."""
    mode = image.mode
    if mode.startswith("I;16") or mode == "I":
        # 16-bit (and 32-bit integer, read as 16-bit range) grayscale: keep the top 8 bits.
        values = np.clip(np.asarray(image).astype(np.int64), 0, 65535) >> 8
        return np.repeat(values.astype(np.uint8)[..., None], 3, axis=2)
    if mode == "F":
        # Float images carry no range; 0..1 is the common convention, else treat as 0..255.
        values = np.nan_to_num(np.asarray(image, dtype=np.float32), nan=0.0, posinf=255.0, neginf=0.0)
        scale = 255.0 if values.size and values.max() <= 1.0 else 1.0
        return np.repeat(np.clip(values * scale + 0.5, 0, 255).astype(np.uint8)[..., None], 3, axis=2)
    if _has_alpha(image):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.array(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.array(image if mode == "RGB" else image.convert("RGB"))


def _too_large(detail: str) -> ImageProblem:
    return ImageProblem(
        "too_large",
        f"too large ({detail}): over {MAX_SIDE} px a side or {MAX_PIXELS // 2**20} MP",
        f"downscale it to at most {MAX_SIDE} px on the long side (training never needs more)",
    )


def _unopenable(head: bytes, name: str, err: Exception) -> ImageProblem:
    actual = sniff(head)
    if actual in SUPPORTED_FORMATS:
        return ImageProblem(
            "decode_failed",
            f"corrupt {actual} header ({_reason(err)})",
            "re-export or re-download the image, or delete it",
        )
    if actual is not None:
        return ImageProblem(
            "unsupported_format",
            f"is a {actual} file (named {name}), which Kiln does not read",
            "convert it to PNG or JPEG",
        )
    return ImageProblem(
        "not_an_image", f"not an image file (starts with {head[:12]!r})", "replace it with the real image, or delete it"
    )


def _decode_problem(err: Exception, image_format: str) -> ImageProblem:
    if isinstance(err, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return _too_large("past PIL's decompression-bomb limit")
    reason = _reason(err)
    if "truncated" in reason or isinstance(err, EOFError):
        return ImageProblem(
            "truncated",
            f"truncated {image_format} ({reason}): the file ends before the image does",
            "re-export or re-download it (an interrupted copy or download), or delete it",
        )
    return ImageProblem(
        "decode_failed",
        f"cannot decode this {image_format} ({reason})",
        "re-export it from an image editor, or delete it",
    )


def _reason(err: Exception) -> str:
    text = str(err).strip() or type(err).__name__
    return text[:200]
