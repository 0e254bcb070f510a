"""Kiln Caption Images in a real ComfyUI (COMFYUI_PATH): the comfyui_clip engine with ComfyUI's own
Qwen2.5-VL tokenizer and a stand-in generate (a real VL model is too large to build in a test), a real
text-only CLIP refused, the transformers engine on a tiny Florence-2 from models/LLM/, the stop button."""

from __future__ import annotations

import functools
import inspect
import math
import zlib
from pathlib import Path

from helpers import comfy_env
import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()

import comfy.model_management as mm  # noqa: E402
import comfy.sd  # noqa: E402
import folder_paths  # noqa: E402
from helpers import tiny_comfy as tc  # noqa: E402
from comfy.text_encoders.qwen_image import QwenImageTokenizer  # noqa: E402

import kiln_pack.nodes.dataset_nodes as dn

ANSWER = "A red square on a white background."


@pytest.fixture(scope="module")
def comfy_input(tmp_path_factory):
    root = tmp_path_factory.mktemp("comfy_caption")
    (root / "input").mkdir()
    folder_paths.set_input_directory(str(root / "input"))
    return root / "input"


def dataset(folder: Path, names="abc") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        Image.fromarray(rng.integers(0, 255, (72, 80, 3), dtype=np.uint8)).save(folder / f"{name}.png")
    return folder


class VisionClip:
    """A CLIP as the node sees it: ComfyUI's own Qwen2.5-VL tokenizer (Qwen-Image's text encoder, which puts
    the image into the tokens) and decode; generate stands in for the 7B model with CLIP.generate's signature
    of this ComfyUI, returns ANSWER's ids and records what it was given."""

    def __init__(self, on_generate=None):
        self.tokenizer = QwenImageTokenizer()
        self.calls: list[dict] = []
        self.on_generate = on_generate

    def tokenize(self, text, return_word_ids=False, **kwargs):
        return self.tokenizer.tokenize_with_weights(text, return_word_ids, **kwargs)

    @functools.wraps(comfy.sd.CLIP.generate)
    def generate(self, tokens, **kwargs):
        self.calls.append({"tokens": tokens, **kwargs})
        if self.on_generate:
            self.on_generate(len(self.calls))
        return self.tokenizer.qwen25_7b.tokenizer(ANSWER)["input_ids"]

    def decode(self, token_ids, skip_special_tokens=True):
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def run(folder, engine="comfyui_clip", **kwargs):
    args = {"style": "short", "prompt": "", "trigger_word": "zkw", "overwrite": False, "max_tokens": 64, "seed": 3}
    return dn.KilnCaptionImages.execute(folder, engine, **{**args, **kwargs})


def test_comfyui_clip_engine_captions_with_the_image_in_the_tokens(comfy_input):
    folder = dataset(comfy_input / "vl_set")
    (folder / "b.txt").write_text("mine", encoding="utf-8")
    clip = VisionClip()
    result = run("vl_set", clip=clip)
    assert result.result[0] == "vl_set" and "2 captions written" in result.result[1]
    assert (folder / "a.txt").read_text(encoding="utf-8") == f"zkw, {ANSWER}\n"
    assert (folder / "b.txt").read_text(encoding="utf-8") == "mine"
    assert len(clip.calls) == 2
    call = clip.calls[0]
    accepted = set(inspect.signature(comfy.sd.CLIP.generate).parameters) - {"self", "tokens"}
    assert set(call) - {"tokens"} <= accepted  # only what this ComfyUI's generate takes
    assert ("presence_penalty" in call) == ("presence_penalty" in accepted)
    assert call["max_length"] == 64 and call["seed"] == 3 and call["do_sample"] is True
    images = [t[0]["data"] for t in call["tokens"]["qwen25_7b"][0] if isinstance(t[0], dict)]
    assert len(images) == 1 and tuple(images[0].shape) == (1, 72, 80, 3)  # the image itself, [1,H,W,3]
    text = clip.decode([t[0] for t in call["tokens"]["qwen25_7b"][0] if not isinstance(t[0], dict)])
    assert "one-sentence caption" in text  # the style's prompt
    again = run("vl_set", clip=VisionClip())
    assert "0 captions written" in again.result[1] and "3 image(s) already captioned" in again.result[1]


def test_a_text_only_clip_is_refused_with_the_fix(comfy_input):
    dataset(comfy_input / "text_only")
    with pytest.raises(ValueError, match="cannot see images.*Load CLIP"):
        run("text_only", clip=tc.tiny_zimage_clip())  # ComfyUI's real Z-Image text encoder (Qwen3), tiny
    with pytest.raises(ValueError, match="needs a vision-language text encoder"):
        run("text_only")
    assert not list((comfy_input / "text_only").glob("*.txt"))


def test_the_stop_button_keeps_finished_captions_and_a_rerun_continues(comfy_input):
    folder = dataset(comfy_input / "stopped", names="abcd")

    def stop_after_second(count):
        if count == 2:
            mm.interrupt_current_processing(True)  # the stop button, pressed while b.png is captioned

    try:
        with pytest.raises(mm.InterruptProcessingException):
            run("stopped", clip=VisionClip(on_generate=stop_after_second))
    finally:
        mm.interrupt_current_processing(False)
    assert sorted(p.name for p in folder.glob("*.txt")) == ["a.txt", "b.txt"]
    clip = VisionClip()
    assert "2 captions written" in run("stopped", clip=clip).result[1] and len(clip.calls) == 2
    assert sorted(p.name for p in folder.glob("*.txt")) == ["a.txt", "b.txt", "c.txt", "d.txt"]


def test_transformers_engine_lists_and_uses_models_in_models_llm(comfy_input, tiny_florence, monkeypatch):
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "LLM", ([str(tiny_florence.parent)], set()))
    schema = dn.KilnCaptionImages.define_schema()
    model = next(i for i in schema.inputs if i.id == "model")
    assert model.options == ["Florence-2-tiny"]
    folder = dataset(comfy_input / "florence_set", names="ab")
    result = run("florence_set", engine="transformers", model="Florence-2-tiny", max_tokens=8)
    assert "Florence-2 takes task tokens" in result.result[1] and "2 captions written" in result.result[1]
    for name in "ab":
        assert (folder / f"{name}.txt").read_text(encoding="utf-8").startswith("zkw, ")
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "LLM", ([str(comfy_input / "nothing")], set()))
    assert dn.caption_models() == [dn.NO_MODEL]
    with pytest.raises(ValueError, match="models/LLM/"):
        run("florence_set", engine="transformers", model=dn.NO_MODEL, overwrite=True)


def test_only_captions_the_selection_and_always_runs(comfy_input):
    """The editor's 'Caption selected': `only` (the node's last input) restricts the run; a selection is run
    whenever queued (fingerprint NaN), a whole folder only when its files change."""
    folder = dataset(comfy_input / "selected_set", names="abc")
    result = run("selected_set", clip=VisionClip(), only="b.png\n c.png \n")
    assert "2 captions written" in result.result[1]
    assert sorted(p.name for p in folder.glob("*.txt")) == ["b.txt", "c.txt"]
    assert math.isnan(dn.KilnCaptionImages.fingerprint_inputs("selected_set", only="b.png"))
    assert dn.KilnCaptionImages.fingerprint_inputs("selected_set", only="") == dn.KilnCaptionImages.fingerprint_inputs(
        "selected_set"
    )
    with pytest.raises(ValueError, match="Kiln Caption Images: .*no image gone.png"):
        run("selected_set", clip=VisionClip(), only="gone.png")
    schema = dn.KilnCaptionImages.define_schema()
    assert schema.inputs[-1].id == "only" and schema.inputs[-1].optional
