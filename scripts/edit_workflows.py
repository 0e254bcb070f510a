"""The edit examples of scripts/make_workflows.py (their own file: the script's budget), Flux.2 Klein and
Qwen-Image-Edit, both from one builder: an edit LoRA on control → target pairs, validation with a reference image as
the model's reference latent, Save LoRA, and a KSampler on the trained model. What differs between the two (files,
sampling, whether the negative sees the reference too, the layout) is an `Edit`. `examples(mw)` hands
make_workflows.py the definitions, built with its helpers (`mw`: that module, whatever name it runs under)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Edit:
    """One edit example: its graph's name, About note, model files and dataset folder, the sampling of its validation
    and test (steps, cfg), and how its nodes are laid out (`layout(mw, g, nodes)` → the boxes)."""

    name: str
    note: str
    files: Callable  # mw → the model files (make_workflows' dicts)
    folder: str
    steps: int
    cfg: float
    layout: Callable
    negative_reference: bool = False  # cfg > 1: the negative sees the reference too, as the edit templates' empty edit
    titled_references: bool = False  # with two ReferenceLatents, titles say which is which


def examples(mw) -> list:
    """The edit example definitions, each info → Graph as make_workflows.EXAMPLE_GRAPHS holds them."""
    return [lambda info, edit=edit: edit_lora(mw, info, edit) for edit in (KLEIN_EDIT, QWEN_EDIT_LORA)]


def edit_lora(mw, info: dict, edit: Edit):
    """Loaders → Load Dataset → Encode Images → Encode Captions → Train LoRA (validation: the instruction on the
    reference image's latent) → Save LoRA, and a KSampler on the trained model on the same reference."""
    g = mw.Graph(edit.name, info, edit.note)
    loaders = mw.model_loaders(g, edit.files(mw))
    unet, clip, vae = loaders
    data = mw.dataset_chain(g, clip, vae, edit.folder, "", resolutions="512, 768, 1024")
    options = mw.options_for(g, "concept", ema=True)
    image = g.add("LoadImage", title="Validation reference", image="example.png")
    encoded = g.add("VAEEncode", pixels=image.out("IMAGE"), vae=vae.out("VAE"))
    positive, negative = mw.prompts(g, clip, "make it a watercolour painting", title="Validation instruction")
    sides = [("instruction", positive), ("negative", negative)][: 2 if edit.negative_reference else 1]
    references = [
        g.add(
            "ReferenceLatent",
            title=f"Reference on the {side}" if edit.titled_references else None,
            conditioning=cond.out("CONDITIONING"),
            latent=encoded.out("LATENT"),
        )
        for side, cond in sides
    ]
    reference, negative_side = references[0], references[-1] if edit.negative_reference else negative
    validation = g.add(
        "KilnValidationSettings",
        positive=reference.out("CONDITIONING"),
        negative=negative_side.out("CONDITIONING"),
        vae=vae.out("VAE"),
        seed=42,
        steps=edit.steps,
        cfg=edit.cfg,
        sampler_name="euler",
        scheduler="simple",
        width=1024,
        height=1024,
        every=250,
    )
    train = g.add(
        "KilnTrainLoRA",
        model=unet.out("MODEL"),
        dataset=data[-1].out("dataset"),
        steps=2000,
        learning_rate=1e-4,
        rank=16,
        alpha=16.0,
        preset="concept",
        seed=42,
        options=options.out("options"),
        validation=validation.out("validation"),
    )
    save = g.add("KilnSaveLoRA", lora=train.out("lora"), name=f"kiln/{edit.folder}", state=train.out("state"))
    tested = mw.sample_chain(
        g,
        train.out("model"),
        reference,
        negative_side,
        encoded,
        steps=edit.steps,
        sampler="euler",
        prefix=f"kiln/{edit.folder}",
        cfg=edit.cfg,
    )
    nodes = dict(
        loaders=loaders, data=data, options=options, image=image, encoded=encoded, prompts=[positive, negative]
    )
    nodes.update(references=references, validation=validation, train=train, save=save, tested=tested)
    g.layout = edit.layout(mw, g, nodes)
    return g


def klein_layout(mw, g, n: dict) -> list:
    (positive, negative), (reference,), fold = n["prompts"], n["references"], mw.fold
    return [
        g.box("1. Models", "models", 0, n["loaders"]),
        g.box("2. Dataset", "dataset", 1, [n["data"][0], fold(n["data"][1]), fold(n["data"][2])]),
        # The validation's plumbing sits folded under Train LoRA: Load Dataset's clip inputs left no room below.
        g.box("3. Train", "train", 2, [fold(n["options"]), n["train"], fold(reference), fold(n["validation"])]),
        g.box("4. Save", "save", 3, [n["save"]]),
        g.box("5. Test: validation samples", "test", 0, [n["image"], fold(n["encoded"])], [positive, fold(negative)]),
        g.box("6. Test the LoRA", "test", 3, [fold(n["tested"][0]), fold(n["tested"][1]), n["tested"][2]]),
        g.box(None, "", 2, [mw.NOTE]),
    ]


def qwen_layout(mw, g, n: dict) -> list:
    (positive, negative), fold = n["prompts"], mw.fold
    test = [n["image"], fold(n["encoded"]), *(fold(r) for r in n["references"]), positive, fold(negative)]
    # Loaders folded (the template's files, offered by the missing-models dialog): the test group fits under them
    return [
        g.box("1. Models", "models", 0, [fold(node) for node in n["loaders"]]),
        g.box("2. Dataset", "dataset", 1, [n["data"][0], fold(n["data"][1]), fold(n["data"][2])]),
        g.box("3. Train", "train", 2, [fold(n["options"]), n["train"]]),
        g.box("4. Save", "save", 3, [n["save"]]),
        g.box("5. Test: validation samples", "test", 0, [*test, fold(n["validation"])]),
        g.box("6. Test the LoRA", "test", 3, [fold(n["tested"][0]), fold(n["tested"][1]), n["tested"][2]]),
        g.box(None, "", 2, [mw.NOTE]),
    ]


KLEIN_EDIT = Edit(
    "flux2_klein_edit_lora",
    """\
## Flux.2 Klein 4B edit LoRA (control → target pairs)

1. In `ComfyUI/input/my_edits/` put the targets (`photo.png`, each with a `.txt` instruction such as
   "make it a watercolour") and, in `my_edits/control/`, the image each was made from under the same name
   (`control/photo.png`; any image extension). More references per target: `control_2/`, `control_3/`.
   Optional loss masks: `photo.mask.png` beside a target (white trains).
2. Models, as ComfyUI's Flux.2 Klein template names them: `diffusion_models/flux-2-klein-4b.safetensors`,
   `text_encoders/qwen_3_4b.safetensors`, `vae/flux2-vae.safetensors`.
3. Put a test image in `ComfyUI/input/` and pick it in Load Image: it becomes the reference latent of the
   validation prompt (ReferenceLatent, as ComfyUI's Klein edit template does), so samples show the edit.
   Kiln feeds the control latents to the model exactly so while training (the same call, bitwise).
""",
    files=lambda mw: mw.KLEIN,
    folder="my_edits",
    steps=4,
    cfg=1.0,  # Klein is distilled
    layout=klein_layout,
)

# Qwen-Image-Edit as ComfyUI's image_qwen_image_edit_2511 template names its files, the bf16 model to train on.
QWEN_EDIT = dict(
    unet="qwen_image_edit_2511_bf16.safetensors",
    clip="qwen_2.5_vl_7b_fp8_scaled.safetensors",
    clip_type="qwen_image",
    vae="qwen_image_vae.safetensors",
)

QWEN_EDIT_LORA = Edit(
    "qwen_image_edit_lora",
    """\
## Qwen-Image-Edit LoRA (control → target pairs; 2511 or 2509)

1. In `ComfyUI/input/my_qwen_edits/` put the targets (`photo.png`, each with a `.txt` instruction such as
   "make it a watercolour") and, in `my_qwen_edits/control/`, the image each was made from under the same
   name (`control/photo.png`). More references per target: `control_2/`, `control_3/`.
2. Models, as ComfyUI's Qwen-Image-Edit 2511 template names them (the bf16 model to train on):
   `diffusion_models/qwen_image_edit_2511_bf16.safetensors` (or 2509's),
   `text_encoders/qwen_2.5_vl_7b_fp8_scaled.safetensors`, `vae/qwen_image_vae.safetensors`.
3. Put a test image in `ComfyUI/input/` and pick it in Load Image: it becomes the reference latent of the
   validation prompt and its empty negative (ReferenceLatent), so samples show the edit: the same call as
   training's, bitwise (captions are encoded as text alone; TextEncodeQwenImageEditPlus works too).
""",
    files=lambda mw: QWEN_EDIT,
    folder="my_qwen_edits",
    steps=20,
    cfg=2.5,
    layout=qwen_layout,
    negative_reference=True,  # cfg 2.5 needs the negative to see the reference too
    titled_references=True,
)
