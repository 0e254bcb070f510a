"""Other trainers' LoRA files → Kiln's in-memory LoRA, every key placed or reported.

A key is `<prefix><module name><suffix>`. Three small registries read it:
  KEY_FORMS   the prefix, whether the name is flattened ('.' → '_'), and who writes it
  SUFFIXES    the adapter kind and role a key ending means (lora_A/lora_down/lora.down/..., lokr_*, hada_*, diff)
  name forms  the module name, resolved per arch (archs/ DiffusersRules): a ComfyUI path, a diffusers name
              (a part of a fused layer: q/k/v → qkv), or either one with its '.' and '_' mixed up
              (kohya flattening; musubi-tuner convert_lora.py's `img_attn_proj`, `feed.forward.w1`)
What each tool writes (the tests build one fixture per line, and say where each pattern comes from):
  Kiln comfy, ai-toolkit Flux2, ComfyUI's trainer   diffusion_model.<ComfyUI path>.lora_A|lora_down ...
  ai-toolkit Z-Image, SimpleTuner --lora_format comfyui   diffusion_model.<diffusers name>.lora_A (+ .alpha)
  diffusers/PEFT, SimpleTuner, Kiln diffusers       transformer.<diffusers name>.lora_A, alpha in metadata
  kohya, musubi-tuner, Kiln kohya                   lora_unet_<flat name>.lora_down (+ .alpha)
  musubi-tuner convert_lora.py --target other       diffusion_model.<name with '_'→'.' guessed>.lora_A
  LyCORIS LoKr/LoHa                                 <any of the above>.lokr_w1 / .hada_w1_a ... (+ .alpha)
LoRA pairs become LoraWeights (split parts fused exactly, see lora_keys.fuse). LoKr, LoHa and
ComfyUI's `diff` patches are not (A, B) pairs: they pass through as tensors renamed to a key ComfyUI's
loader maps (`diffusion_model.<path>.lokr_w1`, or `transformer.<diffusers name>...` for a part of a fused
layer, which ComfyUI applies to its slice), exact and without an SVD.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .. import safetensors_io
from ..archs import ARCHS, Arch, DiffusersRule
from . import keys as lf
from . import outside
from .adapters import KIND_NAMES


class KeyForm(NamedTuple):
    prefix: str
    flat: bool  # the module name has '.' written as '_'
    writers: str  # who writes it, for the report


KEY_FORMS: dict[str, KeyForm] = {  # longest prefix first where one starts another
    "comfy": KeyForm("diffusion_model.", False, "ComfyUI/Kiln/ai-toolkit/SimpleTuner comfyui/musubi-tuner converted"),
    "diffusers": KeyForm("transformer.", False, "diffusers/PEFT/SimpleTuner"),
    "peft": KeyForm("base_model.model.", False, "PEFT"),
    "kohya": KeyForm("lora_unet_", True, "kohya/musubi-tuner"),
    "lycoris": KeyForm("lycoris_", True, "LyCORIS/SimpleTuner lycoris"),
    "onetrainer": KeyForm("lora_transformer_", True, "OneTrainer"),
}

# Key ending → (kind, role). Kinds other than "lora" pass through renamed (ComfyUI's weight_adapter reads them).
SUFFIXES: dict[str, tuple[str, str]] = {
    **{
        s: ("lora", "A")
        for s in (
            ".lora_A.weight",
            ".lora_down.weight",
            ".lora.down.weight",
            ".lora_A.default.weight",
            ".lora_linear_layer.down.weight",
        )
    },
    **{
        s: ("lora", "B")
        for s in (
            ".lora_B.weight",
            ".lora_up.weight",
            ".lora.up.weight",
            ".lora_B.default.weight",
            ".lora_linear_layer.up.weight",
        )
    },
    **{f".lokr_{r}": ("lokr", f"lokr_{r}") for r in ("w1", "w2", "w1_a", "w1_b", "w2_a", "w2_b", "t2")},
    **{f".hada_{r}": ("loha", f"hada_{r}") for r in ("w1_a", "w1_b", "w2_a", "w2_b", "t1", "t2")},
    ".diff": ("diff", "diff"),
    ".diff_b": ("diff", "diff_b"),
    ".alpha": ("", "alpha"),  # belongs to whichever kind the module has
    # DoRA beside a LoRA pair: LyCORIS/kohya dora_scale, PEFT's magnitude (get_peft_model_state_dict's name,
    # and the live module's)
    ".dora_scale": ("", "dora_scale"),
    ".lora_magnitude_vector": ("", "dora_scale"),
    ".lora_magnitude_vector.default.weight": ("", "dora_scale"),
}
DORA_SUFFIXES = tuple(s for s, (_, role) in SUFFIXES.items() if role == "dora_scale")  # kept F32 as ComfyUI's
DORA_KEYS = {"A": "lora_down.weight", "B": "lora_up.weight", "alpha": "alpha", "dora_scale": "dora_scale"}


@dataclass
class Converted:
    """A file read: the LoRA pairs, tensors passed through under ComfyUI names, and what happened."""

    lora: lf.Lora
    passthrough: dict[str, np.ndarray] = field(default_factory=dict)
    origins: dict[str, list[str]] = field(default_factory=dict)  # ComfyUI path → the file's keys placed there
    kinds: Counter[str] = field(default_factory=Counter)  # adapter kind (lora, dora, lokr, loha, diff) → modules read
    total: int = 0  # the file's modules, placed or not
    unplaced: list[str] = field(default_factory=list)  # keys no rule could place: never dropped silently
    notes: list[str] = field(default_factory=list)  # how the file was read, one line each
    arch: Arch | None = None

    def report(self) -> str:
        """How the file was read; a DoRA, LoKr, LoHa or diff module (exact as it is) counts as a LoRA's does."""
        counts = ", ".join(f"{self.kinds[kind]} {name}" for kind, name in KIND_NAMES.items() if self.kinds[kind])
        lines = [*self.notes, f"{sum(self.kinds.values())} of {self.total} module(s) converted: {counts or 'none'}"]
        if self.unplaced:
            lines.append(f"{len(self.unplaced)} key(s) not placed: " + ", ".join(self.unplaced))
        return "\n".join(lines)


# ---------------------------------------------------------------- module names → ComfyUI paths


def _groups(rule: DiffusersRule) -> list[str]:
    return re.findall(r"\((?!\?)[^()]*\)", rule.comfy)


def _loose(pattern: str) -> str:
    r"""A regex where '.' and '_' separators match either one: musubi's '_'→'.' guesses and kohya's flattening."""
    return re.sub(r"\\\.|_", "[._]", pattern)


def _named_groups(pattern: str) -> str:
    r"""'layers\.(\d+)\.(w[123])' → 'layers\.(?P<g0>\d+)\.(?P<g1>w[123])'."""
    count = iter(range(pattern.count("(")))
    return re.sub(r"\((?!\?)[^()]*\)", lambda m: f"(?P<g{next(count)}>{m[0][1:-1]})", pattern)


@functools.cache
def _name_patterns(rules: tuple[DiffusersRule, ...], loose: bool) -> list[tuple[re.Pattern, DiffusersRule, int | None]]:
    """(regex over a module name with groups g0, g1..., rule, diffusers part or None for the ComfyUI path)."""
    out = []
    for rule in rules:
        groups = _groups(rule)
        whole = _named_groups(rule.comfy)
        out.append((re.compile(_loose(whole) if loose else whole), rule, None))
        for index, template in enumerate(rule.targets):
            pieces, seen = [], set()
            for literal, hole in re.findall(r"([^{]*)(?:\{(\d+)\})?", template):
                pieces.append(_loose(re.escape(literal)) if loose else re.escape(literal))
                if hole:
                    n = int(hole)
                    pieces.append(f"(?P=g{n})" if n in seen else f"(?P<g{n}>{groups[n][1:-1]})")
                    seen.add(n)
            out.append((re.compile("".join(pieces)), rule, index))
    return out


class Place(NamedTuple):
    path: str  # ComfyUI module path
    rule: DiffusersRule | None
    part: int | None  # index into rule.targets when the name is one part of a fused layer
    name: str  # the diffusers name of that part ('' for a whole module)


def _from_match(arch: Arch, match: re.Match, rule: DiffusersRule, part: int | None) -> Place | None:
    values = match.groupdict()
    if len(values) != len(_groups(rule)):
        return None  # the name does not carry every group of the ComfyUI path
    path = lf.fill_groups(rule.comfy, [values[f"g{i}"] for i in range(len(values))])
    forward = lf.diffusers_targets(arch, path)
    if forward is None or forward[0] != rule:
        return None
    if part is None or len(rule.targets) == 1:  # a one-part rule: its diffusers name is the whole module
        return Place(path, rule, None, "")
    return Place(path, rule, part, forward[1][part])


def place(
    arch: Arch | None, name: str, module_names: frozenset[str] | None, *, flat: bool, verbatim: bool
) -> Place | None:
    """A module name from a file → where it goes; None when nothing places it, or several things do
    (never a guess). With the model's module names, only a path among them counts."""
    if module_names is not None and name in module_names:
        return Place(name, None, None, "")
    for loose in (False, True):
        if arch is None or (flat and not loose):
            continue
        found = {
            p
            for pattern, rule, part in _name_patterns(outside.rules(arch), loose)
            if (m := pattern.fullmatch(name)) and (p := _from_match(arch, m, rule, part)) is not None
        }
        if len(found) == 1:
            found_place = found.pop()
            return found_place if module_names is None or found_place.path in module_names else None
        if found:
            return None
    if module_names is not None:
        same = {path for path in module_names if path.replace(".", "_") == name.replace(".", "_")}
        return Place(same.pop(), None, None, "") if len(same) == 1 else None
    return Place(name, None, None, "") if verbatim and not flat else None


# ---------------------------------------------------------------- alpha of files that write none


def _peft_alpha(metadata: Mapping[str, str], name: str, rank: int) -> tuple[float, str] | None:
    """diffusers' `lora_adapter_metadata` (PEFT LoraConfig with a 'transformer.' prefix): alpha for one module."""
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return None
    try:
        config = {k.split(".", 1)[-1]: v for k, v in json.loads(raw).items()}
    except (json.JSONDecodeError, AttributeError) as error:
        raise ValueError(f"metadata 'lora_adapter_metadata' is not JSON ({error}); re-save the LoRA") from None
    pattern = next((p for p in (config.get("alpha_pattern") or {}) if re.fullmatch(rf"(.*\.)?({p})", name)), None)
    alpha = float(config["alpha_pattern"][pattern] if pattern else config.get("lora_alpha", rank))
    if config.get("use_rslora"):
        alpha *= math.sqrt(rank)  # scale alpha/sqrt(r) = (alpha·sqrt(r))/r
    return alpha, "lora_adapter_metadata"


# ---------------------------------------------------------------- reading


class _Module(NamedTuple):
    form: KeyForm | None
    name: str  # the module name inside its key form
    keys: dict[str, str]  # role → key in the file
    kinds: set[str]


def _modules(tensors: Mapping[str, np.ndarray], source: str) -> tuple[dict[str, _Module], list[str]]:
    """Keys grouped by module (key without its suffix), and the keys no suffix names."""
    suffixes = sorted(SUFFIXES, key=len, reverse=True)
    modules: dict[str, _Module] = {}
    strays = []
    for key in tensors:
        suffix = next((s for s in suffixes if key.endswith(s)), None)
        if suffix is None:
            strays.append(key)
            continue
        module, (kind, role) = key[: -len(suffix)], SUFFIXES[suffix]
        form = next((f for f in KEY_FORMS.values() if module.startswith(f.prefix)), None)
        entry = modules.setdefault(module, _Module(form, module[len(form.prefix) :] if form else module, {}, set()))
        if role in entry.keys:
            raise ValueError(
                f"{source}: {module} has two '{role}' tensors ({entry.keys[role]} and {key}); keep one naming"
            )
        entry.keys[role] = key
        if kind:
            entry.kinds.add(kind)
    return modules, strays


def _choose_arch(arch: Arch | None, modules: dict[str, _Module]) -> Arch | None:
    """The given arch, else the one whose rules place the most names (its family's marked arch on a tie)."""
    if arch is not None:
        return arch
    scored = [
        (
            sum(
                place(a, m.name, None, flat=bool(m.form and m.form.flat), verbatim=False) is not None
                for m in modules.values()
            ),
            bool(a.module_marker),
            a,
        )
        for a in ARCHS.values()
        if a.diffusers_rules
    ]
    best = max(scored, key=lambda s: (s[0], s[1]), default=(0, False, None))
    return best[2] if best[0] else None


def read(
    tensors: Mapping[str, np.ndarray],
    *,
    arch: Arch | None,
    module_names=None,
    metadata: Mapping[str, str] | None = None,
    source: str = "tensors",
) -> Converted:
    """Every key of a LoRA file placed: LoRA pairs into the in-memory form, other adapters renamed,
    the rest listed in `unplaced`."""
    modules, unplaced = _modules(tensors, source)
    arch = _choose_arch(arch, modules)
    names = frozenset(module_names) if module_names is not None else None
    converted = Converted({}, arch=arch, total=len(modules))
    parts: dict[str, tuple[DiffusersRule, dict[int, lf.LoraWeights]]] = {}
    writers = set()
    for module, entry in modules.items():
        where = (
            None
            if len(entry.kinds) != 1
            else place(
                arch,
                entry.name,
                names,
                flat=bool(entry.form and entry.form.flat),
                verbatim=entry.form is not None and entry.form.prefix == lf.COMFY_PREFIX,
            )
        )
        if where is None:
            unplaced.extend(entry.keys.values())
            continue
        writers.add(entry.form.writers if entry.form else "unprefixed names")
        converted.origins.setdefault(where.path, []).extend(entry.keys.values())
        roles = {role: np.asarray(tensors[key]) for role, key in entry.keys.items()}
        if "lora" in entry.kinds:
            roles = _with_alpha(roles, metadata or {}, entry.name, converted.notes)
        converted.kinds["dora" if "dora_scale" in roles else next(iter(entry.kinds))] += 1
        if "lora" not in entry.kinds or "dora_scale" in roles:  # passed through, exact, under ComfyUI's names
            converted.passthrough.update(
                _renamed(arch, where, _dora(roles) if "lora" in entry.kinds else roles, source, module)
            )
            continue
        weights = lf.checked_weights(source, module, roles)
        if where.part is not None:
            parts.setdefault(where.path, (where.rule, {}))[1][where.part] = weights
        elif where.path in converted.lora:
            raise ValueError(f"{source}: two modules of the file name {where.path}; keep one")
        else:
            converted.lora[where.path] = weights
    for path, (rule, found) in parts.items():
        if path in converted.lora:
            raise ValueError(f"{source}: {path} is in the file both whole and as diffusers parts; keep one")
        converted.lora[path] = lf.fuse(rule, found, f"{source}: {path}")
    converted.unplaced = sorted(unplaced)
    converted.notes.insert(
        0,
        f"{source}: keys as {', '.join(sorted(writers)) or 'no known trainer'} write them; "
        f"arch {arch.name if arch else 'unknown'}",
    )
    return converted


def _with_alpha(roles: dict[str, np.ndarray], metadata, name: str, notes: list[str]) -> dict[str, np.ndarray]:
    if "alpha" in roles or "A" not in roles:
        return roles
    found = _peft_alpha(metadata, name, roles["A"].shape[0])
    if found is None:
        return roles  # no alpha anywhere: scale 1, as ComfyUI, diffusers and ai-toolkit read it
    if not any(n.startswith("alpha from") for n in notes):
        notes.append(f"alpha from the file's {found[1]} (ComfyUI alone would not read it; written as .alpha)")
    return {**roles, "alpha": np.array(found[0], np.float32)}


def _dora(roles: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A DoRA module under the names ComfyUI's LoRA adapter reads; PEFT's magnitude [out] as dora_scale [out, 1]
    (per output row, as LyCORIS's default writes it; ComfyUI tells the axis by the shape)."""
    scale = roles["dora_scale"]
    roles = {**roles, "dora_scale": scale.reshape(-1, 1) if scale.ndim == 1 else scale}
    return {DORA_KEYS[role]: value for role, value in roles.items()}


def _renamed(
    arch: Arch | None, where: Place, roles: dict[str, np.ndarray], source: str, module: str
) -> dict[str, np.ndarray]:
    """LoKr/LoHa/diff tensors under the name ComfyUI maps: the ComfyUI path, or for one part of a fused
    layer its diffusers name (ComfyUI's key map applies it to that slice of the fused weight)."""
    base = (
        lf.COMFY_PREFIX + where.path
        if where.part is None
        else (arch.diffusers_prefix if arch else lf.DIFFUSERS_PREFIX) + where.name
    )
    out = {}
    for role, value in roles.items():
        if value.dtype.kind not in "fiu":
            raise ValueError(f"{source}: {module}.{role} is {value.dtype}, not a number; the file is damaged")
        out[f"{base}.{role}"] = value
    return out


# ---------------------------------------------------------------- files


def file_identity(path) -> dict[str, str]:
    """{'name', 'sha256'} of a file: what a converted LoRA or a run started from it records."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"name": Path(path).name, "sha256": digest.hexdigest()}


def read_file(path, *, arch: Arch | str | None = None) -> tuple[Converted, dict[str, str]]:
    """A LoRA file of any trainer read (arch and kohya module names from its metadata when it has them)."""
    tensors, metadata = safetensors_io.read(path)
    converted = read(
        tensors,
        arch=lf.arch_of(arch, metadata),
        module_names=lf.module_paths(metadata, str(path)),
        metadata=metadata,
        source=str(path),
    )
    if not converted.lora and not converted.passthrough:
        raise ValueError(
            f"{path}: no LoRA, LoKr or LoHa weights Kiln can place (keys such as "
            f"{', '.join(converted.unplaced[:5]) or 'none'}); is this a LoRA for the diffusion model?"
        )
    return converted, metadata
