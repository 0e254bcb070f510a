"""Modules outside an arch's per-module diffusers rules (archs/): embedders, modulation, final and output
layers. LyCORIS's default targets and a diffusers LoRA on every Linear include them, and ComfyUI's own key map
reads them in every layout (comfy/lora.py model_lora_keys_unet: `diffusion_model.<path>`, `lora_unet_<flat
path>`, and per family `transformer.`/`lycoris_`/bare diffusers names from comfy/utils.py's maps).

Each family lists them as DiffusersRules: the ComfyUI path and the diffusers name, or no target where diffusers
has no plain name for the layer (then only the ComfyUI forms read it and the diffusers export says why not).
"""

from __future__ import annotations

import re

from ..archs import Arch, DiffusersRule


def _same(*paths: str) -> tuple[DiffusersRule, ...]:
    """Paths diffusers keeps as they are (a regex; the groups are filled back in)."""
    return tuple(DiffusersRule(path, (_template(path),)) for path in paths)


def _template(path: str) -> str:
    count = iter(range(path.count("(")))
    return re.sub(r"\((?!\?)[^()]*\)", lambda _: f"{{{next(count)}}}", path).replace("\\.", ".")


# comfy/utils.py z_image_to_diffusers (block adaLN, x/cap/t embedders, the final layer's `all_..._2-1` names)
_ZIMAGE = (
    *_same(r"layers\.(\d+)\.adaLN_modulation\.0", r"noise_refiner\.(\d+)\.adaLN_modulation\.0"),
    *_same(r"cap_embedder\.1", r"t_embedder\.mlp\.([02])"),  # context_refiner blocks have no adaLN
    DiffusersRule(r"x_embedder", ("all_x_embedder.2-1",)),
    DiffusersRule(r"final_layer\.linear", ("all_final_layer.2-1.linear",)),
    DiffusersRule(r"final_layer\.adaLN_modulation\.1", ("all_final_layer.2-1.adaLN_modulation.1",)),
)

# diffusers Flux2Transformer2DModel; its norm_out.linear holds the final modulation as (scale, shift), ComfyUI's
# final_layer.adaLN_modulation.1 as (shift, scale): rows in another order, so no plain name (no target).
_FLUX2 = (
    DiffusersRule(r"img_in", ("x_embedder",)),
    DiffusersRule(r"txt_in", ("context_embedder",)),
    DiffusersRule(r"time_in\.in_layer", ("time_guidance_embed.timestep_embedder.linear_1",)),
    DiffusersRule(r"time_in\.out_layer", ("time_guidance_embed.timestep_embedder.linear_2",)),
    DiffusersRule(r"guidance_in\.in_layer", ("time_guidance_embed.guidance_embedder.linear_1",)),
    DiffusersRule(r"guidance_in\.out_layer", ("time_guidance_embed.guidance_embedder.linear_2",)),
    DiffusersRule(r"double_stream_modulation_img\.lin", ("double_stream_modulation_img.linear",)),
    DiffusersRule(r"double_stream_modulation_txt\.lin", ("double_stream_modulation_txt.linear",)),
    DiffusersRule(r"single_stream_modulation\.lin", ("single_stream_modulation.linear",)),
    DiffusersRule(r"final_layer\.linear", ("proj_out",)),
    DiffusersRule(r"final_layer\.adaLN_modulation\.1", ()),
)

# diffusers ChromaTransformer2DModel: a Flux without modulation Linears; the approximator (ComfyUI's
# distilled_guidance_layer) gives every block its modulation, and its MLPEmbedders are PixArt text projections.
_CHROMA = (
    DiffusersRule(r"img_in", ("x_embedder",)),
    DiffusersRule(r"txt_in", ("context_embedder",)),
    DiffusersRule(r"final_layer\.linear", ("proj_out",)),
    *_same(r"distilled_guidance_layer\.in_proj", r"distilled_guidance_layer\.out_proj"),
    DiffusersRule(
        r"distilled_guidance_layer\.layers\.(\d+)\.in_layer", ("distilled_guidance_layer.layers.{0}.linear_1",)
    ),
    DiffusersRule(
        r"distilled_guidance_layer\.layers\.(\d+)\.out_layer", ("distilled_guidance_layer.layers.{0}.linear_2",)
    ),
)

# diffusers Lumina2Transformer2DModel (its lora_conversion_utils.py reads Lumina 2's LoRAs so): Lumina 2's adaLN
# is (SiLU, Linear), its Linear adaLN_modulation.1 where Z-Image's is .0; the final layer's scale-only modulation
# and its projection are norm_out's linear_1 and linear_2.
_LUMINA2 = (
    DiffusersRule(r"layers\.(\d+)\.adaLN_modulation\.1", ("layers.{0}.norm1.linear",)),
    DiffusersRule(r"noise_refiner\.(\d+)\.adaLN_modulation\.1", ("noise_refiner.{0}.norm1.linear",)),
    *_same(r"x_embedder"),
    DiffusersRule(r"t_embedder\.mlp\.0", ("time_caption_embed.timestep_embedder.linear_1",)),
    DiffusersRule(r"t_embedder\.mlp\.2", ("time_caption_embed.timestep_embedder.linear_2",)),
    DiffusersRule(r"cap_embedder\.1", ("time_caption_embed.caption_embedder.1",)),
    DiffusersRule(r"final_layer\.adaLN_modulation\.1", ("norm_out.linear_1",)),
    DiffusersRule(r"final_layer\.linear", ("norm_out.linear_2",)),
)

# Qwen-Image and Wan list their top-level Linears among their own rules (archs/qwen_image.py, archs/wan.py).
OUTSIDE: dict[str, tuple[DiffusersRule, ...]] = {
    "zimage": _ZIMAGE,
    "flux2": _FLUX2,
    "chroma": _CHROMA,
    "lumina2": _LUMINA2,
}

NO_NAME_WHY = {
    "flux2": "diffusers' norm_out.linear holds these rows as (scale, shift), ComfyUI's as (shift, scale)",
}


def rules(arch: Arch) -> tuple[DiffusersRule, ...]:
    """The arch's per-module rules, then its family's modules outside them."""
    return arch.diffusers_rules + OUTSIDE.get(arch.family, ())
