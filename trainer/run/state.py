"""Resumable run state: the checkpoint folders of a run, listed, read, checked and put back into a backend
(trainer/run/checkpoint_writer.py writes them, atomically, the newest K kept).

Layout (DESIGN.md):
  <run>/step-000500/lora.safetensors    the LoRA as a user loads it (save_dtype, comfy keys)
  <run>/step-000500/state.safetensors   exact fp32 LoRA (lora.<path>.A/.B/.alpha), EMA shadow (ema.<path>.A/.B),
                                        optimizer moments, RNG states
  <run>/step-000500/run.json            config, step, numpy RNG, data cursor, loss history; written last
No pickle: run.json and every tensor are checked on load, and errors name the file and the key.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import safetensors_io
from ..backends.base import parameter_name
from ..lora import adapters
from ..lora.adapters import AdapterWeights
from ..lora.files import LoraWeights

RUN_FORMAT = "kiln-run/1"
STEP_DIR = re.compile(r"^step-(\d{6,})$")


@dataclass
class History:
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"step", "items"}: NaN/inf steps left out of training
    holdout: list[list] = field(default_factory=list)  # [step, loss] per held-out evaluation (trainer/run/holdout.py)


@dataclass
class Checkpoint:
    path: Path
    step: int
    info: dict[str, Any]  # run.json
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


def list_runs(root: str | Path) -> list[tuple[str, int]]:
    """(name, newest complete step) of each run folder directly under root that has a checkpoint,
    newest first (by folder time): what Load Run's picker and its error messages offer."""
    root = Path(root)
    runs = []
    for child in sorted(root.iterdir()) if root.is_dir() else []:
        found = list_checkpoints(child) if child.is_dir() and not child.name.startswith(".") else []
        if found:
            runs.append((child.stat().st_mtime, child.name, found[-1][0]))
    return [(name, step) for _, name, step in sorted(runs, key=lambda run: run[0], reverse=True)]


def module_roles(weights) -> dict[str, np.ndarray]:
    """A module's tensors by checkpoint role: A/B for LoRA, the adapter's role names (trainer/lora/adapters.py)."""
    return weights.tensors if isinstance(weights, AdapterWeights) else {"A": weights.A, "B": weights.B}


_ROLE_SUFFIXES = tuple(f".{role}" for role in ("A", "B", *adapters.ROLES))


def _by_module(tensors: dict[str, np.ndarray], prefix: str) -> dict[str, dict[str, np.ndarray]]:
    """'<prefix><path>.<role>' keys → {path: {role: array}}; alpha keys left out."""
    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, array in tensors.items():
        suffix = next((s for s in _ROLE_SUFFIXES if key.endswith(s)), None)
        if key.startswith(prefix) and suffix:
            modules.setdefault(key[len(prefix) : -len(suffix)], {})[suffix[1:]] = array
    return modules


def _weights_of(path: str, roles: dict[str, np.ndarray], alpha: float):
    if set(roles) == {"A", "B"}:
        return LoraWeights(A=roles["A"], B=roles["B"], alpha=alpha)
    return adapters.from_roles({**roles, "alpha": np.float32(alpha)}, source=path)


def _lora_from(tensors: dict[str, np.ndarray], prefix: str) -> dict[str, LoraWeights]:
    return {
        path: _weights_of(path, roles, float(tensors[f"{prefix}{path}.alpha"]))
        for path, roles in sorted(_by_module(tensors, prefix).items())
    }


_RESUME_FIX = "resume from an earlier checkpoint (delete this step folder), or start a new run"
# run.json key → the JSON type it must have.
_RUN_KEYS = {
    "step": int,
    "arch": str,
    "backend": str,
    "config": dict,
    "numpy_rng": dict,
    "cursor": dict,
    "optimizer": dict,
    "history": dict,
}
_MOMENTS = ("exp_avg", "exp_avg_sq", "m", "v")  # optimizer entries shaped like their parameter


def load_checkpoint(path: str | Path) -> Checkpoint:
    """A checkpoint folder, or a run folder (its newest complete checkpoint). Every field is checked."""
    path = Path(path)
    if not STEP_DIR.match(path.name):
        found = list_checkpoints(path)
        if not found:
            raise FileNotFoundError(f"{path}: no complete checkpoint (step-NNNNNN with run.json) to resume from")
        path = found[-1][1]
    info_path = path / "run.json"
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{info_path}: unreadable run state ({err}); {_RESUME_FIX}") from err
    if not isinstance(info, dict) or info.get("format") != RUN_FORMAT:
        found = info.get("format") if isinstance(info, dict) else type(info).__name__
        raise ValueError(
            f"{info_path}: not a Kiln run state (format {found!r}, expected {RUN_FORMAT!r}); {_RESUME_FIX}"
        )
    for key, kind in _RUN_KEYS.items():
        value = info.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(
                f"{info_path}: {key!r} is {type(value).__name__}, not {kind.__name__}; "
                f"the file was altered or damaged; {_RESUME_FIX}"
            )
    history = info["history"]
    if not all(isinstance(history.get(k), list) for k in ("loss", "lr", "grad_norm")):
        raise ValueError(f"{info_path}: 'history' needs loss, lr and grad_norm lists; {_RESUME_FIX}")
    folder_step = STEP_DIR.match(path.name)
    if folder_step and int(folder_step.group(1)) != info["step"]:
        raise ValueError(
            f"{info_path}: says step {info['step']} but its folder is {path.name}; "
            f"rename the folder to step-{info['step']:06d} or {_RESUME_FIX}"
        )
    tensors, _ = safetensors_io.read(path / "state.safetensors")
    _check_tensors(path / "state.safetensors", tensors)
    return Checkpoint(path=path, step=info["step"], info=info, tensors=_current_names(tensors))


def _current_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Checkpoints written before the EMA shadow took the trained LoRA's naming hold it as
    'ema.<path>.lora_A' / '.lora_B': read those as 'ema.<path>.A' / '.B', so old runs still resume."""

    def current(key: str) -> str:
        old = key.startswith("ema.") and key.endswith((".lora_A", ".lora_B"))
        return f"{key[: -len('.lora_A')]}.{key[-1]}" if old else key

    return {current(key): array for key, array in tensors.items()}


def _check_tensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Dtypes and shapes as save_checkpoint writes them: float32 LoRA (2-D A and B, scalar alpha),
    EMA and optimizer moments shaped like their parameter, integer RNG states."""

    def bad(key: str, problem: str) -> ValueError:
        array = tensors[key]
        return ValueError(
            f"{path}: tensor {key!r} is {array.dtype} {list(array.shape)}: {problem}; "
            f"the file was altered or damaged; {_RESUME_FIX}"
        )

    shapes = {}  # '<module path>.A' (EMA's name) and '<module path>.lora_A' (optimizer's, old EMA's) → shape
    for key, array in tensors.items():
        if key.startswith("lora.") and key.endswith((*_ROLE_SUFFIXES, ".alpha")):
            if array.dtype != np.float32:
                raise bad(key, "a checkpoint stores float32")
            if key.endswith(".alpha"):
                if array.shape != ():
                    raise bad(key, "alpha must be a scalar")
                continue
            if array.ndim != 2:
                raise bad(key, "LoRA A and B (and every adapter tensor) must be 2-D")
            shapes[key[5:]] = shapes[parameter_name(key[5:])] = array.shape
    for key, array in tensors.items():
        section, _, rest = key.partition(".")
        if section == "ema":
            if array.dtype != np.float32 or shapes.get(rest, array.shape) != array.shape:
                raise bad(
                    key, f"the EMA copy must be float32 {list(shapes.get(rest, array.shape))}, as its LoRA weight"
                )
        elif section == "optim":
            name, _, entry = rest.rpartition(".")
            if entry in _MOMENTS and name in shapes and (array.dtype.kind != "f" or array.shape != shapes[name]):
                raise bad(key, f"an optimizer moment must be float {list(shapes[name])}, as its LoRA weight")
        elif section == "rng" and array.dtype.kind not in "ui":
            raise bad(key, "an RNG state is an integer array")


def checkpoint_lora(checkpoint: Checkpoint, *, ema: bool = False) -> dict[str, LoraWeights]:
    """The exact fp32 LoRA (or its EMA shadow) saved in a checkpoint, without a backend."""
    lora = _lora_from(checkpoint.tensors, "lora.")
    if not ema:
        return lora
    shadow = {k[4:]: v for k, v in checkpoint.tensors.items() if k.startswith("ema.")}
    if not shadow:
        raise ValueError(
            f"{checkpoint.path}: this run trained without EMA; set ema on in Training Options "
            "(or use the LoRA as trained)"
        )
    return {
        path: _weights_of(path, roles, w.alpha)
        for path, w in lora.items()
        for roles in [{role: shadow[f"{path}.{role}"] for role in module_roles(w)}]
    }


def checkpoint_history(checkpoint: Checkpoint) -> History:
    saved = checkpoint.info["history"]
    return History(
        loss=list(saved["loss"]),
        lr=list(saved["lr"]),
        grad_norm=list(saved["grad_norm"]),
        skipped=list(saved.get("skipped", [])),
        holdout=[list(p) for p in saved.get("holdout", [])],
    )


def read_history(checkpoint_dir: str | Path) -> History:
    """A checkpoint's loss/lr history from its run.json alone (no tensors read): for a curve that starts
    before a resumed run's first step. Raises OSError/ValueError/KeyError/TypeError when unreadable."""
    info = json.loads((Path(checkpoint_dir) / "run.json").read_text(encoding="utf-8"))
    return checkpoint_history(Checkpoint(path=Path(checkpoint_dir), step=info["step"], info=info, tensors={}))


def restore(
    checkpoint: Checkpoint, *, backend, numpy_rng: np.random.Generator, sampler, rank: int = 0, world: int = 1
) -> History:
    """Put every piece of state back: weights, EMA, optimizer, RNGs (rank `rank`'s of a torchrun run of
    `world` ranks), cursor. Returns the history."""
    tensors = checkpoint.tensors
    _check_world(checkpoint, world)
    saved_by = checkpoint.info.get("backend", backend.name)
    if saved_by != backend.name:
        raise ValueError(
            f"{checkpoint.path}: this checkpoint was written by the {saved_by} backend and cannot "
            f'resume with {backend.name} (optimizer state differs); set backend = "{saved_by}", '
            "or start a new run from its lora.safetensors"
        )

    def section(prefix: str) -> dict[str, np.ndarray]:
        return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}

    try:
        backend.load_lora_state(_lora_from(tensors, "lora."))
        if section("full."):  # a full fine-tune's weights (adapter full, backend torch)
            backend.load_full_state(section("full."))
        backend.load_ema_state(section("ema."))
        backend.load_optimizer_state(section("optim."), checkpoint.info["optimizer"])
        backend.load_rng_state(section("rng." if rank == 0 else f"rng.rank{rank}."))
        numpy_rng.bit_generator.state = checkpoint.info["numpy_rng"]
        sampler.load_state(checkpoint.info["cursor"])
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as err:
        raise ValueError(
            f"{checkpoint.path}: cannot resume this run from it: {err!s}; resume with the settings "
            "it was trained with (rank, targets, optimizer, dataset), or start a new run"
        ) from err
    return checkpoint_history(checkpoint)


def _check_world(checkpoint: Checkpoint, world: int) -> None:
    """A run resumes on the number of ranks it trained on: the global batch (batch_size × ranks), hence the
    data order, and every rank's RNG stream depend on it. Anything else is refused, naming both ways on."""
    saved = checkpoint.info.get("world_size", 1)
    if saved == world:
        return

    def launch(n: int) -> str:
        return (
            "python -m trainer train CONFIG --resume"
            if n == 1
            else f"torchrun --nproc_per_node {n} -m trainer train CONFIG --resume"
        )

    raise ValueError(
        f"{checkpoint.path}: this run trained on {saved} process(es) and is resumed on {world}; a run "
        f"resumes exactly only on as many ({launch(saved)}), or start a new run (another run_name) on {world}; "
        "batch_size is per process, so the global batch is batch_size × processes"
    )
