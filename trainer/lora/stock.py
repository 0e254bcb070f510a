"""What stock ComfyUI makes of a LoRA file, from Kiln's own knowledge of its key forms (never importing it), and
who wrote the file. ComfyUI's map (comfy/lora.py model_lora_keys_unet, the same forms in 0.17 and 0.33):
  every model      diffusion_model.<ComfyUI path>, lora_unet_<ComfyUI path, '.'→'_'>
  Z-Image, Lumina2 Z-Image's diffusers names (comfy/utils.py z_image_to_diffusers) under diffusion_model.,
                   transformer., lycoris_ (flattened) and bare; for Lumina 2 too, never diffusers' Lumina2 names
                   (attn.to_q, feed_forward.linear_1, ...), and only onto weights a Lumina 2 model has
  Qwen-Image       the ComfyUI path bare, under transformer. and lycoris_ (flattened)
  Flux, Flux2, Chroma   Flux.1's diffusers names (flux_to_diffusers) under transformer., lycoris_,
                   lora_transformer_ (flattened) and bare, with Flux2's block names; not its embedders' and modulation's
and its weight adapters read the suffixes lora_sources.SUFFIXES lists, except PEFT's lora_magnitude_vector.
tests/nodes/test_lora_library_files.py checks the count against ComfyUI's own loader."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from ..archs import Arch, get_arch
from . import keys, sources

# The diffusers names ComfyUI's Flux map (comfy/utils.py flux_to_diffusers, 0.17 and 0.33) holds: Flux.1's, and
# Flux2's MLP and single-block ones (ff.linear_in, attn.to_qkv_mlp_proj, ...); not Flux2's time_guidance_embed,
# its *_modulation Linears, or Chroma's approximator
_FLUX_MAP_NAMES = (
    r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|add_[qkv]_proj|to_out\.0|to_add_out)|norm1(_context)?\.linear"
    r"|ff(_context)?\.(net\.0\.proj|net\.2|linear_in|linear_out))"
    r"|single_transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_qkv_mlp_proj|to_out)|proj_mlp|proj_out|norm\.linear)"
    r"|x_embedder|context_embedder|proj_out|time_text_embed\.(timestep|text|guidance)_embedder\.linear_[12]"
)
# family → (prefix under which ComfyUI maps diffusers names, flattened?)
_DIFFUSERS_FORMS: dict[str, tuple[tuple[str, bool], ...]] = {
    "zimage": (("diffusion_model.", False), ("transformer.", False), ("lycoris_", True), ("", False)),
    "lumina2": (("diffusion_model.", False), ("transformer.", False), ("lycoris_", True), ("", False)),
    "qwen_image": (("transformer.", False), ("lycoris_", True), ("", False)),
    "flux2": (("transformer.", False), ("lycoris_", True), ("lora_transformer_", True), ("", False)),
    "chroma": (("transformer.", False), ("lycoris_", True), ("lora_transformer_", True), ("", False)),
}
# family → the arch whose diffusers names ComfyUI's map reads for it: comfy/lora.py maps model_base.Lumina2 with
# z_image_to_diffusers (0.17 and 0.33), so a Lumina 2 file in diffusers' own Lumina2 names loads nothing there
_NAMES_OF = {"lumina2": "zimage"}
_KNOWN = {"flux2": _FLUX_MAP_NAMES, "chroma": _FLUX_MAP_NAMES}  # families whose diffusers names ComfyUI knows in part
_UNREAD = (".lora_magnitude_vector", ".lora_magnitude_vector.default.weight")  # PEFT's DoRA magnitude


def _suffix(key: str) -> str | None:
    return next((s for s in sorted(sources.SUFFIXES, key=len, reverse=True) if key.endswith(s)), None)


def _comfy_path(arch: Arch | None, name: str) -> bool:
    """A dotted name ComfyUI's model has: the one place() finds without loosening, or one nothing else claims."""
    found = sources.place(arch, name, None, flat=False, verbatim=True)
    return found is not None and found.path == name and found.part is None


def _diffusers_name(arch: Arch, name: str, flat: bool) -> bool:
    """A diffusers name (flattened or not) ComfyUI's map for the family holds, onto a weight the family's model has."""
    named_by = get_arch(_NAMES_OF[arch.family]) if arch.family in _NAMES_OF else arch
    found = sources.place(named_by, name, None, flat=flat, verbatim=False)
    targets = keys.diffusers_targets(named_by, found.path) if found else None
    dotted = next((n for n in (targets[1] if targets else []) if (n.replace(".", "_") if flat else n) == name), None)
    known = _KNOWN.get(arch.family)
    # The family's own rules name each Linear its model has: Z-Image's adaLN_modulation.0 is no Lumina 2 weight
    # (ComfyUI takes the key, then drops its patch: NOT LOADED)
    if dotted is None or named_by is not arch and keys.diffusers_targets(arch, found.path) is None:
        return False
    return known is None or re.fullmatch(known, dotted) is not None


def loaded(arch: Arch | None, module: str) -> bool:
    """Whether stock ComfyUI's key map holds a module name (a key without its suffix)."""
    if module.startswith(keys.COMFY_PREFIX) and _comfy_path(arch, module[len(keys.COMFY_PREFIX) :]):
        return True
    if module.startswith(keys.KOHYA_PREFIX) and arch is not None:
        flat = module[len(keys.KOHYA_PREFIX) :]
        found = sources.place(arch, flat, None, flat=True, verbatim=False)
        if found is not None and found.path.replace(".", "_") == flat:
            return True
    forms = _DIFFUSERS_FORMS.get(arch.family, ()) if arch is not None else ()
    return any(module.startswith(p) and _diffusers_name(arch, module[len(p) :], flat) for p, flat in forms)


def unmatched(keys: Iterable[str], arch: Arch | None) -> list[str]:
    """The keys stock ComfyUI's loader would report as not loaded."""
    out = []
    for key in keys:
        suffix = _suffix(key)
        if suffix is None or suffix in _UNREAD or not loaded(arch, key[: -len(suffix)]):
            out.append(key)
    return sorted(out)


def writer(metadata: Mapping[str, str], keys: Iterable[str]) -> str:
    """Which tool wrote a file: its metadata first, else its key layout."""
    values = " ".join(metadata.values()).lower()
    module = metadata.get("ss_network_module", "").lower()
    by_metadata = [
        ("kiln.version" in metadata, "Kiln"),
        ("ai-toolkit" in values or "ai_toolkit" in values, "ai-toolkit"),
        (
            "musubi" in values or module.startswith("networks.lora_") and "modelspec.architecture" in metadata,
            "musubi-tuner",
        ),
        ("lycoris" in module, "LyCORIS"),
        ("simpletuner" in values, "SimpleTuner"),
        ("onetrainer" in values, "OneTrainer"),
        ("lora_adapter_metadata" in metadata, "diffusers/PEFT (SimpleTuner, diffusers' scripts)"),
        (bool(module), "Kohya/sd-scripts"),
    ]
    found = next((name for hit, name in by_metadata if hit), None)
    if found:
        return f"{found} (from metadata)"
    keys = list(keys)
    forms = sorted(
        {f.writers for f in sources.KEY_FORMS.values() for k in keys if k.startswith(f.prefix)}
        | ({"PEFT"} if any(k.endswith(_UNREAD) for k in keys) else set())
    )
    return f"{' or '.join(forms) or 'unknown'} (from the key layout)"
