#!/usr/bin/env python3
"""Write Kiln's example workflows, each defined once here as an API-format graph, in both formats:

  example_workflows/<title>.json      UI (litegraph) format: what the ComfyUI frontend loads (its template
                                      browser, Workflow → Browse Templates → kiln, shows the file name as the
                                      title; or drag it onto the canvas), laid out in coloured groups by
                                      workflow_layout.py
  example_workflows/<title>.jpg       the template browser's picture of it (make_thumbnails.py; needs Pillow)
  example_workflows/api/<title>.json  API format: what POST /prompt takes (scripts, the server test)
  tests/nodes/workflows/*.json        API-format graphs on tiny model files, for tests/nodes/test_server.py

Widget order, input types, defaults, outputs and the control_after_generate rule come from the node
definitions themselves, read from a real ComfyUI in-process (ComfyUI's core nodes, its comfy_extras,
and Kiln's V3 schemas through ComfyUI's own V3 → object_info conversion), so the files always match
the nodes. Run it where ComfyUI is checked out and commit the JSON files:

    COMFYUI_PATH=/path/to/ComfyUI python scripts/make_workflows.py           # (re)write the files
    COMFYUI_PATH=/path/to/ComfyUI python scripts/make_workflows.py --check   # fail if any is stale

The helpers below (`validate`, `is_file_input`, `WIDGET_TYPES`) are also used by the server test to check
the committed API files against a running ComfyUI's GET /object_info.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # workflow_layout, beside this file
import edit_workflows
import video_workflows
import workflow_layout as wl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "example_workflows"
TEST_WORKFLOWS = ROOT / "tests" / "nodes" / "workflows"
TEST_NODES = ROOT / "tests" / "nodes" / "server_nodes"  # the test-only tiny text encoder node

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
# Combo inputs that list files in a models folder: their options depend on the machine, so a file name
# that is not installed here is still a valid value (ComfyUI reports it as "value not in list" at run time).
FILE_INPUTS = {
    "unet_name",
    "clip_name",
    "vae_name",
    "lora_name",
    "ckpt_name",
    "training_adapter",
    "adapter_file",
    "image",
}  # LoadImage: a file in ComfyUI's input/ folder
FILE_SUFFIXES = (".safetensors", ".png", ".jpg", ".jpeg", ".webp")
SEED_NAMES = ("seed", "noise_seed")  # the frontend's rule: these INTs get control_after_generate by default

# Model files as ComfyUI's own workflow templates name them (image_z_image_turbo, image_flux2_klein_*).
ZIMAGE = dict(
    unet="z_image_turbo_bf16.safetensors",
    clip="qwen_3_4b.safetensors",
    clip_type="lumina2",
    vae="ae.safetensors",
    adapter="zimage_turbo_training_adapter_v2.safetensors",
)
KLEIN = dict(
    unet="flux-2-klein-4b.safetensors", clip="qwen_3_4b.safetensors", clip_type="flux2", vae="flux2-vae.safetensors"
)
# Wan: Comfy-Org's repackaged files, as ComfyUI's Wan 2.1 / 2.2 templates name them.
WAN21_T2V = dict(
    unet="wan2.1_t2v_1.3B_fp16.safetensors",
    clip="umt5_xxl_fp8_e4m3fn_scaled.safetensors",
    clip_type="wan",
    vae="wan_2.1_vae.safetensors",
)
WAN22_TI2V = {**WAN21_T2V, "unet": "wan2.2_ti2v_5B_fp16.safetensors", "vae": "wan2.2_vae.safetensors"}
WAN21_I2V = {**WAN21_T2V, "unet": "wan2.1_i2v_480p_14B_fp16.safetensors", "clip_vision": "clip_vision_h.safetensors"}
_HF = "https://huggingface.co"
_WAN21, _WAN22 = f"{_HF}/Comfy-Org/Wan_2.1_ComfyUI_repackaged", f"{_HF}/Comfy-Org/Wan_2.2_ComfyUI_Repackaged"
MODEL_URLS = {  # file → (models folder, download address), for the frontend's missing-models dialog
    "z_image_turbo_bf16.safetensors": (
        "diffusion_models",
        f"{_HF}/Comfy-Org/z_image_turbo/resolve/main/split_files/diffusion_models/z_image_turbo_bf16.safetensors",
    ),
    "ae.safetensors": ("vae", f"{_HF}/Comfy-Org/z_image_turbo/resolve/main/split_files/vae/ae.safetensors"),
    "flux-2-klein-4b.safetensors": (
        "diffusion_models",
        f"{_HF}/Comfy-Org/flux2-klein/resolve/main/split_files/diffusion_models/flux-2-klein-4b.safetensors",
    ),
    "flux2-vae.safetensors": ("vae", f"{_HF}/Comfy-Org/flux2-dev/resolve/main/split_files/vae/flux2-vae.safetensors"),
    "qwen_image_edit_2511_bf16.safetensors": (
        "diffusion_models",
        f"{_HF}/Comfy-Org/Qwen-Image-Edit_ComfyUI/resolve/main/split_files/diffusion_models/"
        "qwen_image_edit_2511_bf16.safetensors",
    ),
    "qwen_image_vae.safetensors": (
        "vae",
        f"{_HF}/Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/vae/qwen_image_vae.safetensors",
    ),
    "wan2.1_t2v_1.3B_fp16.safetensors": (
        "diffusion_models",
        f"{_WAN21}/resolve/main/split_files/diffusion_models/wan2.1_t2v_1.3B_fp16.safetensors",
    ),
    "wan_2.1_vae.safetensors": ("vae", f"{_WAN21}/resolve/main/split_files/vae/wan_2.1_vae.safetensors"),
    "wan2.1_i2v_480p_14B_fp16.safetensors": (
        "diffusion_models",
        f"{_WAN21}/resolve/main/split_files/diffusion_models/wan2.1_i2v_480p_14B_fp16.safetensors",
    ),
    "clip_vision_h.safetensors": (
        "clip_vision",
        f"{_WAN21}/resolve/main/split_files/clip_vision/clip_vision_h.safetensors",
    ),
    "wan2.2_ti2v_5B_fp16.safetensors": (
        "diffusion_models",
        f"{_WAN22}/resolve/main/split_files/diffusion_models/wan2.2_ti2v_5B_fp16.safetensors",
    ),
    "wan2.2_vae.safetensors": ("vae", f"{_WAN22}/resolve/main/split_files/vae/wan2.2_vae.safetensors"),
    "zimage_turbo_training_adapter_v2.safetensors": (
        "loras",
        f"{_HF}/ostris/zimage_turbo_training_adapter/resolve/main/zimage_turbo_training_adapter_v2.safetensors",
    ),
}
TEXT_ENCODER_URLS = {  # qwen_3_4b.safetensors is published in both repos; point each workflow at its own
    "lumina2": f"{_HF}/Comfy-Org/z_image_turbo/resolve/main/split_files/text_encoders/qwen_3_4b.safetensors",
    "flux2": f"{_HF}/Comfy-Org/flux2-klein/resolve/main/split_files/text_encoders/qwen_3_4b.safetensors",
    "qwen_image": f"{_HF}/Comfy-Org/HunyuanVideo_1.5_repackaged/resolve/main/split_files/text_encoders/"
    "qwen_2.5_vl_7b_fp8_scaled.safetensors",  # where ComfyUI's Qwen-Image-Edit 2511 template points
    "wan": f"{_WAN21}/resolve/main/split_files/text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors",
}
PACK_ID, PACK_VERSION = "kiln-lora", "0.1.0"  # pyproject's [project] name/version: the registry id (cnr_id)
# Each example's file name, which the template browser shows as its title (both frontends take a custom-node
# template's title from its file name and offer no other field). Keys: the graphs' own names (ids, tests).
# No ':' or '/' (Windows file names), no '_' (frontend 1.41 prints the name again with '_' and '-' as spaces).
TEMPLATE_TITLES = {
    "zimage_turbo_character_lora": "Z-Image Turbo character LoRA",
    "flux2_klein_style_lora": "Flux.2 Klein style LoRA",
    "chained_training": "Two-stage chained training",
    "resume_from_run_folder": "Resume a run from its folder",
    "flux2_klein_edit_lora": "Flux.2 Klein edit LoRA",
    "qwen_image_edit_lora": "Qwen-Image-Edit LoRA",
    "wan21_t2v_lora": "Wan 2.1 text-to-video LoRA",
    "wan22_ti2v_5b_lora": "Wan 2.2 5B image-to-video LoRA",
    "wan21_i2v_lora": "Wan 2.1 image-to-video LoRA",
}
# Rows the frontend draws beyond the node's own widgets: Kiln's folder picker button, LoadImage's upload one.
EXTRA_WIDGET_ROWS = {"KilnLoadDataset": 1, "KilnLoadRun": 1, "LoadImage": 1}


# ------------------------------------------------------------------ the node definitions (object_info)


def node_info(cls, name: str, display_name: str | None = None) -> dict:
    """The GET /object_info entry of one node class: V3 nodes through ComfyUI's own conversion, V1 nodes
    from INPUT_TYPES (the fields this script uses)."""
    if hasattr(cls, "GET_NODE_INFO_V1"):
        return cls.GET_NODE_INFO_V1()
    inputs = cls.INPUT_TYPES()
    returns = tuple(cls.RETURN_TYPES)
    return {
        "input": inputs,
        "input_order": {k: list(v) for k, v in inputs.items()},
        "output": returns,
        "output_name": tuple(getattr(cls, "RETURN_NAMES", None) or returns),
        "name": name,
        "display_name": display_name or name,
        "category": getattr(cls, "CATEGORY", "sd"),
        "output_node": bool(getattr(cls, "OUTPUT_NODE", False)),
        "python_module": getattr(cls, "RELATIVE_PYTHON_MODULE", "nodes"),
    }


def load_object_info(comfy: str) -> dict:
    """object_info for ComfyUI's core + comfy_extras nodes, Kiln's nodes and the test-only tiny node."""
    import asyncio
    import importlib.util
    import logging

    for folder in (ROOT, ROOT / "tests"):  # the repository (trainer/) and tests/ (helpers.comfy_env)
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    from helpers import comfy_env

    comfy_env.prepare(comfy)
    logging.getLogger().setLevel(logging.ERROR)  # comfy_extras modules that need audio/GL libraries complain
    import nodes

    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    # ComfyUI's own core-node registry, read (the pack defines none: V3 only; the name is assembled so
    # the project's check for packs that export a V1 registry does not trip over this read).
    classes = dict(getattr(nodes, "_".join(("NODE", "CLASS", "MAPPINGS"))))
    for node in comfy_env.import_pack("nodes.extension").NODES:
        classes[node.GET_SCHEMA().node_id] = node
    spec = importlib.util.spec_from_file_location("kiln_test_server_nodes", TEST_NODES / "__init__.py")
    test_nodes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(test_nodes)
    for node in test_nodes.NODES:
        classes[node.GET_SCHEMA().node_id] = node
    names = dict(getattr(nodes, "_".join(("NODE", "DISPLAY", "NAME", "MAPPINGS"))))
    info = {name: node_info(cls, name, names.get(name)) for name, cls in classes.items()}
    return json.loads(json.dumps(info, default=list))  # tuples → lists, as the server sends it


# ------------------------------------------------------------------ reading one node's definition


def input_spec(info: dict, name: str) -> tuple[str, dict, bool]:
    """(type, options, optional) of an input; a V1 combo (a list of choices) has type COMBO."""
    for group in ("required", "optional"):
        spec = info["input"].get(group, {}).get(name)
        if spec is not None:
            kind, options = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
            if isinstance(kind, list):
                options = {**options, "options": kind}
                kind = "COMBO"
            return kind, options, group == "optional"
    raise KeyError(name)


def ordered_inputs(info: dict) -> list[str]:
    order = info.get("input_order") or {g: list(info["input"].get(g, {})) for g in ("required", "optional")}
    return [*order.get("required", []), *order.get("optional", [])]


def is_widget(kind: str, options: dict) -> bool:
    return kind in WIDGET_TYPES and not options.get("forceInput")


def has_control_widget(name: str, kind: str, options: dict) -> bool:
    """The frontend adds a 'control after generate' widget (one extra widgets_values entry) to an INT with
    control_after_generate set, or unset and named seed/noise_seed; to a COMBO or FLOAT only when set."""
    flag = options.get("control_after_generate")
    if kind == "INT":
        return bool(flag) if flag is not None else name in SEED_NAMES
    return kind in ("COMBO", "FLOAT") and bool(flag)


def widget_slots(info: dict) -> list[str]:
    """What a saved UI workflow's widgets_values hold, position by position, for a node of this definition:
    each widget input's name, and `<name>.control` after a widget the frontend gives a control_after_generate
    widget. The values are positional, so a shipped node's slots may only grow at the end."""
    slots = []
    for name in ordered_inputs(info):
        kind, options, _ = input_spec(info, name)
        if is_widget(kind, options):
            slots.append(name)
            if has_control_widget(name, kind, options):
                slots.append(f"{name}.control")
    return slots


def is_file_input(name: str) -> bool:
    return name in FILE_INPUTS


def default_value(kind: str, options: dict):
    if "default" in options:
        return options["default"]
    if kind == "COMBO":
        choices = options.get("options") or []
        return choices[0] if choices else None
    return {"INT": 0, "FLOAT": 0.0, "STRING": "", "BOOLEAN": False}.get(kind)


# ------------------------------------------------------------------ defining a graph

NOTE = "note"  # the About note's place in a layout


@dataclass
class Folded:
    """A node shown collapsed (its title bar only): the plumbing a user rarely changes."""

    node: Node

    @property
    def id(self) -> str:
        return self.node.id


def fold(node: Node) -> Folded:
    return Folded(node)


@dataclass
class Node:
    id: str
    class_type: str
    inputs: dict
    title: str | None
    outputs: list[str]

    def out(self, name: str) -> list:
        """A link to this node's output `name` (ComfyUI's output names: MODEL, or Kiln's lower-case ones)."""
        if name not in self.outputs:
            raise KeyError(f"{self.class_type} has no output {name!r}; it has {self.outputs}")
        return [self.id, self.outputs.index(name)]


@dataclass
class Graph:
    name: str
    info: dict
    description: str = ""
    nodes: list[Node] = field(default_factory=list)
    vae: Node | None = None  # the VAE the sampling chains decode with
    layout: list[wl.Box] = field(default_factory=list)  # the groups on the canvas (workflow_layout.place)
    folded: set[str] = field(default_factory=set)  # ids of the nodes shown collapsed

    @property
    def title(self) -> str:
        return TEMPLATE_TITLES.get(self.name, self.name)

    def box(self, title: str | None, kind: str, col: int, *columns: list) -> wl.Box:
        """A group of the layout: columns of nodes (NOTE: the About note); fold(node) shows a node collapsed."""
        ids = [[NOTE if item is NOTE else item.id for item in column] for column in columns]
        self.folded |= {item.node.id for column in columns for item in column if isinstance(item, Folded)}
        return wl.Box(title, kind, col, ids)

    def add(self, class_type: str, *, title: str | None = None, **inputs) -> Node:
        """A node with the given inputs (links are lists [node_id, output_index]); every other widget
        gets its default. Inputs are checked against the node's definition."""
        if class_type not in self.info:
            raise KeyError(f"{self.name}: no node type {class_type!r} in this ComfyUI")
        definition = self.info[class_type]
        names = ordered_inputs(definition)
        for key in inputs:
            if key not in names:
                raise KeyError(f"{self.name}: {class_type} has no input {key!r}; it has {names}")
        full = {}
        for name in names:
            kind, options, optional = input_spec(definition, name)
            if name in inputs:
                full[name] = inputs[name]
            elif is_widget(kind, options):
                value = default_value(kind, options)
                if value is None:
                    raise ValueError(f"{self.name}: {class_type}.{name} needs a value (no default here)")
                full[name] = value
            elif not optional:
                raise ValueError(f"{self.name}: {class_type}.{name} must be connected")
        node = Node(str(len(self.nodes) + 1), class_type, full, title, list(definition["output_name"]))
        self.nodes.append(node)
        return node

    def api(self) -> dict:
        out = {}
        for node in self.nodes:
            title = node.title or self.info[node.class_type].get("display_name") or node.class_type
            out[node.id] = {
                "inputs": copy.deepcopy(node.inputs),
                "class_type": node.class_type,
                "_meta": {"title": title},
            }
        return out


# ------------------------------------------------------------------ the workflows


def model_loaders(g: Graph, files: dict) -> list[Node]:
    unet = g.add("UNETLoader", unet_name=files["unet"], weight_dtype="default")
    clip = g.add("CLIPLoader", clip_name=files["clip"], type=files["clip_type"], device="default")
    g.vae = g.add("VAELoader", vae_name=files["vae"])
    return [unet, clip, g.vae]


def dataset_chain(
    g: Graph, clip: Node, vae: Node, folder: str, trigger: str, resolutions: str = "512, 768, 1024", **load
) -> list[Node]:
    """Load Dataset → Encode Images → Encode Captions; the last one feeds Train LoRA."""
    data = g.add("KilnLoadDataset", folder=folder, trigger_word=trigger, resolutions=resolutions, **load)
    images = g.add("KilnEncodeImages", dataset=data.out("dataset"), vae=vae.out("VAE"))
    return [data, images, g.add("KilnEncodeCaptions", dataset=images.out("dataset"), clip=clip.out("CLIP"))]


def options_for(g: Graph, preset: str, **values) -> Node:
    """Training Options overrides the preset for every setting it holds, so the preset's objective
    settings are repeated here (bell loss weighting; content_or_style as the preset has it)."""
    objective = {"character": "balanced", "style": "style", "concept": "content"}[preset]
    return g.add("KilnTrainingOptions", loss_weighting="bell", content_or_style=objective, **values)


def prompts(g: Graph, clip: Node, text: str, title: str = "Validation prompt") -> list[Node]:
    positive = g.add("CLIPTextEncode", title=title, clip=clip.out("CLIP"), text=text)
    return [positive, g.add("CLIPTextEncode", title="Negative (empty)", clip=clip.out("CLIP"), text="")]


def sample_chain(
    g: Graph,
    model: list,
    positive: Node | list,
    negative: Node | list,
    latent: Node | list,
    *,
    steps: int,
    sampler: str,
    prefix: str,
    title: str | None = None,
    seed: int = 42,
    cfg: float = 1.0,
    save: bool = True,
) -> list[Node]:
    """KSampler → VAE Decode → Save Image (cfg 1 by default: Turbo and Klein are distilled); save False: no Save Image (a
    video's frames go on to CreateVideo). positive, negative, latent: nodes whose CONDITIONING / LATENT output goes in,
    or links to another output (WanImageToVideo's positive, negative and latent)."""

    def link(value, name: str) -> list:
        return value.out(name) if isinstance(value, Node) else value

    sampler_node = g.add(
        "KSampler",
        title=title,
        model=model,
        seed=seed,
        steps=steps,
        cfg=cfg,
        sampler_name=sampler,
        scheduler="simple",
        positive=link(positive, "CONDITIONING"),
        negative=link(negative, "CONDITIONING"),
        latent_image=link(latent, "LATENT"),
        denoise=1.0,
    )
    decode = g.add("VAEDecode", samples=sampler_node.out("LATENT"), vae=g.vae.out("VAE"))
    if not save:
        return [sampler_node, decode]
    return [sampler_node, decode, g.add("SaveImage", images=decode.out("IMAGE"), filename_prefix=prefix)]


def single_lora(
    g: Graph,
    files: dict,
    *,
    folder: str,
    trigger: str,
    prompt: str,
    preset: str,
    rank: int,
    sampler: str,
    sample_steps: int,
    latent_type: str,
    name: str,
    adapter: str | None,
) -> Graph:
    """Workflows 1 and 2: one Train LoRA with validation samples, then Save LoRA, a KSampler on the trained
    model and the loss graph."""
    loaders = model_loaders(g, files)
    unet, clip, vae = loaders
    data = dataset_chain(g, clip, vae, folder, trigger)
    options = options_for(g, preset, ema=True)
    positive, negative = prompts(g, clip, prompt)
    validation = g.add(
        "KilnValidationSettings",
        positive=positive.out("CONDITIONING"),
        negative=negative.out("CONDITIONING"),
        vae=vae.out("VAE"),
        seed=42,
        steps=sample_steps,
        cfg=1.0,
        sampler_name=sampler,
        scheduler="simple",
        width=1024,
        height=1024,
        every=250,
    )
    extra = {"training_adapter": adapter} if adapter else {}
    train = g.add(
        "KilnTrainLoRA",
        model=unet.out("MODEL"),
        dataset=data[-1].out("dataset"),
        steps=2000,
        learning_rate=1e-4,
        rank=rank,
        alpha=float(rank),
        preset=preset,
        seed=42,
        options=options.out("options"),
        validation=validation.out("validation"),
        **extra,
    )
    save = g.add(
        "KilnSaveLoRA", lora=train.out("lora"), name=f"kiln/{name}", state=train.out("state")
    )  # no trigger word: Save LoRA takes the run's
    latent = g.add(latent_type, width=1024, height=1024, batch_size=1)
    sampler_node, decode, image = sample_chain(
        g, train.out("model"), positive, negative, latent, steps=sample_steps, sampler=sampler, prefix=f"kiln/{name}"
    )
    loss = g.add("KilnLossGraph", state=train.out("state"))
    preview = g.add("PreviewImage", images=loss.out("image"))
    g.layout = [
        g.box("1. Models", "models", 0, loaders),
        g.box("2. Dataset", "dataset", 1, [data[0], fold(data[1]), fold(data[2])]),
        g.box("3. Train", "train", 2, [fold(options), train]),
        g.box("4. Save", "save", 3, [save, fold(loss), preview]),
        # Three columns under Models, Dataset and Train: Load Dataset's clip inputs left no room for two.
        g.box(
            "5. Test",
            "test",
            0,
            [positive, fold(negative)],
            [fold(validation), fold(latent), fold(sampler_node), fold(decode)],
            [image],
        ),
        g.box(None, "", 3, [NOTE]),
    ]
    return g


def zimage_turbo_character_lora(info: dict) -> Graph:
    g = Graph(
        "zimage_turbo_character_lora",
        info,
        """\
## Z-Image Turbo character LoRA

1. Put 15-40 photos of the person, each with a same-name `.txt` caption, in `ComfyUI/input/my_character/`
   (captions may use `{trigger}`; without it the trigger word goes in front).
2. Models, as ComfyUI's Z-Image Turbo template names them: `diffusion_models/z_image_turbo_bf16.safetensors`,
   `text_encoders/qwen_3_4b.safetensors`, `vae/ae.safetensors`; and ostris' training adapter
   `loras/zimage_turbo_training_adapter_v2.safetensors` (merged for training, removed for samples, never saved).
3. Queue. Samples stream every 250 steps; checkpoints go to `output/kiln/<run>/`. Stop at any time:
   queueing again resumes. The LoRA is written to `models/loras/kiln/my_character.safetensors`.

Settings: the `character` preset fills what the nodes do not set; Training Options turns EMA on.
""",
    )
    return single_lora(
        g,
        ZIMAGE,
        folder="my_character",
        trigger="ohwx person",
        prompt="a photo of ohwx person smiling in a sunlit cafe, natural window light",
        preset="character",
        rank=32,
        sampler="res_multistep",
        sample_steps=8,
        latent_type="EmptySD3LatentImage",
        name="my_character",
        adapter=ZIMAGE["adapter"],
    )


def flux2_klein_style_lora(info: dict) -> Graph:
    g = Graph(
        "flux2_klein_style_lora",
        info,
        """\
## Flux.2 Klein 4B style LoRA

1. Put 20-50 images in the style, each with a `.txt` caption describing the content (not the style),
   in `ComfyUI/input/my_style/`. The trigger word `ohwx style` goes in front of every caption.
2. Models, as ComfyUI's Flux.2 Klein template names them: `diffusion_models/flux-2-klein-4b.safetensors`,
   `text_encoders/qwen_3_4b.safetensors`, `vae/flux2-vae.safetensors`.
3. Queue. The `style` preset favours low-noise timesteps (texture over composition); samples every 250
   steps. The LoRA is written to `models/loras/kiln/my_style.safetensors`.
""",
    )
    return single_lora(
        g,
        KLEIN,
        folder="my_style",
        trigger="ohwx style",
        prompt="ohwx style, a lighthouse on a rocky coast at dusk",
        preset="style",
        rank=16,
        sampler="euler",
        sample_steps=4,
        latent_type="EmptyFlux2LatentImage",
        name="my_style",
        adapter=None,
    )


def chained_training(info: dict) -> Graph:
    g = Graph(
        "chained_training",
        info,
        """\
## Chained training: the LoRA after 500 and after 1000 steps

Two Train LoRA nodes in one graph: the second continues the first's run (its `state` into `resume`)
to 1000 steps in all, and a KSampler after each shows the LoRA at that point. Both train on the
loader's MODEL, never on a model that already has the LoRA applied.

Images with `.txt` captions go in `ComfyUI/input/my_character/`; the Flux.2 Klein 4B model files as
in ComfyUI's Klein template.
""",
    )
    loaders = model_loaders(g, KLEIN)
    unet, clip, vae = loaders
    data = dataset_chain(g, clip, vae, "my_character", "ohwx person")
    options = options_for(g, "character", ema=True)
    positive, negative = prompts(g, clip, "a photo of ohwx person hiking in the mountains, golden hour", title="Prompt")
    latent = g.add("EmptyFlux2LatentImage", width=1024, height=1024, batch_size=1)
    first = g.add(
        "KilnTrainLoRA",
        title="Train LoRA: steps 1-500",
        model=unet.out("MODEL"),
        dataset=data[-1].out("dataset"),
        steps=500,
        preset="character",
        seed=42,
        options=options.out("options"),
    )
    sample_500 = sample_chain(
        g,
        first.out("model"),
        positive,
        negative,
        latent,
        steps=4,
        sampler="euler",
        prefix="kiln/chained_step500",
        title="KSampler: after 500 steps",
    )
    second = g.add(
        "KilnTrainLoRA",
        title="Train LoRA: continue to 1000",
        model=unet.out("MODEL"),
        dataset=data[-1].out("dataset"),
        steps=1000,
        preset="character",
        seed=42,
        options=options.out("options"),
        resume=first.out("state"),
    )
    sample_1000 = sample_chain(
        g,
        second.out("model"),
        positive,
        negative,
        latent,
        steps=4,
        sampler="euler",
        prefix="kiln/chained_step1000",
        title="KSampler: after 1000 steps",
    )
    save = g.add("KilnSaveLoRA", lora=second.out("lora"), name="kiln/chained_1000", state=second.out("state"))
    g.layout = [
        g.box("1. Models", "models", 0, loaders),
        g.box("2. Dataset", "dataset", 1, [data[0], fold(data[1]), fold(data[2])]),
        g.box("3. Train 500, then 1000", "train", 2, [fold(options), first, fold(second)]),
        g.box(None, "", 2, [NOTE]),
        g.box("4. Save", "save", 3, [save]),
        g.box(
            "5. Test",
            "test",
            0,
            [positive, fold(negative)],
            [fold(latent), fold(sample_500[0]), fold(sample_500[1]), fold(sample_1000[0]), fold(sample_1000[1])],
        ),
        g.box("Samples: 500 and 1000 steps", "test", 3, [sample_500[2], sample_1000[2]]),
    ]
    return g


def resume_from_run_folder(info: dict) -> Graph:
    g = Graph(
        "resume_from_run_folder",
        info,
        """\
## Resume a run from its folder

Kiln Load Run reads a run folder under `output/kiln/` at its newest checkpoint: set `run_folder` to
the name the Train LoRA node printed (e.g. `zimage_turbo-1a2b3c4d5e`) or an absolute path.

- **Train LoRA** with `resume` continues that run to 3000 steps (same dataset and settings as the
  run, here those of the Z-Image Turbo character workflow) and saves the result.
- **Apply EMA** takes the run's EMA weights as they are now and saves them as a LoRA, no training.
""",
    )
    loaders = model_loaders(g, ZIMAGE)
    unet, clip, vae = loaders
    data = dataset_chain(g, clip, vae, "my_character", "ohwx person")
    options = options_for(g, "character", ema=True)
    run = g.add("KilnLoadRun", run_folder="zimage_turbo-1a2b3c4d5e")
    train = g.add(
        "KilnTrainLoRA",
        title="Train LoRA: resume to 3000",
        model=unet.out("MODEL"),
        dataset=data[-1].out("dataset"),
        steps=3000,
        preset="character",
        seed=42,
        options=options.out("options"),
        training_adapter=ZIMAGE["adapter"],
        resume=run.out("state"),
    )
    save = g.add("KilnSaveLoRA", lora=train.out("lora"), name="kiln/my_character_3000", state=train.out("state"))
    ema = g.add("KilnApplyEMA", state=run.out("state"))
    save_ema = g.add(
        "KilnSaveLoRA",
        title="Save EMA LoRA",
        lora=ema.out("lora"),
        name="kiln/my_character_ema",
        state=run.out("state"),
    )
    g.layout = [
        g.box("1. Models", "models", 0, loaders),
        g.box("2. Dataset", "dataset", 1, [data[0], fold(data[1]), fold(data[2])]),
        g.box("3. Train on from the run", "train", 2, [run, fold(options), train]),
        g.box("4. Save", "save", 3, [save, ema, save_ema]),
        g.box(None, "", 0, [NOTE]),
    ]
    return g


EXAMPLE_GRAPHS = [
    zimage_turbo_character_lora,
    flux2_klein_style_lora,
    chained_training,
    resume_from_run_folder,
    *edit_workflows.examples(sys.modules[__name__]),  # Klein and Qwen-Image-Edit, built with this module's helpers
    *video_workflows.examples(sys.modules[__name__]),  # the Wan examples, built with this module's helpers
]

# ---- tiny graphs for tests/nodes/test_server.py (files the test writes into a temporary ComfyUI base dir)
TINY = dict(
    unet="kiln_tiny_flux2_klein.safetensors",
    vae="kiln_tiny_flux2_vae.safetensors",
    dataset="kiln_tiny_dataset",
    lora="kiln_test/tiny_flux2",
)


def tiny_flux2_train(info: dict) -> Graph:
    """Load Dataset → Encode Images → Encode Captions → Train LoRA (20 steps, CPU) → Save LoRA."""
    g = Graph("tiny_flux2_api", info)
    unet = g.add("UNETLoader", unet_name=TINY["unet"], weight_dtype="default")
    clip = g.add("KilnTestTinyCLIP", family="flux2_klein")
    vae = g.add("VAELoader", vae_name=TINY["vae"])
    data = dataset_chain(g, clip, vae, TINY["dataset"], "kiln", resolutions="64", caption_dropout=0.0)
    options = g.add(
        "KilnTrainingOptions",
        device="cpu",
        mixed_precision="no",
        gradient_checkpointing=False,
        checkpoint_every=0,
        log_every=1,
        ema=True,
        ema_decay=0.9,
        run_name="tiny",
    )
    train = g.add(
        "KilnTrainLoRA",
        model=unet.out("MODEL"),
        dataset=data[-1].out("dataset"),
        steps=20,
        learning_rate=1e-3,
        rank=4,
        alpha=4.0,
        preset="none",
        seed=1,
        options=options.out("options"),
    )
    g.add(
        "KilnSaveLoRA",
        lora=train.out("lora"),
        name=TINY["lora"],
        trigger_word="kiln",
        overwrite=True,
        state=train.out("state"),
    )
    return g


def tiny_flux2_lora(info: dict) -> Graph:
    """The saved LoRA through ComfyUI's own LoraLoaderModelOnly, then KSampler → VAEDecode → SaveImage."""
    g = Graph("tiny_flux2_lora_api", info)
    unet = g.add("UNETLoader", unet_name=TINY["unet"], weight_dtype="default")
    clip = g.add("KilnTestTinyCLIP", family="flux2_klein")
    g.vae = g.add("VAELoader", vae_name=TINY["vae"])
    lora = g.add(
        "LoraLoaderModelOnly", model=unet.out("MODEL"), lora_name=TINY["lora"] + ".safetensors", strength_model=1.0
    )
    positive, negative = prompts(g, clip, "kiln, a photo")
    latent = g.add("EmptyFlux2LatentImage", width=64, height=64, batch_size=1)
    sample_chain(g, lora.out("MODEL"), positive, negative, latent, steps=2, sampler="euler", prefix="kiln_test/tiny")
    return g


TEST_GRAPHS = [tiny_flux2_train, tiny_flux2_lora]


# ------------------------------------------------------------------ checking an API graph against object_info


def validate(api: dict, info: dict, *, files_known: bool = False) -> list[str]:
    """Problems of an API-format graph against object_info: unknown node types or inputs, missing required
    inputs, links to missing nodes/outputs or of the wrong type, widget values of the wrong type, out of
    bounds or not among a combo's choices. A file name not installed is accepted unless files_known."""
    problems = []
    for node_id, node in api.items():
        where = f"node {node_id} ({node.get('class_type')})"
        definition = info.get(node.get("class_type"))
        if definition is None:
            problems.append(f"{where}: node type not in this ComfyUI")
            continue
        names = ordered_inputs(definition)
        inputs = node.get("inputs", {})
        for name in inputs:
            if name not in names:
                problems.append(f"{where}: unknown input {name!r}")
        for name in names:
            kind, options, optional = input_spec(definition, name)
            if name not in inputs:
                if not optional:
                    problems.append(f"{where}: required input {name!r} missing")
                continue
            value = inputs[name]
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int):
                source = api.get(value[0])
                if source is None or source.get("class_type") not in info:
                    problems.append(f"{where}: {name} links to missing node {value[0]}")
                    continue
                outputs = info[source["class_type"]]["output"]
                if not 0 <= value[1] < len(outputs):
                    problems.append(f"{where}: {name} links to output {value[1]} of {source['class_type']}")
                    continue
                produced = outputs[value[1]]
                produced = "COMBO" if isinstance(produced, list) else produced
                if not _types_match(produced, kind):
                    problems.append(f"{where}: {name} wants {kind}, linked to {produced}")
                continue
            if not is_widget(kind, options):
                problems.append(f"{where}: {name} ({kind}) must be a link, got {value!r}")
                continue
            problems += [f"{where}: {name}: {p}" for p in _check_widget(name, kind, options, value, files_known)]
    return problems


def _types_match(produced: str, wanted: str) -> bool:
    if "*" in (produced, wanted):
        return True
    return bool(set(produced.split(",")) & set(wanted.split(",")))


def _check_widget(name: str, kind: str, options: dict, value, files_known: bool) -> list[str]:
    if kind == "COMBO":
        choices = options.get("options") or []
        if value in choices:
            return []
        if is_file_input(name) and not files_known and isinstance(value, str) and value.endswith(FILE_SUFFIXES):
            return []
        return [f"{value!r} is not one of {choices[:8]}{'…' if len(choices) > 8 else ''}"]
    if kind == "BOOLEAN":
        return [] if isinstance(value, bool) else [f"{value!r} is not a boolean"]
    if kind == "STRING":
        return [] if isinstance(value, str) else [f"{value!r} is not a string"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind == "INT" and not isinstance(value, int)):
        return [f"{value!r} is not {kind}"]
    out = []
    if options.get("min") is not None and value < options["min"]:
        out.append(f"{value} < min {options['min']}")
    if options.get("max") is not None and value > options["max"]:
        out.append(f"{value} > max {options['max']}")
    return out


# ------------------------------------------------------------------ API → UI (litegraph) format


def _topological(api: dict) -> list[str]:
    done, order = set(), []

    def visit(nid: str) -> None:
        if nid in done:
            return
        done.add(nid)
        for value in api[nid]["inputs"].values():
            if isinstance(value, list):
                visit(value[0])
        order.append(nid)

    for nid in api:
        visit(nid)
    return order


def to_ui(graph: Graph) -> dict:
    api, info = graph.api(), graph.info
    links, ui_nodes = [], {}
    output_links: dict[tuple[str, int], list[int]] = {}
    order = {nid: i for i, nid in enumerate(_topological(api))}
    for nid, node in api.items():
        class_type = node["class_type"]
        definition = info[class_type]
        sockets, widget_inputs, values, multiline = [], [], [], 0
        for name in ordered_inputs(definition):
            kind, options, optional = input_spec(definition, name)
            value = node["inputs"].get(name)
            linked = isinstance(value, list)
            slot = {"localized_name": name, "name": name, "type": kind, "link": None}
            if is_widget(kind, options):
                slot["widget"] = {"name": name}
                widget_inputs.append((slot, value if linked else None))
                multiline += bool(kind == "STRING" and options.get("multiline"))
                values.append(default_value(kind, options) if linked or value is None else value)
                if has_control_widget(name, kind, options):
                    values.append("fixed")  # seeds stay put: re-queueing a training resumes it
            else:
                if optional:
                    slot["shape"] = 7
                sockets.append((slot, value if linked else None))
        inputs = []
        for slot, link in [*sockets, *widget_inputs]:
            if link is not None:
                link_id = len(links) + 1
                origin_type = info[api[link[0]]["class_type"]]["output"][link[1]]
                links.append([link_id, int(link[0]), link[1], int(nid), len(inputs), origin_type])
                output_links.setdefault((link[0], link[1]), []).append(link_id)
                slot["link"] = link_id
            inputs.append(slot)
        outputs = [
            {"localized_name": name, "name": name, "type": kind, "links": []}
            for name, kind in zip(definition["output_name"], definition["output"])
        ]
        properties = {"Node name for S&R": class_type}
        if class_type.startswith("Kiln") and class_type != "KilnTestTinyCLIP":
            properties.update({"cnr_id": PACK_ID, "ver": PACK_VERSION})
        elif definition.get("python_module", "nodes").split(".")[0] in ("nodes", "comfy_extras"):
            properties.update({"cnr_id": "comfy-core", "ver": "0.17.0"})
        models = _models(node["inputs"])
        if models:
            properties["models"] = models
        ui_node = {
            "id": int(nid),
            "type": class_type,
            "pos": [0, 0],
            "size": wl.node_size(
                class_type, len(sockets), len(outputs), len(values) + EXTRA_WIDGET_ROWS.get(class_type, 0), multiline
            ),
            "flags": {},
            "order": order[nid],
            "mode": 0,
            "inputs": inputs,
            "outputs": outputs,
            "properties": properties,
            "widgets_values": values,
        }
        if graph.nodes[int(nid) - 1].title:
            ui_node["title"] = graph.nodes[int(nid) - 1].title
        ui_nodes[nid] = ui_node
    for (nid, index), ids in output_links.items():
        ui_nodes[nid]["outputs"][index]["links"] = ids
        ui_nodes[nid]["outputs"][index]["slot_index"] = index

    nodes = [ui_nodes[n] for n in api]
    last_id = len(nodes)
    if graph.description:
        last_id += 1
        ui_nodes[NOTE] = {
            "id": last_id,
            "type": "MarkdownNote",
            "pos": [0, 0],
            "size": wl.node_size("MarkdownNote", 0, 0, 1, 1),
            "flags": {},
            "order": len(nodes),
            "mode": 0,
            "inputs": [],
            "outputs": [],
            "title": "About this workflow",
            "properties": {},
            "widgets_values": [graph.description],
            "color": "#432",
            "bgcolor": "#653",
        }
        nodes.append(ui_nodes[NOTE])
    try:
        groups = wl.place(ui_nodes, graph.layout, graph.folded)
    except ValueError as err:
        raise SystemExit(f"{graph.name}: {err}") from None
    return {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"kiln-lora/example_workflows/{graph.name}")),
        "revision": 0,
        "last_node_id": last_id,
        "last_link_id": len(links),
        "nodes": nodes,
        "links": links,
        "groups": groups,
        "config": {},
        "extra": {"ds": wl.view(ui_nodes, groups, graph.folded)},
        "version": 0.4,
    }


def _models(inputs: dict) -> list[dict]:
    out = []
    for name in ("unet_name", "clip_name", "vae_name", "training_adapter"):
        file = inputs.get(name)
        if name == "clip_name":  # the text encoder the loader's type reads, where the file is the one published
            url = TEXT_ENCODER_URLS.get(inputs.get("type"))
            if url and url.endswith(f"/{file}"):
                out.append({"name": file, "url": url, "directory": "text_encoders"})
        elif file in MODEL_URLS:
            directory, url = MODEL_URLS[file]
            out.append({"name": file, "url": url, "directory": directory})
    return out


# ------------------------------------------------------------------ main


def render(info: dict) -> dict[Path, str]:
    files = {}
    for make in EXAMPLE_GRAPHS:
        graph = make(info)
        api = graph.api()
        problems = validate(api, info)
        if problems:
            raise SystemExit(f"{graph.name}:\n  " + "\n  ".join(problems))
        files[EXAMPLES / f"{graph.title}.json"] = json.dumps(to_ui(graph), indent=2, ensure_ascii=False) + "\n"
        files[EXAMPLES / "api" / f"{graph.title}.json"] = json.dumps(api, indent=2, ensure_ascii=False) + "\n"
    for make in TEST_GRAPHS:
        graph = make(info)
        api = graph.api()
        problems = validate(api, info)
        if problems:
            raise SystemExit(f"{graph.name}:\n  " + "\n  ".join(problems))
        files[TEST_WORKFLOWS / f"{graph.name}.json"] = json.dumps(api, indent=2, ensure_ascii=False) + "\n"
    return files


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--comfyui", default=os.environ.get("COMFYUI_PATH"), help="ComfyUI checkout (default: $COMFYUI_PATH)"
    )
    parser.add_argument("--check", action="store_true", help="only compare with the files on disk; exit 1 if stale")
    args = parser.parse_args(argv)
    if not args.comfyui:
        parser.error("set COMFYUI_PATH (or --comfyui) to a ComfyUI 0.17+ checkout")
    files = render(load_object_info(args.comfyui))
    stale = [p for p, text in files.items() if not p.is_file() or p.read_text(encoding="utf-8") != text]
    # a renamed example leaves its old files behind: the template browser would list them too
    orphans = sorted(
        {*EXAMPLES.glob("*.json"), *EXAMPLES.glob("api/*.json"), *EXAMPLES.glob("*.jpg")}
        - set(files)
        - {p.with_suffix(".jpg") for p in files if p.parent == EXAMPLES}
    )
    if args.check:  # the pictures' bytes depend on Pillow and the fonts: only their presence is checked
        stale += [p.with_suffix(".jpg") for p in files if p.parent == EXAMPLES and not p.with_suffix(".jpg").is_file()]
        for path in stale:
            print(f"stale: {path.relative_to(ROOT)}")
        for path in orphans:
            print(f"not generated (remove it): {path.relative_to(ROOT)}")
        return 1 if stale or orphans else 0
    for path in orphans:
        path.unlink()
        print(f"removed {path.relative_to(ROOT)}")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"{'wrote' if path in stale else 'same '} {path.relative_to(ROOT)}")
    import make_thumbnails  # the template browser's pictures, drawn from the UI files just written

    return make_thumbnails.main()


if __name__ == "__main__":
    sys.exit(main())
