"""Resumable run state: checkpoint folders written atomically, the newest K kept.

Layout (DESIGN.md):
  <run>/step-000500/lora.safetensors    the LoRA as a user loads it (save_dtype, comfy keys)
  <run>/step-000500/state.safetensors   exact fp32 LoRA, EMA shadow, optimizer moments, torch RNG
  <run>/step-000500/run.json            config, step, numpy RNG, data cursor, loss history; written last
A checkpoint is built in a hidden temp folder and renamed into place, so a
crash at any moment leaves either no folder or a complete one. No pickle.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import lora_format, safetensors_io
from .atomic import atomic_write_text, fsync_dir
from .lora_format import LoraWeights

RUN_FORMAT = "kiln-run/1"
STEP_DIR = re.compile(r"^step-(\d{6,})$")


@dataclass
class History:
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)   # {"step", "items"}: NaN/inf steps left out of training


@dataclass
class Checkpoint:
    path: Path
    step: int
    info: dict[str, Any]          # run.json
    tensors: dict[str, np.ndarray]  # state.safetensors


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"step-{step:06d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (a run.json present), oldest first. Temp folders never count."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for child in run_dir.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / "run.json").is_file() and (child / "state.safetensors").is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def _lora_tensors(lora: dict[str, LoraWeights], prefix: str) -> dict[str, np.ndarray]:
    out = {}
    for path, weights in lora.items():
        out[f"{prefix}{path}.A"] = weights.A
        out[f"{prefix}{path}.B"] = weights.B
        out[f"{prefix}{path}.alpha"] = np.asarray(weights.alpha, dtype=np.float32)
    return out


def _lora_from(tensors: dict[str, np.ndarray], prefix: str) -> dict[str, LoraWeights]:
    paths = sorted({key[len(prefix):-2] for key in tensors if key.startswith(prefix) and key.endswith(".A")})
    return {p: LoraWeights(A=tensors[f"{prefix}{p}.A"], B=tensors[f"{prefix}{p}.B"],
                           alpha=float(tensors[f"{prefix}{p}.alpha"])) for p in paths}


def save_checkpoint(run_dir: str | Path, step: int, *, backend, arch, config: dict, numpy_rng: np.random.Generator,
                    cursor: dict, history: History, keep: int, lora_metadata: dict[str, str],
                    save_dtype: str = "bf16") -> Path:
    """Write <run>/step-NNNNNN atomically; prune to the newest `keep`."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _prune(run_dir, max(keep - 1, 1))  # room first, but never drop the last good one before the new one exists
    final = step_dir(run_dir, step)
    temp = run_dir / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    lora = backend.lora_state()
    lora_format.save_lora(temp / "lora.safetensors", lora, arch=arch, fmt="comfy",
                          dtype=save_dtype, metadata=lora_metadata)
    optimizer_tensors, optimizer_meta = backend.optimizer_state()
    tensors = _lora_tensors(lora, "lora.")
    tensors.update({f"ema.{k}": v for k, v in backend.ema_state().items()})
    tensors.update({f"optim.{k}": v for k, v in optimizer_tensors.items()})
    tensors.update({f"rng.{k}": v for k, v in backend.rng_state().items()})
    safetensors_io.write(temp / "state.safetensors", tensors, {"kiln.format": RUN_FORMAT})
    info = {
        "format": RUN_FORMAT, "step": step, "arch": arch.name, "backend": backend.name, "config": config,
        "numpy_rng": numpy_rng.bit_generator.state, "cursor": cursor, "optimizer": optimizer_meta,
        "history": {"loss": history.loss, "lr": history.lr, "grad_norm": history.grad_norm,
                    "skipped": history.skipped},
    }
    atomic_write_text(temp / "run.json", json.dumps(info, indent=1))
    fsync_dir(temp)
    if final.exists():  # the same step saved again (e.g. a stop right after a periodic save)
        shutil.rmtree(final)
    os.replace(temp, final)
    fsync_dir(run_dir)
    _prune(run_dir, keep)
    return final


def _prune(run_dir: Path, keep: int) -> None:
    for _, path in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    for stale in run_dir.glob(".tmp-step-*"):  # left by a killed writer
        if not stale.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)


def load_checkpoint(path: str | Path) -> Checkpoint:
    """A checkpoint folder, or a run folder (its newest complete checkpoint)."""
    path = Path(path)
    if not STEP_DIR.match(path.name):
        found = list_checkpoints(path)
        if not found:
            raise FileNotFoundError(f"{path}: no complete checkpoint (step-NNNNNN with run.json) to resume from")
        path = found[-1][1]
    try:
        info = json.loads((path / "run.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path / 'run.json'}: unreadable run state ({err}); resume from an earlier checkpoint") from err
    if info.get("format") != RUN_FORMAT:
        raise ValueError(f"{path / 'run.json'}: not a Kiln run state (format {info.get('format')!r})")
    tensors, _ = safetensors_io.read(path / "state.safetensors")
    return Checkpoint(path=path, step=int(info["step"]), info=info, tensors=tensors)


def checkpoint_lora(checkpoint: Checkpoint, *, ema: bool = False) -> dict[str, LoraWeights]:
    """The exact fp32 LoRA (or its EMA shadow) saved in a checkpoint, without a backend."""
    lora = _lora_from(checkpoint.tensors, "lora.")
    if not ema:
        return lora
    shadow = {k[4:]: v for k, v in checkpoint.tensors.items() if k.startswith("ema.")}
    if not shadow:
        raise ValueError(f"{checkpoint.path}: this run trained without EMA; set ema on in Training Options "
                         "(or use the LoRA as trained)")
    return {path: LoraWeights(A=shadow[f"{path}.lora_A"], B=shadow[f"{path}.lora_B"], alpha=w.alpha)
            for path, w in lora.items()}


def checkpoint_history(checkpoint: Checkpoint) -> History:
    saved = checkpoint.info["history"]
    return History(loss=list(saved["loss"]), lr=list(saved["lr"]), grad_norm=list(saved["grad_norm"]),
                   skipped=list(saved.get("skipped", [])))


def restore(checkpoint: Checkpoint, *, backend, numpy_rng: np.random.Generator, sampler) -> History:
    """Put every piece of state back: weights, EMA, optimizer, RNGs, cursor. Returns the history."""
    tensors = checkpoint.tensors
    saved_by = checkpoint.info.get("backend", backend.name)
    if saved_by != backend.name:
        raise ValueError(f"{checkpoint.path}: this checkpoint was written by the {saved_by} backend and cannot "
                         f"resume with {backend.name} (optimizer state differs); set backend = \"{saved_by}\", "
                         "or start a new run from its lora.safetensors")

    def section(prefix: str) -> dict[str, np.ndarray]:
        return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

    backend.load_lora_state(_lora_from(tensors, "lora."))
    backend.load_ema_state(section("ema."))
    backend.load_optimizer_state(section("optim."), checkpoint.info["optimizer"])
    backend.load_rng_state(section("rng."))
    numpy_rng.bit_generator.state = checkpoint.info["numpy_rng"]
    sampler.load_state(checkpoint.info["cursor"])
    return checkpoint_history(checkpoint)
