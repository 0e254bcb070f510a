"""Tiny models and data built in the tests: nothing is downloaded, everything runs on CPU in seconds.

`--comfyui without|only` splits the suite: a test file that calls `comfy_env.require_comfy()` needs
ComfyUI, the rest is the library. ./scripts/test runs the library once and the ComfyUI files once per
ComfyUI tree, each in that tree's own Python environment.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Shared test helpers (lora_fixtures, tiny_runs) import by module name, in the library and the node tests alike.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_runs import tiny_config, tiny_data, tiny_model


@pytest.fixture(autouse=True)
def _compile_cache_in_tmp(monkeypatch, tmp_path_factory):
    """Compiled blocks set up in a test cache into a temporary folder, never the developer's ~/.cache:
    checkpointing.keep_compiled leaves a TORCHINDUCTOR_CACHE_DIR set to anything but inductor's default (which
    importing torch._dynamo has already written into it), and monkeypatch undoes what a test changes."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "inductor"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)


@pytest.fixture
def make_model():
    return tiny_model


@pytest.fixture
def make_data():
    return tiny_data


@pytest.fixture
def make_config():
    return tiny_config


# ---------------------------------------------------------------- a tiny captioner

def write_tiny_florence(folder: Path, *, seed: int = 0) -> Path:
    """A random Florence-2 (transformers' native class) saved as a model folder under models/LLM/ holds one:
    weights, config, generation config, processor and a byte-level BPE tokenizer of 26 letters and the
    space, so its captions are lower-case words. Built from configs; nothing downloaded."""
    import torch
    from transformers import (
        BartConfig,
        BartTokenizer,
        CLIPImageProcessor,
        Florence2Config,
        Florence2ForConditionalGeneration,
        Florence2Processor,
        Florence2VisionConfig,
    )

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    vocab = {token: i for i, token in enumerate(specials + list("abcdefghijklmnopqrstuvwxyz") + ["Ġ"])}
    tokenizer = BartTokenizer(vocab=vocab, merges=[], extra_special_tokens={"image_token": "<image>"})
    vision = Florence2VisionConfig(depths=(1, 1), patch_size=(7, 3), patch_stride=(4, 2), patch_padding=(3, 1),
                                   patch_prenorm=(False, True), embed_dim=(16, 32), num_heads=(1, 2), num_groups=(1, 2),
                                   window_size=2, projection_dim=32, max_position_embeddings=8, drop_path_rate=0.0)
    text = BartConfig(vocab_size=len(tokenizer), d_model=32, encoder_layers=1, decoder_layers=1,
                      encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                      max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      decoder_start_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = Florence2ForConditionalGeneration(
        Florence2Config(vision_config=vision, text_config=text, image_token_id=tokenizer.image_token_id))
    # a random model may stop at once or pick special tokens: at least 4 letters or spaces
    model.generation_config.min_new_tokens = 4
    model.generation_config.suppress_tokens = [vocab[t] for t in specials if t != "</s>"] + [tokenizer.image_token_id]
    # 32 px images: (32/4/2)² = 16 patches + 1 pooled token
    images = CLIPImageProcessor(size={"height": 32, "width": 32}, do_center_crop=False, image_seq_length=17)
    model.save_pretrained(folder)
    Florence2Processor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_florence(tmp_path_factory) -> Path:
    pytest.importorskip("transformers", reason="the transformers captioner's tests need transformers "
                        "(pip install -e '.[test]')")
    return write_tiny_florence(tmp_path_factory.mktemp("models") / "LLM" / "Florence-2-tiny")


# ---------------------------------------------------------------- the library / ComfyUI split

COMFYUI_CALL = "comfy_env.require_comfy()"


def pytest_configure(config):
    """In CI a test never skips for a missing optional package (MLX, diffusers, peft, tensorboard, wandb,
    transformers, aiohttp): ./scripts/test installs them all, so a skip there means an install step is missing."""
    import comfy_env

    if not comfy_env.required():
        return
    skip_when_missing = pytest.importorskip

    def importorskip(modname, *args, **kwargs):
        try:
            return skip_when_missing(modname, *args, **kwargs)
        except pytest.skip.Exception as skipped:
            pytest.fail(f"CI: {modname} is missing here ({skipped}); ./scripts/test installs it (pip install -e "
                        "'.[test]', and mlx[cpu] off Apple Silicon)", pytrace=False)

    pytest.importorskip = importorskip


def pytest_addoption(parser):
    parser.addoption("--comfyui", choices=("with", "without", "only"), default="with",
                     help="with: every test (ComfyUI tests skip without COMFYUI_PATH); without: only the tests that "
                          "need no ComfyUI; only: only those that do (test files calling comfy_env.require_comfy())")


def needs_comfyui(path: Path) -> bool:
    return path.suffix == ".py" and path.name.startswith("test_") and COMFYUI_CALL in path.read_text(encoding="utf-8")


def pytest_ignore_collect(collection_path: Path, config):
    part = config.getoption("--comfyui")
    if part == "with" or not collection_path.is_file() or not collection_path.name.startswith("test_"):
        return None
    return True if needs_comfyui(collection_path) != (part == "only") else None
