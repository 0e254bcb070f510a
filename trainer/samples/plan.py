"""Validation samples of a headless run: which images (the config's prompts with their settings
resolved), and where they go (`<run>/samples/step-NNNNNN-pK.png`, PNG text chunks saying how each
was made). What draws them is the front end's (ComfyUI's sampler, through nodes/comfy/)."""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..archs import get_arch
from ..atomic import atomic_write_bytes
from ..config import TrainConfig
from ..config.checks import parse_prompt

SAMPLES_DIR = "samples"
# A video model's sample length (the node's default; headless runs'): 4k+1 frames, as Wan's VAE packs them in 9.
SAMPLE_FRAMES = 33


@dataclass(frozen=True)
class SamplePrompt:
    """One image to sample at each sampling step, every setting resolved."""

    index: int
    prompt: str
    negative: str
    seed: int
    steps: int
    cfg: float
    sampler_name: str
    scheduler: str
    width: int
    height: int


def sample_plan(cfg: TrainConfig) -> list[SamplePrompt]:
    """The config's sample prompts: a prompt's own settings, else the sample_* settings, else (0 / auto)
    the model family's; with sample_walk_seed prompt N's seed is sample_seed + N."""
    family = get_arch(cfg.arch).sampling
    plan = []
    for index, entry in enumerate(cfg.sample_prompts):
        own = parse_prompt(entry)
        seed = own.get("seed", (cfg.sample_seed + index * cfg.sample_walk_seed) % 2**32)
        plan.append(
            SamplePrompt(
                index=index,
                prompt=own["prompt"].strip(),
                negative=own.get("negative", cfg.sample_negative),
                seed=seed,
                steps=own.get("steps", cfg.sample_steps) or family.steps,
                cfg=float(own.get("cfg", cfg.sample_cfg) or family.cfg),
                sampler_name=family.sampler if cfg.sample_sampler == "auto" else cfg.sample_sampler,
                scheduler=family.scheduler if cfg.sample_scheduler == "auto" else cfg.sample_scheduler,
                width=own.get("width", cfg.sample_width),
                height=own.get("height", cfg.sample_height),
            )
        )
    return plan


def sample_path(run_dir: str | Path, step: int, index: int, count: int, suffix: str = ".png") -> Path:
    """<run>/samples/step-000250-p0.png: by step, then prompt (numbered to sort: p00..p11 for 12 prompts);
    a video model's clip has the same name with suffix .webp."""
    return Path(run_dir) / SAMPLES_DIR / f"step-{step:06d}-p{index:0{len(str(max(count - 1, 0)))}d}{suffix}"


def parameters(prompt: SamplePrompt, step: int) -> str:
    """The A1111 `parameters` line most image viewers and sites read."""
    negative = f"\nNegative prompt: {prompt.negative}" if prompt.negative else ""
    return (
        f"{prompt.prompt}{negative}\nSteps: {prompt.steps}, Sampler: {prompt.sampler_name} "
        f"{prompt.scheduler}, CFG scale: {prompt.cfg:g}, Seed: {prompt.seed}, "
        f"Size: {prompt.width}x{prompt.height}, Kiln step: {step}"
    )


def save_sample(path: str | Path, image: np.ndarray, prompt: SamplePrompt, *, step: int, arch: str) -> Path:
    """An IMAGE ([H,W,3] float in [0,1]) as a PNG, bytes as ComfyUI's SaveImage makes them, written
    atomically. Text chunks: `parameters` (the A1111 line most image viewers and sites read) and
    `kiln.sample` (JSON: step, arch and every sampling setting)."""
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    pixels = np.clip(255.0 * np.asarray(image, dtype=np.float32), 0, 255).astype(np.uint8)
    info = PngInfo()
    info.add_text("parameters", parameters(prompt, step))
    info.add_text("kiln.sample", json.dumps({"step": step, "arch": arch, **asdict(prompt)}, ensure_ascii=False))
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", pnginfo=info, compress_level=4)  # SaveImage's level
    atomic_write_bytes(path, buffer.getvalue())
    return Path(path)


def describe(cfg: TrainConfig, run_dir: str | Path) -> str:
    """One line for the console: what is sampled when, and where it goes."""
    plan = sample_plan(cfg)
    when = f"every {cfg.sample_every} steps and at the end" if cfg.sample_every else "at the end"
    first = " (and before the first step)" if cfg.sample_first else ""
    return (
        f"samples: {len(plan)} prompt(s) {when}{first}, {plan[0].steps} steps cfg {plan[0].cfg:g} "
        f"{plan[0].sampler_name}/{plan[0].scheduler} → {Path(run_dir) / SAMPLES_DIR}"
    )
