"""MLX diffusion models by arch name: `build(arch_name, weights, dtype, quantize)` → an mlx.nn.Module.

Each model family lives in its own module here with a `build(arch_name, weights, dtype="bfloat16")`;
the arch names that module (`Arch.mlx_model`), and it is imported only when an arch of it is built.
`weights` are ComfyUI diffusion-model keys without prefix (see weights.py).
"""

from __future__ import annotations

import importlib

from ....archs import ARCHS, get_arch


def builder(arch_name: str):
    """The `build` function of the module that implements `arch_name`."""
    module_name = get_arch(arch_name).mlx_model
    if not module_name:
        known = sorted(a.name for a in ARCHS.values() if a.mlx_model)
        raise ValueError(
            f"no MLX model for arch {arch_name!r}; known: {', '.join(known)}; train it with backend 'torch'"
        )
    return importlib.import_module(f"{__name__}.{module_name}").build


# base_quantize → bits of mlx.nn.quantize (affine, per group of GROUP_SIZE input values)
# auto: none (a Mac's unified memory holds the base as stored; int8/int4 stay the user's choice)
QUANTIZE_BITS = {"auto": None, "none": None, "int8": 8, "int4": 4}
GROUP_SIZE = 64


def build(arch_name: str, weights, dtype="bfloat16", quantize: str = "none"):
    """The MLX model of `arch_name` loaded with `weights`, parameters and activations in `dtype`;
    with quantize "int8"/"int4" the frozen base's block Linears are stored quantized (QLoRA-style)."""
    return quantize_base(builder(arch_name)(arch_name, weights, dtype), arch_name, quantize)


def quantize_base(model, arch_name: str, quantize: str):
    """`model` with its block Linears quantized as config's base_quantize says ("none": unchanged)."""
    if quantize not in QUANTIZE_BITS:
        raise ValueError(f"quantize must be one of {list(QUANTIZE_BITS)}, got {quantize!r}")
    bits = QUANTIZE_BITS[quantize]
    return model if bits is None else quantize_blocks(model, arch_name, bits)


def quantize_blocks(model, arch_name: str, bits: int):
    """Quantize every Linear inside the arch's block lists (the bulk of the weights) in place.

    Embedders, modulation and the final layer stay in the compute dtype: they are a few percent of
    the weights and the most sensitive to rounding (as mflux and ai-toolkit keep them)."""
    import mlx.core as mx
    import mlx.nn as nn

    prefixes = tuple(f"{name}." for name in get_arch(arch_name).block_lists)

    def chosen(path: str, module) -> bool:
        return isinstance(module, nn.Linear) and path.startswith(prefixes) and module.weight.shape[1] % GROUP_SIZE == 0

    nn.quantize(model, group_size=GROUP_SIZE, bits=bits, class_predicate=chosen)
    mx.eval(model.parameters())
    return model
