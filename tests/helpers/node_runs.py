"""The node tests' graph in a few calls: a captioned dataset → Load Dataset → Encode Images → Encode Captions, and
Train LoRA with small settings (tests/nodes/). Import after helpers.comfy_env.require_comfy(): it imports the nodes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

import kiln_pack.nodes.dataset_nodes as dn
import kiln_pack.nodes.train_nodes as tn
from helpers import comfy_env


def make_dataset(folder: Path, count: int = 4) -> Path:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        size = (64, 64) if i % 2 else (96, 64)
        Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"{{trigger}}, a photo number {i}", encoding="utf-8")
    return folder


def out(result, index=0):
    return result.result[index] if hasattr(result, "result") else result[index]


def encoded_dataset(comfy_dirs, vae, clip, name):
    make_dataset(comfy_dirs / "input" / name)
    loaded = dn.KilnLoadDataset.execute(name, "kiln", "", "", "64", 1, 0.0)
    ds = out(dn.KilnEncodeImages.execute(out(loaded), vae))
    return out(dn.KilnEncodeCaptions.execute(ds, clip))


def train(model, ds, steps=20, **kw):
    args = dict(
        steps=steps, learning_rate=1e-3, rank=4, alpha=4.0, optimizer="adamw", preset="none", backend="torch", seed=1
    )
    options = dict(kw.pop("options", {}))
    options.setdefault("device", "auto" if comfy_env.gpu() else "cpu")
    options.setdefault("mixed_precision", "bf16" if comfy_env.gpu() else "no")
    options.setdefault("checkpoint_every", 0)
    return tn.KilnTrainLoRA.execute(model, ds, **args, options=options, **kw)
