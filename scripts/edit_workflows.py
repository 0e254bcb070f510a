"""The Qwen-Image-Edit example of scripts/make_workflows.py (its own file: the script's budget): an edit LoRA on
control → target pairs, validation with the reference on both prompts. `examples(mw)` hands make_workflows.py the
definition, built with its helpers (`mw`: that module, whatever name it runs under)."""

from __future__ import annotations


def examples(mw) -> list:
    """The edit example definitions, each info → Graph as make_workflows.EXAMPLE_GRAPHS holds them."""
    return [lambda info: qwen_image_edit_lora(mw, info)]


# Qwen-Image-Edit as ComfyUI's image_qwen_image_edit_2511 template names its files, the bf16 model to train on.
QWEN_EDIT = dict(
    unet="qwen_image_edit_2511_bf16.safetensors",
    clip="qwen_2.5_vl_7b_fp8_scaled.safetensors",
    clip_type="qwen_image",
    vae="qwen_image_vae.safetensors",
)


def qwen_image_edit_lora(mw, info: dict):
    g = mw.Graph(
        "qwen_image_edit_lora",
        info,
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
    )
    loaders = mw.model_loaders(g, QWEN_EDIT)
    unet, clip, vae = loaders
    data = mw.dataset_chain(g, clip, vae, "my_qwen_edits", "", resolutions="512, 768, 1024")
    options = mw.options_for(g, "concept", ema=True)
    image = g.add("LoadImage", title="Validation reference", image="example.png")
    encoded = g.add("VAEEncode", pixels=image.out("IMAGE"), vae=vae.out("VAE"))
    positive, negative = mw.prompts(g, clip, "make it a watercolour painting", title="Validation instruction")
    # cfg 2.5 needs the negative to see the reference too, as the edit templates' empty edit prompt does
    reference, negative_reference = (
        g.add("ReferenceLatent", title=f"Reference on the {name}", conditioning=cond.out("CONDITIONING"), latent=latent)
        for name, cond, latent in (
            ("instruction", positive, encoded.out("LATENT")),
            ("negative", negative, encoded.out("LATENT")),
        )
    )
    validation = g.add(
        "KilnValidationSettings",
        positive=reference.out("CONDITIONING"),
        negative=negative_reference.out("CONDITIONING"),
        vae=vae.out("VAE"),
        seed=42,
        steps=20,
        cfg=2.5,
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
    save = g.add("KilnSaveLoRA", lora=train.out("lora"), name="kiln/my_qwen_edits", state=train.out("state"))
    sampler_node, decode, saved = mw.sample_chain(
        g,
        train.out("model"),
        reference,
        negative_reference,
        encoded,
        steps=20,
        sampler="euler",
        prefix="kiln/my_qwen_edits",
        cfg=2.5,
    )
    # Loaders folded (the template's files, offered by the missing-models dialog): the test group fits under them
    g.layout = [
        g.box("1. Models", "models", 0, [mw.fold(node) for node in loaders]),
        g.box("2. Dataset", "dataset", 1, [data[0], mw.fold(data[1]), mw.fold(data[2])]),
        g.box("3. Train", "train", 2, [mw.fold(options), train]),
        g.box("4. Save", "save", 3, [save]),
        g.box(
            "5. Test: validation samples",
            "test",
            0,
            [
                image,
                mw.fold(encoded),
                mw.fold(reference),
                mw.fold(negative_reference),
                positive,
                mw.fold(negative),
                mw.fold(validation),
            ],
        ),
        g.box("6. Test the LoRA", "test", 3, [mw.fold(sampler_node), mw.fold(decode), saved]),
        g.box(None, "", 2, [mw.NOTE]),
    ]
    return g
