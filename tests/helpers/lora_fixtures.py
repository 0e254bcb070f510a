"""Other trainers' LoRA files, built from tiny random tensors with each tool's key names (#19).

Each fixture says where its key pattern comes from (repository, file, function). A fixture takes the
shapes of the model's modules ({ComfyUI path: (out, in)}) and returns the file's tensors, its metadata and
the truth: the weight change each ComfyUI path gets when the pattern's own math is applied by hand
(ΔW = alpha/rank·B@A for LoRA, kron for LoKr, Hadamard products for LoHa, the tensor for a diff).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

RANK = 4

# The modules each family's fixtures train (a subset of the arch's targets, plus one outside them).
FLUX2_PATHS = [
    "double_blocks.0.img_attn.qkv",
    "double_blocks.0.img_attn.proj",
    "double_blocks.1.txt_attn.qkv",
    "double_blocks.1.img_mlp.0",
    "single_blocks.0.linear1",
    "single_blocks.1.linear2",
]
ZIMAGE_PATHS = [
    "layers.0.attention.qkv",
    "layers.0.attention.out",
    "layers.1.feed_forward.w1",
    "layers.1.feed_forward.w3",
    "noise_refiner.0.attention.qkv",
]

# ComfyUI path → diffusers names (the part names of a fused layer, in row order), per family:
# comfy/utils.py flux_to_diffusers (Flux2 branch) and z_image_to_diffusers.
_FLUX2_DIFFUSERS = [
    (
        r"double_blocks\.(\d+)\.img_attn\.qkv",
        ["transformer_blocks.{}.attn.to_q", "transformer_blocks.{}.attn.to_k", "transformer_blocks.{}.attn.to_v"],
    ),
    (
        r"double_blocks\.(\d+)\.txt_attn\.qkv",
        [
            "transformer_blocks.{}.attn.add_q_proj",
            "transformer_blocks.{}.attn.add_k_proj",
            "transformer_blocks.{}.attn.add_v_proj",
        ],
    ),
    (r"double_blocks\.(\d+)\.img_attn\.proj", ["transformer_blocks.{}.attn.to_out.0"]),
    (r"double_blocks\.(\d+)\.img_mlp\.0", ["transformer_blocks.{}.ff.linear_in"]),
    (r"single_blocks\.(\d+)\.linear1", ["single_transformer_blocks.{}.attn.to_qkv_mlp_proj"]),
    (r"single_blocks\.(\d+)\.linear2", ["single_transformer_blocks.{}.attn.to_out"]),
]
_ZIMAGE_DIFFUSERS = [
    (r"(\w+)\.(\d+)\.attention\.qkv", ["{}.{}.attention.to_q", "{}.{}.attention.to_k", "{}.{}.attention.to_v"]),
    (r"(\w+)\.(\d+)\.attention\.out", ["{}.{}.attention.to_out.0"]),
    (r"(\w+)\.(\d+)\.feed_forward\.(w\d)", ["{}.{}.feed_forward.{}"]),
]


def diffusers_names(family: str, path: str) -> list[str]:
    for pattern, names in {"flux2": _FLUX2_DIFFUSERS, "zimage": _ZIMAGE_DIFFUSERS}[family]:
        match = re.fullmatch(pattern, path)
        if match:
            return [name.format(*match.groups()) for name in names]
    raise KeyError(path)


@dataclass
class Fixture:
    tensors: dict[str, np.ndarray]
    metadata: dict[str, str]
    delta: dict[str, np.ndarray]  # ComfyUI path → ΔW (out, in), float64
    passthrough: int = 0  # tensors that stay LoKr/LoHa/diff


def _pair(rng, out: int, fan_in: int, rank: int = RANK) -> tuple[np.ndarray, np.ndarray]:
    A = rng.standard_normal((rank, fan_in)).astype(np.float32) / np.float32(np.sqrt(fan_in))
    B = rng.standard_normal((out, rank)).astype(np.float32) * np.float32(0.2)
    return A, B


def _delta(A, B, scale) -> np.ndarray:
    return (B.astype(np.float64) @ A.astype(np.float64)) * scale


def _parts(family, path, shapes, rng, alpha):
    """Per diffusers part: (name, A, B, alpha, rows); a fused layer's rows split equally (q/k/v)."""
    names = diffusers_names(family, path)
    out, fan_in = shapes[path]
    return [(name, *_pair(rng, out // len(names), fan_in), alpha) for name in names]


def _split_lora(
    family, paths, shapes, rng, key: Callable[[str], str], down: str, up: str, *, alpha_key: bool, alpha: float
) -> Fixture:
    """Diffusers-named modules, each part trained with its own A (SimpleTuner, diffusers, ai-toolkit Z-Image)."""
    tensors, delta = {}, {}
    for path in paths:
        blocks = []
        for name, A, B, a in _parts(family, path, shapes, rng, alpha):
            tensors[f"{key(name)}.{down}"], tensors[f"{key(name)}.{up}"] = A, B
            if alpha_key:
                tensors[f"{key(name)}.alpha"] = np.array(a, np.float32)
            blocks.append(_delta(A, B, (a if alpha_key else RANK) / RANK))
        delta[path] = np.concatenate(blocks)
    return Fixture(tensors, {}, delta)


def _whole_lora(
    paths, shapes, rng, key: Callable[[str], str], down: str, up: str, *, alpha: float | None, fold_sqrt: bool = False
) -> Fixture:
    tensors, delta = {}, {}
    for path in paths:
        A, B = _pair(rng, *shapes[path])
        scale = 1.0 if alpha is None else alpha / RANK
        if fold_sqrt:  # musubi convert_lora.py convert_to_diffusers: both scaled by sqrt(alpha/dim), no alpha
            A, B = A * np.float32(np.sqrt(scale)), B * np.float32(np.sqrt(scale))
            scale = 1.0
        tensors[f"{key(path)}.{down}"], tensors[f"{key(path)}.{up}"] = A, B
        if alpha is not None and not fold_sqrt:
            tensors[f"{key(path)}.alpha"] = np.array(alpha, np.float32)
        delta[path] = _delta(A, B, scale)
    return Fixture(tensors, {}, delta)


def musubi_module_name(flat: str) -> str:
    """kohya-ss/musubi-tuner src/musubi_tuner/convert_lora.py convert_to_diffusers: how it turns a
    `lora_unet_` name back into a module name ('_' → '.', then HunyuanVideo's fixes). For Flux2 it
    writes `img_attn_proj` / `img_attn_qkv`, for Z-Image `feed.forward.w1`, `attention.to.q`: names
    ComfyUI does not know (the form reported broken)."""
    name = flat.replace("_", ".")
    for old, new in (
        ("double.blocks.", "double_blocks."),
        ("single.blocks.", "single_blocks."),
        ("img.", "img_"),
        ("txt.", "txt_"),
        ("attn.", "attn_"),
    ):
        name = name.replace(old, new)
    return name


def _lokr(rng, out, fan_in, alpha):
    """LoKr with a full w1 (2x2) and a low-rank w2: ComfyUI's lokr.py scales by alpha / w2_b rows."""
    w1 = rng.standard_normal((2, 2)).astype(np.float32)
    w2_a = rng.standard_normal((out // 2, RANK)).astype(np.float32) * np.float32(0.2)
    w2_b = rng.standard_normal((RANK, fan_in // 2)).astype(np.float32) / np.float32(np.sqrt(fan_in))
    delta = np.kron(w1.astype(np.float64), w2_a.astype(np.float64) @ w2_b.astype(np.float64)) * (alpha / RANK)
    return {"lokr_w1": w1, "lokr_w2_a": w2_a, "lokr_w2_b": w2_b, "alpha": np.array(alpha, np.float32)}, delta


def _loha(rng, out, fan_in, alpha):
    """LoHa: ΔW = (w1_a@w1_b) ⊙ (w2_a@w2_b) · alpha / rank (ComfyUI's loha.py, LyCORIS's)."""
    (w1b, w1a), (w2b, w2a) = _pair(rng, out, fan_in), _pair(rng, out, fan_in)
    delta = (w1a.astype(np.float64) @ w1b) * (w2a.astype(np.float64) @ w2b) * (alpha / RANK)
    return {
        "hada_w1_a": w1a,
        "hada_w1_b": w1b,
        "hada_w2_a": w2a,
        "hada_w2_b": w2b,
        "alpha": np.array(alpha, np.float32),
    }, delta


def _adapters(rng, items: list[tuple[str, str, tuple[int, int]]], make) -> Fixture:
    """(module key, ComfyUI path the delta lands on, shape); parts of one path are stacked by rows."""
    tensors, delta = {}, {}
    for module, path, shape in items:
        found, d = make(rng, *shape, 2.0 * RANK)
        tensors.update({f"{module}.{role}": value for role, value in found.items()})
        delta[path] = np.concatenate([delta[path], d]) if path in delta else d
    return Fixture(tensors, {}, delta, passthrough=len(tensors))


# ---------------------------------------------------------------- the fixtures, per family


def ai_toolkit(family, shapes, rng) -> Fixture:
    """ostris/ai-toolkit toolkit/network_mixins.py get_state_dict (peft_format: lora_A/lora_B, no alpha) then
    extensions_built_in/diffusion_models/{flux2/flux2_model.py, z_image/z_image.py}
    convert_lora_weights_before_save ('transformer.' → 'diffusion_model.'). Flux2 runs BFL's own module
    names (flux2/src/model.py), Z-Image diffusers' (to_q/to_k/to_v, to_out.0)."""
    if family == "flux2":
        return _whole_lora(
            FLUX2_PATHS, shapes, rng, lambda p: f"diffusion_model.{p}", "lora_A.weight", "lora_B.weight", alpha=None
        )
    return _split_lora(
        family,
        ZIMAGE_PATHS,
        shapes,
        rng,
        lambda n: f"diffusion_model.{n}",
        "lora_A.weight",
        "lora_B.weight",
        alpha_key=False,
        alpha=RANK,
    )


def ai_toolkit_lokr(family, shapes, rng) -> Fixture:
    """ostris/ai-toolkit toolkit/network_mixins.py get_state_dict ('lokr needs alpha': .alpha kept) with
    toolkit/models/lokr.py's lokr_w1 / lokr_w2_a / lokr_w2_b, under 'diffusion_model.' as above."""
    paths = FLUX2_PATHS[1:3] if family == "flux2" else ZIMAGE_PATHS[:2]
    names = {p: [p] if family == "flux2" else diffusers_names(family, p) for p in paths}
    items = [
        (f"diffusion_model.{n}", p, (shapes[p][0] // len(names[p]), shapes[p][1])) for p in paths for n in names[p]
    ]
    return _adapters(rng, items, _lokr)


def musubi(family, shapes, rng) -> Fixture:
    """kohya-ss/musubi-tuner src/musubi_tuner/networks/lora.py create_network with prefix 'lora_unet'
    (networks/lora_flux_2.py, lora_zimage.py create_arch_network): module names with '.' → '_'. Flux2 runs
    BFL names (flux_2/flux2_models.py); Z-Image diffusers' (issue #770: lora_unet_layers_9_attention_to_q),
    refiners excluded."""
    if family == "flux2":
        return _whole_lora(
            FLUX2_PATHS,
            shapes,
            rng,
            lambda p: "lora_unet_" + p.replace(".", "_"),
            "lora_down.weight",
            "lora_up.weight",
            alpha=2.0 * RANK,
        )
    paths = [p for p in ZIMAGE_PATHS if "refiner" not in p]
    return _split_lora(
        family,
        paths,
        shapes,
        rng,
        lambda n: "lora_unet_" + n.replace(".", "_"),
        "lora_down.weight",
        "lora_up.weight",
        alpha_key=True,
        alpha=0.5 * RANK,
    )


def musubi_converted(family, shapes, rng) -> Fixture:
    """kohya-ss/musubi-tuner src/musubi_tuner/convert_lora.py convert_to_diffusers (`--target other`):
    'diffusion_model.' + musubi_module_name(...), lora_A/lora_B each scaled by sqrt(alpha/rank), no alpha."""
    if family == "flux2":
        return _whole_lora(
            FLUX2_PATHS,
            shapes,
            rng,
            lambda p: "diffusion_model." + musubi_module_name(p.replace(".", "_")),
            "lora_A.weight",
            "lora_B.weight",
            alpha=2.0 * RANK,
            fold_sqrt=True,
        )
    tensors, delta = {}, {}
    for path in [p for p in ZIMAGE_PATHS if "refiner" not in p]:
        blocks = []
        for name, A, B, _ in _parts(family, path, shapes, rng, RANK):
            scale = np.float32(np.sqrt(0.5))  # alpha = rank / 2
            key = "diffusion_model." + musubi_module_name(name.replace(".", "_"))
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = A * scale, B * scale
            blocks.append(_delta(A * scale, B * scale, 1.0))
        delta[path] = np.concatenate(blocks)
    return Fixture(tensors, {}, delta)


def musubi_zimage_comfy(family, shapes, rng) -> Fixture:
    """kohya-ss/musubi-tuner src/musubi_tuner/networks/convert_z_image_lora_to_comfy.py main: to_q/to_k/to_v
    fused into `attention_qkv` (lora_down stacked, lora_up block-diagonal, alpha x3), to_out_0 → out."""
    tensors, delta = {}, {}
    for path in [p for p in ZIMAGE_PATHS if "refiner" not in p]:
        parts = _parts(family, path, shapes, rng, RANK)
        key = "lora_unet_" + path.replace(".", "_")
        A = np.concatenate([p[1] for p in parts])
        B = np.zeros((sum(p[2].shape[0] for p in parts), A.shape[0]), np.float32)
        for i, (_, _, part_B, _) in enumerate(parts):
            B[i * part_B.shape[0] : (i + 1) * part_B.shape[0], i * RANK : (i + 1) * RANK] = part_B
        alpha = 2.0 * len(parts)  # per-part alpha 2 (scale 0.5), times the parts for the larger rank
        tensors.update(
            {f"{key}.lora_down.weight": A, f"{key}.lora_up.weight": B, f"{key}.alpha": np.array(alpha, np.float32)}
        )
        delta[path] = _delta(A, B, alpha / A.shape[0])
    return Fixture(tensors, {}, delta)


def musubi_loha(family, shapes, rng) -> Fixture:
    """kohya-ss/musubi-tuner src/musubi_tuner/networks/loha.py (hada_w1_a/_b, hada_w2_a/_b, alpha) under
    the 'lora_unet_' names of networks/lora.py; Z-Image after convert_z_image_lora_to_comfy.py (qkv)."""
    paths = FLUX2_PATHS[:2] if family == "flux2" else ZIMAGE_PATHS[:2]
    return _adapters(rng, [("lora_unet_" + p.replace(".", "_"), p, shapes[p]) for p in paths], _loha)


def simpletuner_comfyui(family, shapes, rng) -> Fixture:
    """bghira/SimpleTuner simpletuner/helpers/training/lora_format.py convert_diffusers_to_comfyui
    (`--lora_format comfyui`): diffusers names with 'transformer.' → 'diffusion_model.', lora_A/lora_B kept,
    an `.alpha` per module from the adapter's lora_alpha."""
    paths = FLUX2_PATHS if family == "flux2" else ZIMAGE_PATHS
    return _split_lora(
        family,
        paths,
        shapes,
        rng,
        lambda n: f"diffusion_model.{n}",
        "lora_A.weight",
        "lora_B.weight",
        alpha_key=True,
        alpha=2.0 * RANK,
    )


def diffusers_peft(family, shapes, rng) -> Fixture:
    """diffusers loaders/lora_base.py _save_lora_weights (SimpleTuner's default, diffusers' training scripts):
    'transformer.<diffusers name>.lora_A.weight', no alpha keys; lora_alpha / alpha_pattern in the
    'lora_adapter_metadata' JSON with the 'transformer.' prefix (_pack_dict_with_prefix)."""
    paths = FLUX2_PATHS if family == "flux2" else ZIMAGE_PATHS
    fixture = _split_lora(
        family,
        paths,
        shapes,
        rng,
        lambda n: f"transformer.{n}",
        "lora_A.weight",
        "lora_B.weight",
        alpha_key=True,
        alpha=2.0 * RANK,
    )
    special = diffusers_names(family, paths[1])[0]  # one module with its own alpha (PEFT's alpha_pattern)
    for key in [k for k in fixture.tensors if k.endswith(".alpha")]:
        del fixture.tensors[key]
    fixture.delta[paths[1]] *= 0.5  # its alpha_pattern alpha is RANK, not 2·RANK
    fixture.metadata["lora_adapter_metadata"] = json.dumps(
        {
            "transformer.r": RANK,
            "transformer.lora_alpha": 2.0 * RANK,
            "transformer.alpha_pattern": {special: float(RANK)},
            "transformer.rank_pattern": {},
        }
    )
    return fixture


def comfyui_trainer(family, shapes, rng) -> Fixture:
    """ComfyUI comfy_extras/nodes_train.py _create_weight_adapter: for every module of mp.model (so
    'diffusion_model.<path>'), LoraDiff's named_parameters lora_up.weight / lora_down.weight / alpha (1.0,
    alpha over rank scales it); BiasDiff's '.diff' for a 1-D weight. SaveLoRA writes the dict as it is."""
    paths = FLUX2_PATHS if family == "flux2" else ZIMAGE_PATHS
    fixture = _whole_lora(
        paths, shapes, rng, lambda p: f"diffusion_model.{p}", "lora_down.weight", "lora_up.weight", alpha=1.0
    )
    extra = {"flux2": "img_in", "zimage": "layers.0.attention_norm1"}[family]  # outside Kiln's targets
    if extra in shapes and family == "flux2":
        A, B = _pair(rng, *shapes[extra])
        fixture.tensors.update(
            {
                f"diffusion_model.{extra}.lora_down.weight": A,
                f"diffusion_model.{extra}.lora_up.weight": B,
                f"diffusion_model.{extra}.alpha": np.array(1.0, np.float32),
            }
        )
        fixture.delta[extra] = _delta(A, B, 1.0 / RANK)
    elif extra in shapes:
        diff = rng.standard_normal(shapes[extra][:1]).astype(np.float32) * np.float32(0.1)
        fixture.tensors[f"diffusion_model.{extra}.diff"] = diff
        fixture.delta[extra] = diff.astype(np.float64)
        fixture.passthrough = 1
    return fixture


def simpletuner_lycoris(family, shapes, rng) -> Fixture:
    """SimpleTuner's LyCORIS LoKr (lycoris-lora's `lycoris_` prefix with diffusers names flattened; ComfyUI
    comfy/lora.py model_lora_keys_unet '#simpletuner lycoris format'): one per q/k/v part."""
    path = FLUX2_PATHS[0] if family == "flux2" else ZIMAGE_PATHS[0]
    names = diffusers_names(family, path)
    shape = (shapes[path][0] // len(names), shapes[path][1])
    return _adapters(rng, [("lycoris_" + n.replace(".", "_"), path, shape) for n in names], _lokr)


FIXTURES: dict[str, Callable[[str, dict, np.random.Generator], Fixture]] = {
    "ai-toolkit": ai_toolkit,
    "ai-toolkit LoKr": ai_toolkit_lokr,
    "musubi-tuner": musubi,
    "musubi-tuner convert_lora.py": musubi_converted,
    "musubi-tuner LoHa": musubi_loha,
    "SimpleTuner comfyui": simpletuner_comfyui,
    "diffusers/PEFT": diffusers_peft,
    "ComfyUI trainer": comfyui_trainer,
    "SimpleTuner LyCORIS LoKr": simpletuner_lycoris,
}
ZIMAGE_ONLY = {"musubi-tuner convert_z_image_lora_to_comfy.py": musubi_zimage_comfy}


def cases() -> list[tuple[str, str]]:
    return [(family, name) for family in ("flux2", "zimage") for name in FIXTURES] + [
        ("zimage", name) for name in ZIMAGE_ONLY
    ]


def build(family: str, name: str, shapes: dict[str, tuple[int, int]], seed: int = 0) -> Fixture:
    return {**FIXTURES, **ZIMAGE_ONLY}[name](family, shapes, np.random.default_rng(seed))
