"""A LoRA from the difference of two models (kohya's extract_lora_from_models.py, ComfyUI's LoraSave).

For every 2-D `<module>.weight` that differs, ΔW = tuned − base (fp32) is reduced by SVD to the rule's
rank; the kept directions are split √σ to each factor, alpha = rank (scale 1). Module names are the
state dict's (ComfyUI module paths, so the file loads in ComfyUI with every key matched). A LoRA holds
only matrices: biases, norm scales and other tensors that differ are reported, never dropped unsaid.

Large matrices go through torch.svd_lowrank (randomized: q = cap + 16 directions, 4 power iterations)
unless svd="full"; the energy report is measured on the final factors against ΔW either way, so it is
exact whatever SVD produced them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from .files import Lora, LoraWeights
from .tools import ModuleReport, RankRule, Report

SVD_MODES = ("auto", "full", "lowrank")
FULL_SVD_UP_TO = 1024  # auto: matrices whose smaller side is at most this get the exact SVD
OVERSAMPLE, POWER_ITERATIONS = 16, 4


def _torch():
    try:
        import torch
    except ImportError:
        raise RuntimeError("extracting a LoRA needs PyTorch; install torch (ComfyUI has it) and run again") from None
    return torch


def _factors(torch, delta, rule: RankRule, svd: str):
    """(U [out,k'], σ [k'], Vᵀ [k',in], whether randomized) for the rule: every σ, or the largest cap + 16."""
    smaller = min(delta.shape)
    sample = min(smaller, (rule.rank or smaller) + OVERSAMPLE)
    randomized = svd == "lowrank" or (svd == "auto" and smaller > FULL_SVD_UP_TO and sample < smaller // 2)
    if rule.method == "sv_cumulative":
        randomized = False  # Σσ needs every σ
    if randomized:
        U, S, V = torch.svd_lowrank(delta, q=sample, niter=POWER_ITERATIONS)
        return U, S, V.T, True
    U, S, Vt = torch.linalg.svd(delta, full_matrices=False)
    return U, S, Vt, False


def _clamped(torch, B, A, quantile: float):
    """Factor entries beyond the quantile of their absolute values clamped (kohya's --clamp_quantile)."""
    values = torch.cat([B.flatten(), A.flatten()]).abs()
    limit = values.kthvalue(max(1, math.ceil(quantile * values.numel()))).values
    return B.clamp(-limit, limit), A.clamp(-limit, limit)


def _residual(torch, delta, B, A, energy: float) -> float:
    """‖ΔW − B@A‖² = ‖ΔW‖² − 2⟨BᵀΔW, A⟩ + ⟨BᵀB, AAᵀ⟩, without forming B@A."""
    B, A = B.double(), A.double()  # float64: the terms cancel to a residual far below them
    inner = float(torch.sum((B.T @ delta.double()) * A))
    own = float(torch.sum((B.T @ B) * (A @ A.T)))
    return max(0.0, energy - 2 * inner + own)


def extract_module(
    delta, rule: RankRule, *, name: str = "module", clamp_quantile: float | None = None, svd: str = "auto"
) -> tuple[LoraWeights, ModuleReport, bool]:
    """One [out, in] float32 torch difference → (its LoRA, its report, whether randomized SVD made it)."""
    torch = _torch()
    U, S, Vt, randomized = _factors(torch, delta, rule, svd)
    energy = float(torch.sum(delta.double() ** 2))
    singular = S.double().cpu().numpy()
    keep = rule.pick(singular, total=energy)
    root = S[:keep].clamp(min=0).sqrt()
    B, A = U[:, :keep] * root, root[:, None] * Vt[:keep]
    if clamp_quantile is not None:
        B, A = _clamped(torch, B, A, clamp_quantile)
    residual = _residual(torch, delta, B, A, energy)
    weights = LoraWeights(A.float().cpu().numpy(), B.float().cpu().numpy(), float(keep))
    return weights, ModuleReport(name, min(delta.shape), keep, energy, residual), randomized


def _check(rule: RankRule, clamp_quantile, min_diff: float, svd: str) -> None:
    if rule.rank is None:
        raise ValueError("extract needs a rank (with a dynamic method, the most any module keeps), e.g. 32")
    if svd not in SVD_MODES:
        raise ValueError(f"unknown svd {svd!r}; choose one of {list(SVD_MODES)}")
    if clamp_quantile is not None and not 0 < clamp_quantile <= 1:
        raise ValueError(f"clamp_quantile must be in (0, 1] (kohya's default 0.99), got {clamp_quantile}")
    if not min_diff >= 0:
        raise ValueError(f"min_diff must be ≥ 0 (a relative change ‖ΔW‖/‖W‖), got {min_diff}")


def extract(
    base: Mapping,
    tuned: Mapping,
    rule: RankRule,
    *,
    clamp_quantile: float | None = None,
    min_diff: float = 0.0,
    svd: str = "auto",
    device=None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[Lora, Report]:
    """The LoRA of tuned − base. base/tuned: state dicts ({key: torch tensor or numpy array}, read one key
    at a time, so lazy mappings keep one pair in memory). min_diff: matrices whose relative change
    ‖ΔW‖/‖W‖ is at most this are left out (0: only equal ones)."""
    _check(rule, clamp_quantile, min_diff, svd)
    torch = _torch()
    device = torch.device(device or "cpu")
    common = sorted(set(base) & set(tuned))
    lora, report = (
        {},
        Report(
            f"extract ({rule.describe()}" + (f", clamp {clamp_quantile:g}" if clamp_quantile is not None else "") + ")"
        ),
    )
    equal, small, randomized, other = 0, [], 0, []
    for index, key in enumerate(common):
        before, after = _as_float(torch, base[key], device), _as_float(torch, tuned[key], device)
        if before.shape != after.shape:
            raise ValueError(
                f"{key}: base is {list(before.shape)} but tuned is {list(after.shape)}; the two models "
                "are not the same architecture (extract needs a base and its fine-tune)"
            )
        if torch.equal(before, after):
            equal += key.endswith(".weight") and before.ndim == 2
        elif key.endswith(".weight") and before.ndim == 2:
            delta = after - before
            change = float(delta.norm() / before.norm().clamp(min=1e-30))
            if change <= min_diff:
                small.append(key)
            else:
                name = key.removesuffix(".weight")
                lora[name], module, lowrank = extract_module(
                    delta, rule, name=name, clamp_quantile=clamp_quantile, svd=svd
                )
                report.modules.append(module)
                randomized += lowrank
        else:
            other.append((key, float((after - before).norm() / before.norm().clamp(min=1e-30))))
        if progress is not None:
            progress(index + 1, len(common))
    report.notes += _notes(base, tuned, equal, small, min_diff, randomized, other)
    if not lora:
        raise ValueError(
            "the two models have no differing weight matrix"
            + (f" above min_diff {min_diff:g}" if small else "")
            + "; is tuned really a fine-tune of base (and not the same model)?"
        )
    return lora, report


def _notes(base, tuned, equal, small, min_diff, randomized, other) -> list[str]:
    notes = [f"{equal} weight matrices are equal in both models and need no LoRA"]
    if small:
        notes.append(
            f"{len(small)} matrices changed by at most min_diff {min_diff:g} (relative) and are left out, "
            f"e.g. {small[0]}"
        )
    if randomized:
        notes.append(
            f"{randomized} modules by randomized SVD (torch.svd_lowrank, {POWER_ITERATIONS} power iterations;"
            " energy measured exactly); svd full gives the exact truncation, slower"
        )
    if other:
        shown = ", ".join(f"{key} ({100 * change:.2g}%)" for key, change in sorted(other, key=lambda o: -o[1])[:5])
        notes.append(
            f"{len(other)} other tensors differ (biases, norm scales, embeddings…) and a LoRA cannot hold "
            f"them; the LoRA leaves them as in the base: {shown}{' …' if len(other) > 5 else ''}"
        )
    for side, mine, theirs in (("base", base, tuned), ("tuned", tuned, base)):
        only = sorted(set(mine) - set(theirs))
        if only:
            notes.append(f"{len(only)} tensors are only in {side} and left out, e.g. {only[0]}")
    return notes


def _as_float(torch, value, device):
    tensor = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
    return tensor.detach().to(device=device, dtype=torch.float32)  # a model's parameters may require grad


# ---------------------------------------------------------------- model files

_PREFIXES = ("model.diffusion_model.", "diffusion_model.")  # a full checkpoint's, a diffusion model's own
_QUANT_AUX = (".weight_scale", ".scale_weight", ".comfy_quant", ".input_scale", ".scale_input", ".weight_scale_2")


class ModelFile(Mapping):
    """A diffusion-model .safetensors (ComfyUI's, or a full checkpoint's `model.diffusion_model.` part) as a
    lazy state dict keyed by ComfyUI module paths: tensors are read one at a time (safetensors' mmap),
    float8 weights decoded with their per-tensor scale (ComfyUI's scaled fp8 files)."""

    def __init__(self, path):
        try:
            from safetensors import safe_open
        except ImportError:
            raise RuntimeError("reading model files needs the safetensors package (ComfyUI has it)") from None
        self.path = str(path)
        self._file = safe_open(self.path, framework="pt", device="cpu")
        names = list(self._file.keys())
        self._names = set(names)
        prefix = next((p for p in _PREFIXES if any(n.startswith(p) for n in names)), "")
        self._keys = {
            n[len(prefix) :]: n
            for n in names
            if n.startswith(prefix) and not n.endswith(_QUANT_AUX) and n != "scaled_fp8"
        }
        if not self._keys:
            raise ValueError(f"{self.path}: no model weights found; give a diffusion-model .safetensors file")

    def __getitem__(self, key):
        stored = self._keys[key]
        tensor = self._file.get_tensor(stored)
        if tensor.dtype.is_floating_point and tensor.element_size() == 1:
            tensor = tensor.float() * self._scale(stored)
        elif not tensor.dtype.is_floating_point and stored.endswith(".weight"):
            raise ValueError(
                f"{self.path}: {stored} is stored as {tensor.dtype} (a packed quantized format); "
                "extract from the bf16/fp16/fp32 (or float8) files of both models"
            )
        return tensor

    def _scale(self, stored: str):
        layer = stored.rsplit(".", 1)[0]
        for suffix in (".weight_scale", ".scale_weight"):
            if layer + suffix in self._names:
                scale = self._file.get_tensor(layer + suffix).float()
                if scale.numel() != 1:
                    raise ValueError(
                        f"{self.path}: {layer}{suffix} is a block scale {list(scale.shape)}; Kiln "
                        "decodes per-tensor float8 only: extract from the bf16 files"
                    )
                return scale.reshape(())
        return 1.0

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
