"""The Wan video examples of scripts/make_workflows.py (their own file: the script's budget): a Wan LoRA on a folder
of clips, its validation samples clips, and a KSampler on the trained model into a video file; Wan 2.1 I2V 14B with
CLIP vision, its samples drawn from a start image. `examples(mw)`
hands make_workflows.py the definitions, built with its helpers (`mw`: that module, whatever name it runs under)."""

from __future__ import annotations

from dataclasses import dataclass


def examples(mw) -> list:
    """The Wan example definitions, each info → Graph as make_workflows.EXAMPLE_GRAPHS holds them."""
    return [
        lambda info: wan21_t2v_lora(mw, info),
        lambda info: wan22_ti2v_5b_lora(mw, info),
        lambda info: wan21_i2v_lora(mw, info),
    ]


@dataclass(frozen=True)
class Video:
    """A Wan example's video settings: the sample size, frame rate and ComfyUI's sampling for the model."""

    width: int = 832
    height: int = 480
    frames: int = 33  # 4k+1: 9 latent frames
    fps: float = 16.0
    steps: int = 30
    cfg: float = 6.0


def wan_video_lora(mw, g, files: dict, video: Video, *, prompt: str, name: str, start_image: bool):
    """A Wan LoRA on a folder of clips: validation samples as clips, Save LoRA, and a KSampler on the trained
    model into a video file (from a start image through Wan22ImageToVideoLatent when start_image: the validation
    samples too, through Validation Settings' start_latent)."""
    loaders = mw.model_loaders(g, files)
    unet, clip, vae = loaders
    data = mw.dataset_chain(
        g, clip, vae, f"{name}_clips", "ohwx", resolutions="480", frames=video.frames, fps=video.fps
    )
    options = mw.options_for(g, "concept", ema=True)
    positive, negative = mw.prompts(g, clip, prompt)
    size = dict(width=video.width, height=video.height)
    first = [g.add("LoadImage", title="Start image", image="example.png")] if start_image else []
    latent = (
        g.add(
            "Wan22ImageToVideoLatent",
            vae=vae.out("VAE"),
            **size,
            length=video.frames,
            start_image=first[0].out("IMAGE"),
        )
        if start_image
        else g.add("EmptyHunyuanLatentVideo", **size, length=video.frames, batch_size=1)
    )
    validation, train = validated_training(
        g,
        video,
        unet.out("MODEL"),
        data[-1].out("dataset"),
        options,
        vae,
        positive=positive.out("CONDITIONING"),
        negative=negative.out("CONDITIONING"),
        # the 5B's image-to-video samples start from the test's start image too (its latent carries it)
        **({"start_latent": latent.out("LATENT")} if start_image else {}),
    )
    save = g.add("KilnSaveLoRA", lora=train.out("lora"), name=f"kiln/{name}", state=train.out("state"))
    sampler_node, decode, clip_out = test_clip(mw, g, video, train, positive, negative, latent, name)
    folded = [mw.fold(n) for n in (negative, validation, latent, sampler_node, decode)]
    models = g.box("1. Models", "models", 0, loaders)
    dataset = g.box("2. Dataset", "dataset", 1, [data[0], mw.fold(data[1]), mw.fold(data[2])])
    training = g.box("3. Train", "train", 2, [mw.fold(options), train])
    if first:  # the start image takes the test's first column: the clip goes beside Save, no loss graph there
        g.layout = [
            *(models, dataset, training),
            g.box("4. Save", "save", 3, [save]),
            g.box("5. Test", "test", 0, first, [positive, folded[0]], folded[1:]),
            g.box("6. Test clip", "test", 3, [clip_out]),
            g.box(None, "", 3, [mw.NOTE]),
        ]
        return g
    loss = g.add("KilnLossGraph", state=train.out("state"))
    g.layout = [
        *(models, dataset, training),
        g.box("4. Save", "save", 3, [save, mw.fold(loss), g.add("PreviewImage", images=loss.out("image"))]),
        g.box("5. Test", "test", 0, [positive, folded[0]], folded[1:], [clip_out]),
        g.box(None, "", 3, [mw.NOTE]),
    ]
    return g


def test_clip(mw, g, video: Video, train, positive, negative, latent, name: str) -> list:
    """The trained model's test clip: KSampler → VAE Decode (sample_chain) → SaveWEBM, a clip file whose inputs are the
    same in every supported ComfyUI (0.33's SaveVideo is not): [KSampler, VAE Decode, SaveWEBM]."""
    chain = mw.sample_chain(
        g,
        train.out("model"),
        positive,
        negative,
        latent,
        steps=video.steps,
        sampler="uni_pc",
        prefix="",
        cfg=video.cfg,
        save=False,
    )
    return [
        *chain,
        g.add("SaveWEBM", images=chain[1].out("IMAGE"), filename_prefix=f"kiln/{name}", codec="vp9", fps=video.fps),
    ]


def validated_training(g, video: Video, model, dataset, options, vae, **prompts):
    """Validation Settings (clips of the video's size and frames; `prompts`: positive, negative, and a start_latent
    where the samples start from one) into Train LoRA, as every Wan example trains: (validation, train)."""
    validation = g.add(
        "KilnValidationSettings",
        vae=vae.out("VAE"),
        seed=42,
        steps=video.steps,
        cfg=video.cfg,
        sampler_name="uni_pc",
        scheduler="simple",
        width=video.width,
        height=video.height,
        every=250,
        frames=video.frames,
        **prompts,
    )
    train = g.add(
        "KilnTrainLoRA",
        model=model,
        dataset=dataset,
        steps=2000,
        learning_rate=1e-4,
        rank=32,
        alpha=32.0,
        preset="concept",
        seed=42,
        options=options.out("options"),
        validation=validation.out("validation"),
    )
    return validation, train


def wan21_t2v_lora(mw, info: dict):
    g = mw.Graph(
        "wan21_t2v_lora",
        info,
        """\
## Wan 2.1 text-to-video LoRA (1.3B)

1. Put 10-40 short clips (mp4, webm, mov, gif), each with a same-name `.txt` caption, in
   `ComfyUI/input/my_motion_clips/` (still images may sit beside them). Load Dataset takes 33 frames of each
   at 16 fps (its `frames`, `fps`, `frame_extraction` inputs); the trigger word `ohwx` goes in front.
2. Models, as ComfyUI's Wan 2.1 template names them: `diffusion_models/wan2.1_t2v_1.3B_fp16.safetensors`,
   `text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors`, `vae/wan_2.1_vae.safetensors`.
3. Queue. Validation samples are 33-frame clips (animated WebP) every 250 steps, in the run folder and on the
   dashboard. The LoRA is written to `models/loras/kiln/my_motion.safetensors`.
""",
    )
    prompt = "ohwx, a red fox running through fresh snow"
    return wan_video_lora(mw, g, mw.WAN21_T2V, Video(), prompt=prompt, name="my_motion", start_image=False)


def wan22_ti2v_5b_lora(mw, info: dict):
    g = mw.Graph(
        "wan22_ti2v_5b_lora",
        info,
        """\
## Wan 2.2 TI2V 5B image-to-video LoRA

Clips with `.txt` captions in `input/my_i2v_clips/` (33 frames each, 24 fps). It trains as text-to-video: the
5B starts a clip from an image by its first latent frame alone, so the LoRA animates the start image of the
test (Wan22ImageToVideoLatent), which the validation samples start from too (Validation Settings' start_latent).
Models as ComfyUI's Wan 2.2 5B template names them.
""",
    )
    video = Video(width=832, height=480, fps=24.0, steps=20, cfg=5.0)
    prompt = "ohwx, the camera slowly pushes in as the subject turns and smiles"
    return wan_video_lora(mw, g, mw.WAN22_TI2V, video, prompt=prompt, name="my_i2v", start_image=True)


def wan21_i2v_lora(mw, info: dict):
    """Wan 2.1 I2V 14B: CLIP Vision Loader into Encode Images (each clip's start frame cached with its CLIP vision
    states), and the validation samples and the test clip drawn from one start image through WanImageToVideo (CLIP
    Vision Encode, crop none, as ComfyUI's Wan 2.1 image-to-video template)."""
    g = mw.Graph(
        "wan21_i2v_lora",
        info,
        """\
## Wan 2.1 image-to-video LoRA (I2V 14B, CLIP vision)

1. Clips with `.txt` captions in `input/my_i2v14b_clips/` (33 frames each, 16 fps). Each clip trains from its
   first frame as the start image, which Encode Images also reads through CLIP vision (`clip_vision_h`).
2. Models as ComfyUI's Wan 2.1 image-to-video template names them: `wan2.1_i2v_480p_14B_fp16.safetensors`,
   `umt5_xxl_fp8_e4m3fn_scaled.safetensors`, `wan_2.1_vae.safetensors`, `clip_vision/clip_vision_h.safetensors`.
3. Put your test image in Load Image: the validation samples (every 250 steps) and the test clip after training
   start from it (WanImageToVideo, its positive and negative into Validation Settings).
""",
    )
    video = Video(steps=20)
    files = mw.WAN21_I2V
    loaders = mw.model_loaders(g, files)
    unet, clip, vae = loaders
    vision = g.add("CLIPVisionLoader", clip_name=files["clip_vision"])
    load = g.add(
        "KilnLoadDataset",
        folder="my_i2v14b_clips",
        trigger_word="ohwx",
        resolutions="480",
        frames=video.frames,
        fps=video.fps,
    )
    images = g.add(  # start_images on for the reader: a wired clip_vision encodes them whatever it says
        "KilnEncodeImages",
        dataset=load.out("dataset"),
        vae=vae.out("VAE"),
        start_images=True,
        clip_vision=vision.out("CLIP_VISION"),
    )
    captions = g.add("KilnEncodeCaptions", dataset=images.out("dataset"), clip=clip.out("CLIP"))
    options = mw.options_for(g, "concept", ema=True)
    text, negative = mw.prompts(g, clip, "ohwx, the subject turns towards the camera and smiles")
    first, encoded, i2v = start_image_conds(g, vision, vae, text, negative, video)
    positive, negative_i2v, latent = i2v.out("positive"), i2v.out("negative"), i2v.out("latent")
    validation, train = validated_training(
        g, video, unet.out("MODEL"), captions.out("dataset"), options, vae, positive=positive, negative=negative_i2v
    )
    save = g.add("KilnSaveLoRA", lora=train.out("lora"), name="kiln/my_i2v14b", state=train.out("state"))
    sampler, decode, clip_out = test_clip(mw, g, video, train, positive, negative_i2v, latent, "my_i2v14b")
    fold = mw.fold
    g.layout = [
        g.box("1. Models", "models", 0, [*loaders, vision]),
        g.box("2. Dataset", "dataset", 1, [load, fold(images), fold(captions)]),
        g.box("3. Train", "train", 2, [fold(options), train]),
        g.box("4. Save", "save", 3, [save]),
        g.box(
            "5. Test",
            "test",
            0,
            [first],
            [text, fold(negative)],
            [*map(fold, (encoded, i2v, validation, sampler, decode))],
        ),
        g.box("6. Test clip", "test", 3, [clip_out]),
        g.box(None, "", 3, [mw.NOTE]),
    ]
    return g


def start_image_conds(g, vision, vae, positive, negative, video: Video) -> list:
    """Load Image → CLIP Vision Encode (crop none) → WanImageToVideo with the prompt's conds, as ComfyUI's Wan 2.1
    image-to-video template wires them: [Load Image, CLIP Vision Encode, WanImageToVideo]."""
    first = g.add("LoadImage", title="Start image", image="example.png")
    encoded = g.add("CLIPVisionEncode", clip_vision=vision.out("CLIP_VISION"), image=first.out("IMAGE"), crop="none")
    i2v = g.add(
        "WanImageToVideo",
        positive=positive.out("CONDITIONING"),
        negative=negative.out("CONDITIONING"),
        vae=vae.out("VAE"),
        width=video.width,
        height=video.height,
        length=video.frames,
        batch_size=1,
        clip_vision_output=encoded.out("CLIP_VISION_OUTPUT"),
        start_image=first.out("IMAGE"),
    )
    return [first, encoded, i2v]
