"""Adapter kinds beside LoRA: LoKr, LoHa, DoRA. The facts both backends and the file code share.

Each kind is a few named tensors per targeted Linear (W [out, in]), named as ComfyUI's own weight
adapters read them (comfy/weight_adapter/lokr.py, loha.py, lora.py + base.weight_decompose, the same
keys in ComfyUI 0.17 and 0.33). The adapted weight W' is:
  lokr  W + s·kron(w1, w2),  w2 = lokr_w2 or lokr_w2_a @ lokr_w2_b (rank r); s = alpha/r, 1 for full w2
        w1 [out_m, in_m], w2 [out_n, in_n], (m, n) = LyCORIS's factorization(dim, lokr_factor)
  loha  W + s·(hada_w1_a @ hada_w1_b) ⊙ (hada_w2_a @ hada_w2_b); s = alpha/r
  dora  (W + s·B@A) · diag(m / (‖(W + s·B@A)[:, j]‖ + eps)); m = dora_scale [1, in]; s = alpha/r
DoRA's magnitude is per input column (dora_scale [1, in]): for a [out, 1] dora_scale ComfyUI divides
by the norm of the *base* weight, not of W + ΔW, so a row-wise DoRA would load differently than it
trained. In a checkpoint and in EMA the tensors keep these role names (LoRA's A/B as before).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

ADAPTER_KINDS = ("lora", "lokr", "loha", "dora")
EPS = float(np.finfo(np.float32).eps)  # ComfyUI's weight_decompose adds finfo(fp32).eps to the norm

# kind → (role in a checkpoint → key suffix in a file); the first role present tells the kind.
_SUFFIXES = {
    "lokr": {"lokr_w1": ".lokr_w1", "lokr_w2": ".lokr_w2", "lokr_w2_a": ".lokr_w2_a", "lokr_w2_b": ".lokr_w2_b"},
    "loha": {
        "hada_w1_a": ".hada_w1_a",
        "hada_w1_b": ".hada_w1_b",
        "hada_w2_a": ".hada_w2_a",
        "hada_w2_b": ".hada_w2_b",
    },
    "dora": {"A": ".lora_A.weight", "B": ".lora_B.weight", "dora_scale": ".dora_scale"},
}
_MARKERS = {"lokr_w1": "lokr", "hada_w1_a": "loha", "dora_scale": "dora"}
ROLES = tuple(sorted({role for suffixes in _SUFFIXES.values() for role in suffixes}))
FILE_SUFFIXES = tuple(sorted({s for suffixes in _SUFFIXES.values() for s in suffixes.values()}))


@dataclass
class AdapterWeights:
    kind: str  # "lokr" | "loha" | "dora"
    tensors: dict[str, np.ndarray]  # role → float32 array, roles as in _SUFFIXES[kind]
    alpha: float

    @property
    def rank(self) -> int:
        t = self.tensors
        return {
            "lokr": lambda: t["lokr_w2_b"].shape[0] if "lokr_w2_b" in t else 0,
            "loha": lambda: t["hada_w1_b"].shape[0],
            "dora": lambda: t["A"].shape[0],
        }[self.kind]()

    @property
    def scale(self) -> float:
        return 1.0 if self.rank == 0 else self.alpha / self.rank

    @property
    def size(self) -> int:
        return sum(int(np.asarray(v).size) for v in self.tensors.values())


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """LyCORIS's factorization: (m, n), m <= n, m·n = dimension; m = factor where it divides, else the
    split nearest a square with m <= factor (factor -1: no limit)."""
    if factor > 0 and dimension % factor == 0:
        m, n = factor, dimension // factor
        return (m, n) if m <= n else (n, m)
    factor = dimension if factor < 0 else factor
    m, n = 1, dimension
    while m < n:
        new_m = m + 1
        while dimension % new_m:
            new_m += 1
        new_n = dimension // new_m
        if new_m + new_n > m + n or new_m > factor:
            break
        m, n = new_m, new_n
    return (m, n) if m <= n else (n, m)


def _uniform(seed: int, key: str, rows: int, cols: int) -> np.ndarray:
    """Kaiming-uniform(a=√5) [rows, cols], seeded per module path and role (both backends alike)."""
    rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
    return rng.uniform(-1 / np.sqrt(cols), 1 / np.sqrt(cols), size=(rows, cols)).astype(np.float32)


def _normal(seed: int, key: str, rows: int, cols: int, std: float) -> np.ndarray:
    return (np.random.default_rng([seed, zlib.crc32(key.encode())]).standard_normal((rows, cols)) * std).astype(
        np.float32
    )


def lokr_shapes(in_features: int, out_features: int, factor: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((out_m, out_n), (in_m, in_n)): w1 is [out_m, in_m], w2 [out_n, in_n]."""
    return factorization(out_features, factor), factorization(in_features, factor)


def init_tensors(
    kind: str,
    seed: int,
    path: str,
    in_features: int,
    out_features: int,
    *,
    rank: int,
    lokr_factor: int = -1,
    lokr_full_w2: bool = False,
) -> dict[str, np.ndarray]:
    """The starting tensors (ΔW = 0; DoRA's dora_scale comes from the base weight, see magnitude())."""
    if kind == "lokr":  # LyCORIS: w1 Kaiming, w2 (or w2_b) zero
        (out_m, out_n), (in_m, in_n) = lokr_shapes(in_features, out_features, lokr_factor)
        tensors = {"lokr_w1": _uniform(seed, f"{path}.lokr_w1", out_m, in_m)}
        if lokr_full_w2:
            return {**tensors, "lokr_w2": np.zeros((out_n, in_n), np.float32)}
        return {
            **tensors,
            "lokr_w2_a": _uniform(seed, f"{path}.lokr_w2_a", out_n, rank),
            "lokr_w2_b": np.zeros((rank, in_n), np.float32),
        }
    if kind == "loha":  # LyCORIS: w1_a N(0, 0.1), w1_b and w2_b N(0, 1), w2_a zero
        return {
            "hada_w1_a": _normal(seed, f"{path}.hada_w1_a", out_features, rank, 0.1),
            "hada_w1_b": _normal(seed, f"{path}.hada_w1_b", rank, in_features, 1.0),
            "hada_w2_a": np.zeros((out_features, rank), np.float32),
            "hada_w2_b": _normal(seed, f"{path}.hada_w2_b", rank, in_features, 1.0),
        }
    if kind == "dora":  # LoRA's init; dora_scale is set from the base weight by the backend
        from .targets import init_lora_A

        return {"A": init_lora_A(seed, path, rank, in_features), "B": np.zeros((out_features, rank), np.float32)}
    raise ValueError(f"adapter {kind!r} has no init here; choose one of {list(ADAPTER_KINDS)}")


def magnitude(weight: np.ndarray) -> np.ndarray:
    """DoRA's starting dora_scale [1, in]: the base weight's column norms + eps, so step 0 = the base."""
    w = np.asarray(weight, np.float64)
    return (np.sqrt((w * w).sum(0)) + EPS).astype(np.float32)[None, :]


def adapted_weight(weights: AdapterWeights, base: np.ndarray) -> np.ndarray:
    """W' in closed form (float64), as ComfyUI's weight adapters compute it."""
    t = {k: np.asarray(v, np.float64) for k, v in weights.tensors.items()}
    W = np.asarray(base, np.float64)
    if weights.kind == "lokr":
        w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
        return W + weights.scale * np.kron(t["lokr_w1"], w2)
    if weights.kind == "loha":
        return W + weights.scale * (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
    merged = W + weights.scale * (t["B"] @ t["A"])
    return merged * (t["dora_scale"] / (np.sqrt((merged * merged).sum(0, keepdims=True)) + EPS))


def tensor_shapes(
    kind: str, in_features: int, out_features: int, rank: int, lokr_factor: int = -1, lokr_full_w2: bool = False
) -> list[tuple[int, int]]:
    """The trainable tensors one targeted Linear gets (estimate's count; LoRA's A and B included)."""
    if kind == "lokr":
        (out_m, out_n), (in_m, in_n) = lokr_shapes(in_features, out_features, lokr_factor)
        return [(out_m, in_m)] + ([(out_n, in_n)] if lokr_full_w2 else [(out_n, rank), (rank, in_n)])
    pair = [(rank, in_features), (out_features, rank)]
    return {"loha": pair * 2, "dora": pair + [(1, in_features)]}.get(kind, pair)


# ---------------------------------------------------------------- files


def file_tensors(name: str, weights: AdapterWeights) -> dict[str, np.ndarray]:
    """One module's keys under `name` (e.g. 'diffusion_model.<path>'), as ComfyUI's adapters read them."""
    suffixes = _SUFFIXES[weights.kind]
    out = {name + suffixes[role]: np.asarray(value, np.float32) for role, value in weights.tensors.items()}
    out[f"{name}.alpha"] = np.array(weights.alpha, dtype=np.float32)  # scalar: ComfyUI calls .item()
    return out


def is_adapter_key(key: str) -> bool:
    return key.endswith(tuple(s for kind in ("lokr", "loha") for s in _SUFFIXES[kind].values()) + (".dora_scale",))


def from_file_tensors(tensors, prefix: str, source: str) -> dict[str, AdapterWeights]:
    """Keys '<prefix><name><suffix>' → {name: AdapterWeights}; the kind from the roles present."""
    found: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = next(
            ((role, s) for kind in _SUFFIXES for role, s in _SUFFIXES[kind].items() if key.endswith(s)), None
        ) or (("alpha", ".alpha") if key.endswith(".alpha") else None)
        if match is None or not key.startswith(prefix):
            raise ValueError(
                f"{source}: key {key!r} is not a LoKr/LoHa/DoRA weight under {prefix!r}; a Kiln "
                "adapter file holds one adapter kind and nothing else; re-save it with Kiln"
            )
        found.setdefault(key[len(prefix) : -len(match[1])], {})[match[0]] = np.asarray(value, np.float32)
    return {name: from_roles(roles, source=f"{source}: {prefix}{name}") for name, roles in found.items()}


def from_roles(roles: dict[str, np.ndarray], *, source: str) -> AdapterWeights:
    """A module's role → tensor dict (and 'alpha') as AdapterWeights, its kind and tensors checked."""
    roles = dict(roles)
    alpha = roles.pop("alpha", None)
    kinds = {kind for role, kind in _MARKERS.items() if role in roles}
    if len(kinds) != 1:
        raise ValueError(f"{source}: tensors {sorted(roles)} are not one LoKr, LoHa or DoRA module; re-save it")
    kind = kinds.pop()
    need = {
        "lokr": [("lokr_w1",), ("lokr_w2",) if "lokr_w2" in roles else ("lokr_w2_a", "lokr_w2_b")],
        "loha": [tuple(_SUFFIXES["loha"])],
        "dora": [tuple(_SUFFIXES["dora"])],
    }[kind]
    wanted = {role for group in need for role in group}
    if set(roles) != wanted or any(np.asarray(roles[r]).ndim != 2 for r in wanted):
        raise ValueError(
            f"{source}: a {kind} module needs the 2-D tensors {sorted(wanted)}, has "
            f"{ {r: list(np.shape(v)) for r, v in roles.items()} }; the file is incomplete, re-save it"
        )
    weights = AdapterWeights(kind, {r: np.asarray(roles[r], np.float32) for r in sorted(wanted)}, 0.0)
    weights.alpha = float(np.asarray(alpha).reshape(-1)[0]) if alpha is not None else float(max(weights.rank, 1))
    return weights


# How each kind is named to a user: LyCORIS' and ComfyUI's spelling, in every message that names one.
KIND_NAMES = {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr", "loha": "LoHa", "diff": "diff"}


def require_lora(lora, what: str, source: str = "this LoRA") -> None:
    """Refuse LoKr/LoHa/DoRA where only LoRA pairs make sense (merge, resize, extract, init_lora)."""
    kinds = sorted({w.kind for w in lora.values() if isinstance(w, AdapterWeights)})
    if kinds:
        raise ValueError(
            f"{source} is a {'/'.join(KIND_NAMES[k] for k in kinds)} adapter; {what} works on plain "
            'LoRA pairs only (train with adapter = "lora" for that, or use the file as it is)'
        )


def check_config(cfg) -> list[str]:
    """Problems with the adapter settings of a TrainConfig (one of config_checks.py's combination checks)."""
    problems = []
    if cfg.adapter == "dora" and cfg.base_quantize not in (
        "auto",
        "none",
    ):  # auto stays none under dora  # either backend stores it quantized
        problems.append(
            "adapter 'dora' reads the base weight, which base_quantize stores quantized; set "
            "base_quantize to none or use adapter lokr/loha"
        )
    if cfg.adapter != "lora" and cfg.lora_dropout > 0:
        problems.append(f"lora_dropout applies to adapter 'lora' only; set it to 0 for adapter {cfg.adapter!r}")
    if cfg.adapter != "lora" and cfg.init_lora:
        problems.append(
            f"init_lora starts a LoRA from a LoRA file; it cannot start adapter {cfg.adapter!r}: "
            "clear init_lora or set adapter to lora"
        )
    if cfg.adapter != "lora" and cfg.lora_format == "diffusers":
        problems.append(f"lora_format 'diffusers' has no {cfg.adapter} layout; use comfy or kohya")
    if cfg.lokr_factor == 0:
        problems.append("lokr_factor must be -1 (LyCORIS's automatic split) or a factor >= 1, got 0")
    return problems
