"""Writing a checkpoint folder (trainer/run/state.py reads it): built in a hidden temp folder and renamed into
place, so a crash at any moment leaves either no folder or a complete one; one being deleted is renamed out of
sight first, and the hidden leftovers of a killed writer (.tmp-step-*, .old-step-*) are removed by the next save.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from .. import safetensors_io
from ..atomic import atomic_write_text, fault_point, fsync_dir, require_free_space
from ..lora import files as lora_format
from ..lora.files import LoraWeights
from . import state
from .state import RUN_FORMAT, History, list_checkpoints, step_dir


def _lora_tensors(lora: dict[str, LoraWeights], prefix: str) -> dict[str, np.ndarray]:
    out = {}
    for path, weights in lora.items():
        for role, array in state.module_roles(weights).items():
            out[f"{prefix}{path}.{role}"] = array
        out[f"{prefix}{path}.alpha"] = np.asarray(weights.alpha, dtype=np.float32)
    return out


_LORA_ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
_HEADER_BYTES_PER_TENSOR = 256  # a safetensors header entry: name, dtype, shape, offsets


def _checkpoint_bytes(
    lora: dict[str, LoraWeights], tensors: dict[str, np.ndarray], run_json: str, save_dtype: str
) -> int:
    """About what a checkpoint takes on disk: lora.safetensors + state.safetensors + run.json."""
    itemsize = _LORA_ITEMSIZE.get(save_dtype, 4)
    lora_bytes = sum(sum(a.size for a in state.module_roles(w).values()) * itemsize + 4 for w in lora.values())
    state_bytes = sum(np.asarray(v).nbytes for v in tensors.values())
    headers = _HEADER_BYTES_PER_TENSOR * (sum(1 + len(state.module_roles(w)) for w in lora.values()) + len(tensors))
    return lora_bytes + state_bytes + headers + len(run_json.encode("utf-8"))


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    backend,
    arch,
    config: dict,
    numpy_rng: np.random.Generator,
    cursor: dict,
    history: History,
    keep: int,
    lora_metadata: dict[str, str],
    save_dtype: str = "bf16",
    rank_rng: list[dict[str, np.ndarray]] = (),
) -> Path:
    """Write <run>/step-NNNNNN atomically; prune to the newest `keep`: the oldest first, so `keep` checkpoints
    never need room for keep+1, but the newest complete one stays until the new one is complete.
    `rank_rng`: the RNG states of ranks 1..N-1 of a torchrun run (rank 0 is `backend`), saved as
    rng.rank<r>.<name>; the run's world size goes into run.json, and a resume needs the same."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _prune(run_dir, max(keep - 1, 1), step)
    fault_point(f"checkpoint:{step}:pruned")
    lora = backend.lora_state()
    optimizer_tensors, optimizer_meta = backend.optimizer_state()
    tensors = _state_tensors(backend, lora, optimizer_tensors, rank_rng)
    info = {
        "format": RUN_FORMAT,
        "step": step,
        "arch": arch.name,
        "backend": backend.name,
        "config": config,
        "world_size": 1 + len(rank_rng),
        "numpy_rng": numpy_rng.bit_generator.state,
        "cursor": cursor,
        "optimizer": optimizer_meta,
        "history": {
            "loss": history.loss,
            "lr": history.lr,
            "grad_norm": history.grad_norm,
            "skipped": history.skipped,
            "holdout": history.holdout,
        },
    }
    run_json = json.dumps(info, indent=1)
    final = step_dir(run_dir, step)
    require_free_space(
        run_dir,
        _checkpoint_bytes(lora, tensors, run_json, save_dtype),
        f"checkpoint {final.name}",
        f"free space on that disk, lower keep_checkpoints (now {keep}), or set output_dir to a "
        "folder on a larger disk; then resume",
    )
    temp = run_dir / f".tmp-{final.name}-{os.getpid()}"
    _write_folder(temp, lora, tensors, run_json, arch=arch, save_dtype=save_dtype, lora_metadata=lora_metadata)
    fault_point(f"checkpoint:{step}:complete")
    _rename_into_place(temp, final)
    fault_point(f"checkpoint:{step}:renamed")
    _prune(run_dir, keep, step)
    return final


def _state_tensors(
    backend, lora: dict[str, LoraWeights], optimizer_tensors: dict[str, np.ndarray], rank_rng
) -> dict[str, np.ndarray]:
    """state.safetensors: exact LoRA (a full fine-tune's weights), EMA shadow, optimizer moments, every rank's RNG
    states."""
    tensors = _lora_tensors(lora, "lora.")
    tensors.update({f"full.{k}": v for k, v in getattr(backend, "full_state", dict)().items()})  # torch only
    tensors.update({f"ema.{k}": v for k, v in backend.ema_state().items()})
    tensors.update({f"optim.{k}": v for k, v in optimizer_tensors.items()})
    tensors.update({f"rng.{k}": v for k, v in backend.rng_state().items()})
    for rank, states in enumerate(rank_rng, start=1):
        tensors.update({f"rng.rank{rank}.{k}": v for k, v in states.items()})
    return tensors


def _write_folder(
    temp: Path,
    lora,
    tensors: dict[str, np.ndarray],
    run_json: str,
    *,
    arch,
    save_dtype: str,
    lora_metadata: dict[str, str],
) -> None:
    """The checkpoint's three files into a fresh hidden folder, run.json last, synced to disk."""
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        lora_format.save_lora(
            temp / "lora.safetensors", lora, arch=arch, fmt="comfy", dtype=save_dtype, metadata=lora_metadata
        )
        # a full fine-tune's bf16 weights come as their bits (full.exact): stored as BF16, read back as fp32
        bits = {k: "BF16" for k, v in tensors.items() if k.startswith("full.") and v.dtype == np.uint16}
        safetensors_io.write(temp / "state.safetensors", tensors, {"kiln.format": RUN_FORMAT}, dtype=bits)
        atomic_write_text(temp / "run.json", run_json)
        fsync_dir(temp)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)  # a full disk or an error: no half checkpoint left behind
        raise


def _rename_into_place(temp: Path, final: Path) -> None:
    """temp → final in one rename; a folder already there (the same step saved again, e.g. a stop right after
    a periodic save) is renamed out of sight first and deleted after."""
    old = None
    if final.exists():
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(temp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _prune(run_dir: Path, keep: int, step: int) -> None:
    """Keep the newest `keep` complete checkpoints; clear the hidden leftovers of killed writers."""
    for _, path in list_checkpoints(run_dir)[:-keep]:
        trash = run_dir / f".old-{path.name}-{os.getpid()}"
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(path, trash)  # out of sight in one step: a kill mid-delete never leaves half a step folder
        fault_point(f"checkpoint:{step}:pruning")
        shutil.rmtree(trash, ignore_errors=True)
    for stale in [*run_dir.glob(".tmp-step-*"), *run_dir.glob(".old-step-*")]:
        if not stale.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)
