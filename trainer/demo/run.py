"""`python -m trainer demo`: a complete run on CPU in about a minute, through the real loop and backend.

A generated image set (coloured shapes with captions, written as a normal
dataset folder), fixed stand-ins for the VAE and the text encoder, the tiny
Flux2-shaped DiT, and the same loop, state and LoRA files as a real run.
"""

from __future__ import annotations

import io
import os
import shutil
import zlib
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from .. import config as config_module
from ..atomic import atomic_write_bytes, atomic_write_text, fsync_dir

LATENT_CHANNELS, DOWNSCALE, CONTEXT_TOKENS, CONTEXT_DIM = 16, 8, 8, 32

# After quick_test, sized for a CPU: 200 steps, rank 16, two buckets, EMA on.
DEMO_SETTINGS = dict(
    arch="demo",
    device="cpu",
    mixed_precision="no",
    steps=200,
    batch_size=2,
    rank=16,
    alpha=16.0,
    learning_rate=1e-3,
    lr_schedule="cosine_with_warmup",
    warmup_steps=20,
    min_lr_ratio=0.1,
    caption_dropout=0.05,
    ema=True,
    ema_decay=0.95,
    checkpoint_every=50,
    keep_checkpoints=2,
    log_every=10,
    resolutions=[128],
    trigger_word="kiln_shape",
    run_name="demo",
)

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 30)}


def demo_config(**overrides) -> config_module.TrainConfig:
    return config_module.from_dict({**DEMO_SETTINGS, **overrides})


def make_images(folder: Path, count: int = 12, seed: int = 0) -> list[Path]:
    """Coloured shapes on gradients, 128×128 and 128×96 (two buckets), each with a .txt caption."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        width, height = (128, 128) if index % 3 else (128, 96)
        shape, colour = SHAPES[index % len(SHAPES)], list(COLOURS)[index % len(COLOURS)]
        top = np.array(rng.integers(0, 255, 3)), np.array(rng.integers(0, 255, 3))
        ramp = np.linspace(0, 1, height)[:, None, None]
        pixels = (top[0] * (1 - ramp) + top[1] * ramp).repeat(width, axis=1).astype(np.uint8)
        image = Image.fromarray(pixels)
        draw = ImageDraw.Draw(image)
        cx, cy, r = int(rng.integers(40, width - 40)), int(rng.integers(35, height - 35)), int(rng.integers(18, 30))
        box = [cx - r, cy - r, cx + r, cy + r]
        if shape == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif shape == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLOURS[colour])
        path = folder / f"shape_{index:02d}.png"
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        atomic_write_bytes(path, buffer.getvalue())
        atomic_write_text(path.with_suffix(".txt"), f"{{trigger}}, a {colour} {shape} on a soft gradient\n")
        paths.append(path)
    return paths


def make_dataset(folder: Path, seed: int = 0) -> None:
    """make_images into a hidden sibling, renamed into place: a killed run never leaves half a dataset."""
    folder = Path(folder)
    if folder.is_dir():
        make_images(folder, seed=seed)  # same bytes again, each file replaced atomically; the cache stays
        return
    for stale in folder.parent.glob(f".{folder.name}.tmp-*"):  # a killed run's, or ours from before
        shutil.rmtree(stale, ignore_errors=True)
    temp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    make_images(temp, seed=seed)
    os.replace(temp, folder)
    fsync_dir(folder.parent)


def _projection(seed: int = 1234) -> np.ndarray:
    """A fixed [16, 192] matrix with orthonormal rows: the stand-in VAE's encoder."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((3 * DOWNSCALE * DOWNSCALE, LATENT_CHANNELS)))
    return q.T.astype(np.float32)


def encode_pixels(pixels: np.ndarray) -> np.ndarray:
    """Stand-in VAE: [B,H,W,3] in 0..1 → [-1,1] → 8×8 patches → fixed projection → [B,16,H/8,W/8], ~unit scale."""
    pixels = np.asarray(pixels, dtype=np.float32) * 2.0 - 1.0
    batch, height, width = pixels.shape[0], pixels.shape[1] // DOWNSCALE, pixels.shape[2] // DOWNSCALE
    patches = pixels.reshape(batch, height, DOWNSCALE, width, DOWNSCALE, 3).transpose(0, 1, 3, 2, 4, 5)
    patches = patches.reshape(batch, height, width, -1)  # [B,h,w,192]
    return (patches @ _projection().T).transpose(0, 3, 1, 2) / 4.0


def encode_text(caption: str) -> np.ndarray:
    """Stand-in text encoder: each word a fixed seeded vector; [8, 32], zero rows pad."""
    out = np.zeros((CONTEXT_TOKENS, CONTEXT_DIM), dtype=np.float32)
    for row, word in enumerate(caption.lower().replace(",", " ").split()[:CONTEXT_TOKENS]):
        out[row] = np.random.default_rng(zlib.crc32(word.encode())).standard_normal(CONTEXT_DIM)
    return out


VAE_IDENTITY, TEXT_IDENTITY = "kiln-demo-vae-1", "kiln-demo-text-1"


def model_for(cfg: config_module.TrainConfig):
    """The tiny DiT for cfg.backend: torch's TinyFlux, or its MLX port with bit-identical weights."""
    if cfg.backend == "mlx":
        try:
            from ..backends.mlx_backend.models.tiny import demo_model
        except ModuleNotFoundError as err:
            if err.name and err.name.split(".")[0] == "mlx":
                raise RuntimeError(
                    "backend 'mlx' needs MLX: pip install 'kiln-lora[mlx]' (Apple Silicon), or 'mlx[cpu]' on Linux"
                ) from err
            raise
        # MLX has no autocast: bf16 mixed precision means a bf16 model (LoRA weights stay fp32).
        from ..backends.mlx_backend.models import quantize_base

        model = demo_model(cfg.seed, dtype="bfloat16" if cfg.mixed_precision == "bf16" else "float32")
        return quantize_base(model, "demo", cfg.base_quantize)
    from ..backends.torch_backend.devices import pick_device
    from .tiny_dit import build_tiny_flux

    # On the training device: the torch backend trains a model where it is (ComfyUI's session places its
    # models), and `device = "cuda"` on the demo once failed with weights on the CPU (an H200, 2026-11-24).
    return build_tiny_flux(cfg.seed).to(pick_device(cfg.device))


def build_data(cfg: config_module.TrainConfig, folder: Path, cache_dir: Path | None = None):
    """The real data path (scan, buckets, captions, caches) with the stand-in encoders."""
    from ..archs import get_arch
    from ..data.dataset import DataSettings
    from ..objective.preservation import encoded_datasets

    settings = DataSettings.from_config(cfg, get_arch(cfg.arch).bucket_divisor)
    dataset = encoded_datasets(
        cfg, settings, folder, (encode_pixels, VAE_IDENTITY), (encode_text, TEXT_IDENTITY), cache_dir
    )
    dataset.prune_cache(cfg.cache_max_gb)
    return dataset.training_data()
