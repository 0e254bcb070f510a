"""What users do with LoRAs after training: merge several into one, resize one's rank, and the energy
report both give. (Extracting a LoRA from two models is lora_extract.py.)

Every module's LoRA is a low-rank delta ΔW = scale·B@A ([out, r] @ [r, in]). Merging concatenates the
weighted deltas exactly (rank = Σ ranks, scales folded, so alpha = rank); reducing a rank takes the SVD of
ΔW, which for a low-rank product needs no dense matrix: QR of B and of Aᵀ leaves an r×r core whose SVD
is ΔW's (O((out+in)·r²) instead of O(out·in·min(out,in))). The kept directions are split √σ to each
factor, alpha = rank (scale 1: every loader, diffusers' included, reads that the same). "Energy" is the
squared Frobenius norm; a module keeps Σ kept σ² / Σ σ² of its delta.
Rank rules as kohya's resize_lora.py names them (new_rank, sv_ratio, sv_fro, sv_cumulative), without its
cap at full rank − 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .adapters import require_lora
from .files import Lora, LoraWeights

# ---------------------------------------------------------------- rank rules


def _by_ratio(singular: np.ndarray, target: float, total: float) -> int:
    """Directions whose σ is within `target`× of the largest (kohya's sv_ratio)."""
    return int(np.sum(singular > singular[0] / target))


def _by_fro(singular: np.ndarray, target: float, total: float) -> int:
    """Fewest directions whose Frobenius norm is ≥ `target` of the whole's: Σσ² ≥ target²·‖ΔW‖²."""
    return int(np.searchsorted(np.cumsum(singular**2) / total, target**2)) + 1


def _by_cumulative(singular: np.ndarray, target: float, total: float) -> int:
    """Fewest directions whose Σσ is ≥ `target` of the whole Σσ (needs every σ)."""
    return int(np.searchsorted(np.cumsum(singular) / singular.sum(), target)) + 1


# method → (pick, whether a value is allowed, what the value is)
DYNAMIC: dict[str, tuple[Callable[[np.ndarray, float, float], int], Callable[[float], bool], str]] = {
    "sv_ratio": (_by_ratio, lambda v: v >= 1, "keep σ > σ_max / value (≥ 1; e.g. 10)"),
    "sv_fro": (_by_fro, lambda v: 0 < v <= 1, "keep this fraction of the Frobenius norm (0 < value ≤ 1, e.g. 0.9)"),
    "sv_cumulative": (_by_cumulative, lambda v: 0 < v <= 1, "keep this fraction of Σσ (0 < value ≤ 1, e.g. 0.9)"),
}


@dataclass(frozen=True)
class RankRule:
    """How many directions each module keeps: a fixed rank, or a dynamic method with rank as its cap."""

    rank: int | None = None  # fixed rank; with a method, the most any module keeps (None: no cap)
    method: str | None = None  # one of DYNAMIC
    value: float | None = None  # the method's target

    def __post_init__(self):
        if self.rank is not None and (not isinstance(self.rank, int) or self.rank < 1):
            raise ValueError(f"rank must be a whole number ≥ 1, got {self.rank!r}")
        if self.method is None:
            if self.rank is None:
                raise ValueError("give a rank, or a dynamic method (sv_ratio, sv_fro, sv_cumulative) and its value")
            return
        if self.method not in DYNAMIC:
            raise ValueError(f"unknown rank method {self.method!r}; choose one of {list(DYNAMIC)}")
        _, valid, meaning = DYNAMIC[self.method]
        if self.value is None or not math.isfinite(self.value) or not valid(self.value):
            raise ValueError(f"{self.method} {self.value!r} is out of range: {meaning}")

    def pick(self, singular: np.ndarray, total: float | None = None) -> int:
        """Directions to keep from descending singular values (total: ‖ΔW‖², when only the largest σ are
        known); at least 1, at most len(singular) and the cap."""
        available = len(singular)
        if self.method is None:
            return min(self.rank, available)
        total = float(np.sum(singular**2)) if total is None else total
        count = available if singular[0] <= 0 else DYNAMIC[self.method][0](singular, self.value, total)
        return max(1, min(count, available, self.rank or available))

    def describe(self) -> str:
        if self.method is None:
            return f"rank {self.rank}"
        return f"{self.method} {self.value:g}" + (f" (at most rank {self.rank})" if self.rank else "")


# ---------------------------------------------------------------- the report


@dataclass
class ModuleReport:
    name: str
    rank_in: int  # the delta's rank before (merge: Σ ranks; extract: min(out, in))
    rank: int  # kept
    energy: float  # ‖ΔW‖² of the exact delta
    residual: float  # ‖ΔW − new B@A·scale‖²

    @property
    def kept(self) -> float:
        return 1.0 - self.residual / self.energy if self.energy > 0 else 1.0


@dataclass
class Report:
    operation: str
    modules: list[ModuleReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def energy(self) -> float:
        return sum(m.energy for m in self.modules)

    @property
    def kept(self) -> float:
        """Energy kept over all modules together."""
        energy = self.energy
        return 1.0 - sum(m.residual for m in self.modules) / energy if energy > 0 else 1.0

    def to_dict(self) -> dict:
        return {
            "operation": self.operation,
            "kept": self.kept,
            "energy": self.energy,
            "notes": list(self.notes),
            "modules": [
                {"name": m.name, "rank_in": m.rank_in, "rank": m.rank, "energy": m.energy, "kept": m.kept}
                for m in self.modules
            ],
        }


def format_report(report: Report, worst: int = 8) -> str:
    """A few lines for a person: ranks before → after, energy kept overall and where it is lowest."""
    modules = report.modules
    if not modules:
        return "\n".join([f"{report.operation}: no modules", *report.notes])
    ranks_in, ranks = sorted({m.rank_in for m in modules}), [m.rank for m in modules]
    span = lambda values: f"{min(values)}" if min(values) == max(values) else f"{min(values)}–{max(values)}"
    summary = (
        f"{report.operation}: {len(modules)} modules, rank {span(ranks_in)} → {span(ranks)} "
        f"(mean {np.mean(ranks):.1f}, {sum(ranks)} in all); energy kept {100 * report.kept:.2f}% overall "
        f"(relative Frobenius error {math.sqrt(max(0.0, 1 - report.kept)):.4f})"
    )
    lines = [summary]
    lossy = sorted((m for m in modules if m.kept < 1 - 1e-6), key=lambda m: m.kept)[:worst]
    if lossy:
        lines.append(f"lowest kept energy (of {len(modules)}):")
        lines += [f"  {100 * m.kept:7.2f}%  rank {m.rank_in:>4} → {m.rank:<4} {m.name}" for m in lossy]
    return "\n".join(lines + [f"note: {note}" for note in report.notes])


# ---------------------------------------------------------------- the math


def _product_svd(B: np.ndarray, A: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """SVD of B@A ([out, r] @ [r, in]) through the r×r core, in float64: U [out, k], σ [k], Vᵀ [k, in]."""
    Qb, Rb = np.linalg.qr(B.astype(np.float64))
    Qa, Ra = np.linalg.qr(A.astype(np.float64).T)
    Uc, singular, Vct = np.linalg.svd(Rb @ Ra.T)
    return Qb @ Uc, singular, Vct @ Qa.T


def _split(U: np.ndarray, singular: np.ndarray, Vt: np.ndarray, keep: int) -> LoraWeights:
    """The first `keep` directions as a LoRA with scale 1, √σ on each side."""
    root = np.sqrt(singular[:keep])
    return LoraWeights(
        (root[:, None] * Vt[:keep]).astype(np.float32), (U[:, :keep] * root).astype(np.float32), float(keep)
    )


def _energy(B: np.ndarray, A: np.ndarray) -> float:
    """‖B@A‖² = Σ (BᵀB) ∘ (AAᵀ) without forming B@A."""
    B, A = B.astype(np.float64), A.astype(np.float64)
    return float(np.sum((B.T @ B) * (A @ A.T)))


def _truncated(name: str, B: np.ndarray, A: np.ndarray, rule: RankRule) -> tuple[LoraWeights, ModuleReport]:
    """B@A (scale already in B) to the rule's rank."""
    U, singular, Vt = _product_svd(B, A)
    keep = rule.pick(singular)
    energy = float(np.sum(singular**2))
    return _split(U, singular, Vt, keep), ModuleReport(
        name, A.shape[0], keep, energy, float(np.sum(singular[keep:] ** 2))
    )


def _capped_note(report: Report, rule: RankRule) -> None:
    if rule.method is None:
        short = [m for m in report.modules if m.rank < rule.rank]
        if short:
            report.notes.append(
                f"{len(short)} modules have fewer than {rule.rank} directions (e.g. {short[0].name}, "
                f"rank {short[0].rank}); they keep all they have"
            )


def resize(lora: Lora, rule: RankRule, *, operation: str = "resize") -> tuple[Lora, Report]:
    """Every module to the rule's rank by SVD of B@A·scale; alpha = new rank (scale 1), so at full rank the
    effect is unchanged."""
    require_lora(lora, operation)
    out, report = {}, Report(f"{operation} ({rule.describe()})")
    for name in sorted(lora):
        w = lora[name]
        out[name], module = _truncated(name, w.B * np.float32(w.scale), w.A, rule)
        report.modules.append(module)
    _capped_note(report, rule)
    return out, report


def merge(
    loras: Sequence[Lora],
    weights: Sequence[float] | None = None,
    rule: RankRule | None = None,
    *,
    sources: Sequence[str] | None = None,
) -> tuple[Lora, Report]:
    """Σ weight·B@A·scale per module. No rule: exact (A stacked, weighted scaled Bs side by side, rank = Σ
    ranks, alpha = rank); with a rule, that exact sum reduced by SVD. A module in only some inputs takes
    theirs; a module whose shapes differ between inputs is an error (LoRAs of different models)."""
    weights = [1.0] * len(loras) if weights is None else [float(w) for w in weights]
    sources = list(sources) if sources is not None else [f"LoRA {i + 1}" for i in range(len(loras))]
    for lora, source in zip(loras, sources):
        require_lora(lora, "merge", source)
    if not loras or len(weights) != len(loras) or len(sources) != len(loras):
        raise ValueError(
            f"merge needs one weight and one name per LoRA, got {len(loras)} LoRAs, {len(weights)} "
            f"weights and {len(sources)} names"
        )
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"merge weights must be finite numbers, got {weights}")
    used = [(lora, w, source) for lora, w, source in zip(loras, weights, sources) if w != 0]
    if not used:
        raise ValueError("every merge weight is 0; give at least one LoRA a non-zero weight")
    merged, partial = {}, []
    for name in sorted({name for lora, _, _ in used for name in lora}):
        parts = [(lora[name], w, source) for lora, w, source in used if name in lora]
        if len(parts) < len(used):
            partial.append(f"{name} (in {', '.join(s for _, _, s in parts)})")
        first = parts[0]
        for part in parts[1:]:
            if (part[0].B.shape[0], part[0].A.shape[1]) != (first[0].B.shape[0], first[0].A.shape[1]):
                raise ValueError(
                    f"{name}: {part[2]} changes a [{part[0].B.shape[0]}, {part[0].A.shape[1]}] weight but {first[2]} "
                    f"a [{first[0].B.shape[0]}, {first[0].A.shape[1]}] one; merge only LoRAs made for one model"
                )
        A = np.concatenate([p.A for p, _, _ in parts])
        B = np.concatenate([p.B * np.float32(w * p.scale) for p, w, _ in parts], axis=1)
        merged[name] = LoraWeights(A, B, float(A.shape[0]))
    label = "merge of " + " + ".join(f"{w:g}×{s}" for _, w, s in used)
    if rule is None:
        report = Report(
            f"{label} (exact)", [ModuleReport(n, w.rank, w.rank, _energy(w.B, w.A), 0.0) for n, w in merged.items()]
        )
    else:
        merged, report = resize(merged, rule, operation=label)
    if partial:
        report.notes.append(
            f"{len(partial)} modules are in only some inputs and take theirs alone: "
            + "; ".join(partial[:4])
            + (" …" if len(partial) > 4 else "")
        )
    skipped = [s for _, w, s in zip(loras, weights, sources) if w == 0]
    if skipped:
        report.notes.append(f"weight 0, left out: {', '.join(skipped)}")
    return merged, report


def dense_delta(lora: Lora, name: str) -> np.ndarray:
    """scale·B@A of one module as a dense [out, in] float64 matrix (for checks and small models)."""
    w = lora[name]
    return w.scale * (w.B.astype(np.float64) @ w.A.astype(np.float64))
