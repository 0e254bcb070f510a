"""Captioning models from transformers, read from a local folder (nothing is downloaded, no model code
from the folder is run): Florence-2, and any model that transformers' AutoModelForImageTextToText loads
(BLIP, LLaVA/JoyCaption, Qwen2.5-VL, ...), saved as `save_pretrained` writes it.

transformers is optional (ComfyUI already has it; headless: `pip install "kiln-lora[caption]"`) and is
imported here only when a model is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from .jobs import Captioner

# ComfyUI's models/LLM/: where the captioning packs users have keep their models (kijai's
# ComfyUI-Florence2: models/LLM/Florence-2-base; ComfyUI-QwenVL: models/LLM/Qwen-VL/<model>).
MODELS_FOLDER = "LLM"
INSTALL = 'pip install -U "transformers>=5" (or: pip install "kiln-lora[caption]")'
WHERE = (
    f"put a transformers model folder (config.json, the weights, the processor files) in ComfyUI's "
    f"models/{MODELS_FOLDER}/, e.g. models/{MODELS_FOLDER}/Florence-2-base from the Hugging Face repository "
    "florence-community/Florence-2-base"
)

# Florence-2 takes task tokens, not free prompts; a prompt that is one of these is used as it is.
FLORENCE_TASKS = {"short": "<CAPTION>", "detailed": "<MORE_DETAILED_CAPTION>"}
FLORENCE_TOKENS = ("<CAPTION>", "<DETAILED_CAPTION>", "<MORE_DETAILED_CAPTION>", "<OCR>")


class MissingDependency(RuntimeError):
    """An optional package is not installed; the message says how to install it."""


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise MissingDependency(
            f"the transformers captioner needs the transformers package, which is not installed here: {INSTALL}"
        ) from err
    if int(transformers.__version__.split(".")[0]) < 5:  # Florence-2 and the loading API used here
        raise MissingDependency(
            f"the transformers captioner needs transformers 5 or newer, this is {transformers.__version__}: {INSTALL}"
        )
    return transformers


def list_models(roots: Sequence[str | Path]) -> list[str]:
    """Model folders (a config.json inside) directly under each root or one level deeper, as names
    relative to their root ('Florence-2-base', 'Qwen-VL/Qwen2.5-VL-3B-Instruct'), sorted."""
    found = set()
    for root in map(Path, roots):
        for config in [*root.glob("*/config.json"), *root.glob("*/*/config.json")]:
            if not any(part.startswith(".") for part in config.relative_to(root).parts):
                found.add(config.parent.relative_to(root).as_posix())
    return sorted(found)


def resolve_model(name: str, roots: Sequence[str | Path]) -> Path:
    """A name from list_models (under one of roots) or a folder path → the model folder."""
    text = (name or "").strip()
    candidates = (
        [Path(text).expanduser()]
        if Path(text).expanduser().is_absolute()
        else [Path(root) / text for root in roots] + [Path(text)]
    )
    for folder in candidates:
        if text and (folder / "config.json").is_file():
            return folder
    if not text:
        raise ValueError(f"no captioning model chosen: {WHERE}")
    raise ValueError(
        f"{text}: no model folder with a config.json there (looked in {', '.join(str(c) for c in candidates)}); {WHERE}"
    )


def _florence_prompt(processor, prompt: str, style: str):
    return prompt.strip() if prompt.strip() in FLORENCE_TOKENS else FLORENCE_TASKS[style]


def _chat_prompt(processor, prompt: str, style: str):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _no_prompt(processor, prompt: str, style: str):
    return None


# How a model family takes the prompt, by config.model_type; others: a chat template if the
# processor has one, else no prompt (BLIP-style captioners caption the image alone).
PROMPT_FORMS: dict[str, Callable] = {"florence2": _florence_prompt}
PROMPT_NOTES = {
    _florence_prompt: "Florence-2 takes task tokens, not free prompts: {task} is used (a prompt of "
    f"{', '.join(FLORENCE_TOKENS)} is used as it is)",
    _no_prompt: "{model} takes no prompt: it captions the image alone; the prompt is not used",
}


def transformers_captioner(
    model_dir: str | Path, *, style: str = "short", max_tokens: int = 256, seed: int = 0, device: str | None = None
) -> Captioner:
    """caption(image, prompt) -> str from the model in `model_dir`; the function's `note` says how the
    model takes the prompt. Each image is generated with the same seed (a resumed run writes what an
    uninterrupted one would)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be 1 or more, got {max_tokens}")
    transformers = _transformers()
    import torch

    folder = Path(model_dir)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if str(device).startswith("cuda") and torch.cuda.is_bf16_supported() else torch.float32
    processor, model = _load(transformers, folder, dtype)
    model.to(device).eval()
    kind = getattr(model.config, "model_type", "")
    form = PROMPT_FORMS.get(kind) or (_chat_prompt if getattr(processor, "chat_template", None) else _no_prompt)
    if form is _florence_prompt and style not in FLORENCE_TASKS:
        raise ValueError(
            f"{folder.name}: Florence-2 writes sentences, not tags: choose style "
            f"{' or '.join(FLORENCE_TASKS)}, or a chat model (Qwen2.5-VL, JoyCaption) for tags"
        )
    strip_prompt = not getattr(model.config, "is_encoder_decoder", False)

    def caption(image, prompt: str) -> str:
        text = form(processor, prompt, style)
        inputs = processor(images=image, return_tensors="pt", **({"text": text} if text is not None else {}))
        inputs = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in inputs.items()}
        torch.manual_seed(seed)
        with torch.inference_mode():
            ids = model.generate(**inputs, max_new_tokens=max_tokens)
        if strip_prompt and "input_ids" in inputs:
            ids = ids[:, inputs["input_ids"].shape[1] :]  # decoder-only models repeat the prompt first
        return processor.batch_decode(ids, skip_special_tokens=True)[0]

    task = FLORENCE_TASKS.get(style, "") if form is _florence_prompt else ""
    caption.note = PROMPT_NOTES.get(form, "").format(task=task, model=f"{folder.name} ({kind})")
    return caption


def _load(transformers, folder: Path, dtype):
    """(processor, model) from the folder, every weight accounted for."""
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: not a transformers model folder (no config.json); {WHERE}")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    refused = (
        "this model folder ships its own model code (auto_map in config.json), which Kiln does not run; "
        "use the transformers-native version of the model (Florence-2: florence-community/Florence-2-base "
        "or -large, not microsoft/Florence-2-*)"
    )
    try:
        processor = transformers.AutoProcessor.from_pretrained(folder, local_files_only=True)
        model, info = transformers.AutoModelForImageTextToText.from_pretrained(
            folder, local_files_only=True, output_loading_info=True, dtype=dtype
        )
    except (ValueError, OSError, KeyError, TypeError) as err:
        why = refused if "auto_map" in config else f"transformers cannot load it as an image-to-text model ({err})"
        raise ValueError(f"{folder}: {why}") from err
    missing = sorted(map(str, [*(info.get("missing_keys") or []), *(info.get("mismatched_keys") or [])]))
    if missing:
        raise ValueError(
            f"{folder}: {len(missing)} weights missing or of the wrong shape for "
            f"{type(model).__name__} (e.g. {missing[0]}): the captions would be noise. "
            + (refused if "auto_map" in config else "re-download the model folder")
        )
    return processor, model
