"""Which model an estimate is of: the variants the archs' Layouts list (VARIANTS), their Linears and parameter
count, the variant a checkpoint's header names, and the Linears a LoRA's targets select."""

from __future__ import annotations

from ..archs import ARCHS, Arch, get_arch
from ..archs.layout import Layout, ModelDims, Shapes
from ..lora.targets import TargetError, select_targets


def _variants() -> dict[str, ModelDims]:
    """Every registered arch's Layout variants, in registry order (archs sharing a Layout list them once)."""
    layouts = {id(arch.layout): arch.layout for arch in ARCHS.values() if arch.layout is not None}
    return {dims.variant: dims for layout in layouts.values() for dims in layout.variants}


VARIANTS: dict[str, ModelDims] = _variants()


def get_dims(variant: str | ModelDims) -> ModelDims:
    """VARIANTS[variant]; a ModelDims passes through (for hypothetical sizes)."""
    if isinstance(variant, ModelDims):
        return variant
    try:
        return VARIANTS[variant]
    except KeyError:
        raise ValueError(f"unknown model variant {variant!r}; choose one of {list(VARIANTS)}") from None


def arch_variants(arch_name: str) -> list[str]:
    """The VARIANTS an arch trains, smallest first; empty for an arch without a Layout (demo, generic).
    Archs sharing one model (zimage_turbo and zimage) share its variants."""
    layout = get_arch(arch_name).layout
    if layout is None:
        return []
    own = [dims for dims in layout.variants if dims.arch == arch_name] or list(layout.variants)
    return [dims.variant for dims in sorted(own, key=param_count)]


def resolve_variant(name: str) -> list[str]:
    """A variant (flux2-klein-9b) or an arch (flux2_klein) -> the variants it names, smallest first."""
    if name in VARIANTS:
        return [name]
    if name in ARCHS and arch_variants(name):
        return arch_variants(name)
    archs = [arch for arch in ARCHS if arch_variants(arch)]
    raise ValueError(
        f"unknown --variant {name!r}; give a model size ({', '.join(VARIANTS)}) or an arch ({', '.join(archs)})"
    )


def several_sizes_note(name: str, variants: list[str]) -> list[str]:
    """The note an estimate of the smallest of several variants carries; none for one variant."""
    if len(variants) < 2:
        return []
    return [
        f"{name} comes in {', '.join(variants)}; estimated the smallest, {variants[0]}; "
        f"pick another with --variant {' or --variant '.join(variants[1:])}"
    ]


def arch_of(dims: ModelDims) -> Arch:
    """The arch `dims` names; it must carry a Layout."""
    arch = get_arch(dims.arch)
    if arch.layout is None:
        raise ValueError(
            f"{dims.variant}: arch {dims.arch!r} has no Layout (trainer/archs/layout.py), so there is "
            f"no memory estimate for it; known variants: {list(VARIANTS)}"
        )
    return arch


def layout_of(dims: ModelDims) -> Layout:
    return arch_of(dims).layout


def linear_layers(dims: ModelDims) -> Shapes:
    """Every Linear of the diffusion model: ComfyUI module path -> (in, out), in model order."""
    arch = arch_of(dims)
    return arch.layout.linear_layers(dims, arch.latent_channels * arch.patch**2)


def param_count(dims: ModelDims) -> int:
    """Linear weights + biases + norm scales + pad tokens (everything a checkpoint holds)."""
    layers = linear_layers(dims)
    return sum(i * o for i, o in layers.values()) + layout_of(dims).extra_params(dims, layers)


_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def variant_from_header(shapes: dict[str, list[int]]) -> str:
    """The VARIANTS key of a ComfyUI diffusion-model safetensors header (key -> shape)."""
    keys = {}
    for key, shape in shapes.items():
        if isinstance(shape, (list, tuple)):
            keys[next((key[len(p) :] for p in _PREFIXES if key.startswith(p)), key)] = list(shape)
    layouts = list({id(layout_of(dims)): layout_of(dims) for dims in VARIANTS.values()}.values())
    layout = next((layout for layout in layouts if all(k in keys for k in layout.header.markers)), None)
    if layout is None:
        names = " or ".join(layout.name for layout in layouts)
        markers = " or ".join(layout.header.markers[0].removesuffix(".weight") for layout in layouts)
        raise ValueError(
            f"not a {names} diffusion model (no {markers} weight among {len(keys)} tensors, "
            f"e.g. {sorted(keys)[:5]}); known variants: {list(VARIANTS)}"
        )
    spec = layout.header
    found = {name: keys[key][axis] for name, (key, axis) in spec.sizes.items()}
    found.update({name: _count(keys, prefix) for name, prefix in spec.counts.items()})
    for dims in layout.variants:
        if all(getattr(dims, k) == v for k, v in found.items()):
            return dims.variant
    raise ValueError(f"{layout.name} model with {found} matches none of the known variants {list(VARIANTS)}")


def _count(keys, prefix: str) -> int:
    indices = {int(k[len(prefix) :].split(".")[0]) for k in keys if k.startswith(prefix)}
    return max(indices) + 1 if indices else 0


def lora_shapes(dims: ModelDims, targets) -> list[tuple[int, int]]:
    """(in, out) of every Linear the targets (None: the arch's defaults) select."""
    layers = linear_layers(dims)
    patterns = get_arch(dims.arch).default_targets if targets is None else tuple(targets)
    try:
        return [layers[name] for name in select_targets(list(layers), patterns)]
    except TargetError as err:
        raise ValueError(f"{dims.variant}: {err}") from None
