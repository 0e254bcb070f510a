"""Starting a run from an existing LoRA (any layout lora_sources reads) instead of B = 0.

The file decides the run's rank and alpha (they replace the config's before anything hashes or saves the
config), and the run records where it started: `init_lora` (the file's path or name) and
`init_lora_sha256` (of the file, or of a LORA_MODEL's tensors) go into its config, so into the run folder's
hash and into every saved LoRA's metadata as `kiln.init_lora`.

One rank and one alpha per run, as Kiln trains: a file whose modules differ is made to fit exactly, never
approximately (a diffusers file with its own A for each of q, k and v reads as one fused module of three
times the rank, so mixed ranks are common and refusing them would refuse most diffusers files):
  - rank: the largest module's; a smaller module fills its first rows of A and columns of B, and its extra
    rows of A start as a new LoRA's (the run's seeded init) with B's extra columns zero, so B·A is the
    file's and the extra rank trains like a new LoRA's;
  - alpha: the file's when every module of that rank has the same, else alpha = rank; any module whose
    alpha/rank differs from the run's has the ratio multiplied into its B (the same product).
Modules the run targets but the file lacks start as a new LoRA's (B zero); modules in the file that the
run does not target stop the run, named (the fix: add them to targets).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import config as config_module
from ..config import TrainConfig
from ..lora.adapters import require_lora
from ..lora.files import Lora, LoraWeights, from_tensors, load_lora

log = logging.getLogger("kiln")


@dataclass(frozen=True)
class InitLora:
    """A LoRA to start from: its weights (Kiln's in-memory form), a name to show, and its sha256."""

    lora: Lora
    name: str
    sha256: str


def from_file(path, arch: str | None = None) -> InitLora:
    """A LoRA file of any trainer's layout; the sha256 is the file's (lora_sources.file_identity)."""
    from ..lora.sources import file_identity

    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(
            f"init_lora: {path} is not a file; give the path of a .safetensors LoRA to start "
            "from, or leave init_lora empty to start a new LoRA"
        )
    lora, _ = load_lora(path, arch=arch)
    require_lora(lora, "init_lora", str(path))
    return InitLora(lora, str(path), file_identity(path)["sha256"])


def tensors_sha256(tensors: Mapping[str, np.ndarray]) -> str:
    """A digest of a LoRA's tensors (names, dtypes, shapes, bytes), independent of their order."""
    digest = hashlib.sha256()
    for key in sorted(tensors):
        array = np.ascontiguousarray(tensors[key])
        digest.update(json.dumps([key, array.dtype.str, list(array.shape)]).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def from_tensors_named(tensors: Mapping[str, np.ndarray], name: str, arch: str | None = None) -> InitLora:
    """A LoRA given as tensors (a ComfyUI LORA_MODEL, as numpy); the sha256 is of the tensors."""
    lora, _ = from_tensors(tensors, arch=arch, source=name)
    require_lora(lora, "init_lora", name)
    return InitLora(lora, name, tensors_sha256(tensors))


def rank_and_alpha(lora: Lora) -> tuple[int, float]:
    """The run's rank and alpha for this LoRA (module docstring: the largest rank; its alpha if shared)."""
    rank = max(w.rank for w in lora.values())
    alphas = {w.alpha for w in lora.values() if w.rank == rank}
    return rank, alphas.pop() if len(alphas) == 1 else float(rank)


def settle(cfg: TrainConfig, init: InitLora) -> TrainConfig:
    """The config with the file's rank and alpha and the init's name and sha256 (a no-op when it has them);
    a config that names another sha256 (a run started from another file) stops with both named."""
    if cfg.init_lora_sha256 and cfg.init_lora_sha256 != init.sha256:
        raise ValueError(
            f"init_lora {init.name}: its sha256 is {init.sha256[:12]}…, but the config says "
            f"init_lora_sha256 {cfg.init_lora_sha256[:12]}… (the file changed since the run "
            "started?); start a new run (clear init_lora_sha256) or give back the original file"
        )
    rank, alpha = rank_and_alpha(init.lora)
    if (cfg.rank, cfg.alpha, cfg.init_lora, cfg.init_lora_sha256) == (rank, alpha, init.name, init.sha256):
        return cfg
    try:
        settled = config_module.replace(cfg, rank=rank, alpha=alpha, init_lora=init.name, init_lora_sha256=init.sha256)
    except config_module.ConfigError as error:
        raise config_module.ConfigError(f"init_lora {init.name}: {error} (rank and alpha come from the file)") from None
    if (cfg.rank, cfg.alpha) != (rank, alpha):
        log.info(
            "[Kiln] init_lora %s: rank %d, alpha %g from the file (the config said rank %d, alpha %g)%s",
            init.name,
            rank,
            alpha,
            cfg.rank,
            cfg.alpha,
            _fitting_note(init.lora, rank, alpha),
        )
    return settled


def _fitting_note(lora: Lora, rank: int, alpha: float) -> str:
    padded = sum(w.rank < rank for w in lora.values())
    folded = sum(w.scale != alpha / rank for w in lora.values())
    notes = [
        f"{padded} module(s) of a smaller rank padded to {rank} (the product unchanged)" if padded else "",
        f"{folded} module(s) with another alpha/rank have it multiplied into B" if folded else "",
    ]
    return "".join(f"; {note}" for note in notes if note)


def prepare(cfg: TrainConfig, init: InitLora | None = None) -> tuple[TrainConfig, InitLora | None]:
    """(settled config, init LoRA): the one given, else the file cfg.init_lora names, else none."""
    if init is None and cfg.init_lora:
        init = from_file(cfg.init_lora, cfg.arch)
    if init is None:
        return cfg, None
    return settle(cfg, init), init


def start_weights(fresh: Lora, init: InitLora) -> Lora:
    """The weights a run starts from: `fresh` (the backend's new LoRA, at the run's rank and alpha) with
    every module of the init LoRA put in (padded and scaled to fit; module docstring)."""
    untargeted = sorted(set(init.lora) - set(fresh))
    if untargeted:
        raise ValueError(
            f"init_lora {init.name}: {len(untargeted)} of its module(s) are not among this run's "
            f"targets: {', '.join(untargeted[:6])}{', …' if len(untargeted) > 6 else ''}; add them to "
            "targets (Kiln Training Options, or `targets` in the config), e.g. "
            f"{sorted({_suffix_pattern(path) for path in untargeted})}, or start from a LoRA of these targets"
        )
    weights = dict(fresh)
    for path, file_weights in init.lora.items():
        start = fresh[path]
        if file_weights.A.shape[1] != start.A.shape[1] or file_weights.B.shape[0] != start.B.shape[0]:
            raise ValueError(
                f"init_lora {init.name}: {path} is {file_weights.B.shape[0]}x{file_weights.A.shape[1]} "
                f"in the file but {start.B.shape[0]}x{start.A.shape[1]} in this model; the LoRA is "
                "for another model (family or size)"
            )
        rank, ratio = file_weights.rank, file_weights.scale / start.scale
        A = start.A.copy()
        A[:rank] = file_weights.A
        B = np.zeros_like(start.B)
        B[:, :rank] = file_weights.B if ratio == 1.0 else file_weights.B * np.float32(ratio)
        weights[path] = LoraWeights(A, B, start.alpha)
    return weights


def _suffix_pattern(path: str) -> str:
    """A target pattern for a module path: what follows its block number ('double_blocks.0.img_mlp.0' →
    'img_mlp.0'), which config.targets matches as a suffix in every block."""
    parts = path.split(".")
    number = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
    return ".".join(parts[number + 1 :]) if number is not None else path


def load_into(backend, init: InitLora, ema: bool) -> None:
    """Put the init LoRA into a backend set up at its rank and alpha; the EMA shadow starts from it too."""
    weights = start_weights(backend.lora_state(), init)
    backend.load_lora_state(weights)
    if ema:
        backend.load_ema_state({f"{path}.{role}": getattr(w, role) for path, w in weights.items() for role in "AB"})
