"""A tiny random Florence-2 captioner written as a model folder (the `tiny_florence` fixture, tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path


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
    vision = Florence2VisionConfig(
        depths=(1, 1),
        patch_size=(7, 3),
        patch_stride=(4, 2),
        patch_padding=(3, 1),
        patch_prenorm=(False, True),
        embed_dim=(16, 32),
        num_heads=(1, 2),
        num_groups=(1, 2),
        window_size=2,
        projection_dim=32,
        max_position_embeddings=8,
        drop_path_rate=0.0,
    )
    text = BartConfig(
        vocab_size=len(tokenizer),
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Florence2ForConditionalGeneration(
        Florence2Config(vision_config=vision, text_config=text, image_token_id=tokenizer.image_token_id)
    )
    # a random model may stop at once or pick special tokens: at least 4 letters or spaces
    model.generation_config.min_new_tokens = 4
    model.generation_config.suppress_tokens = [vocab[t] for t in specials if t != "</s>"] + [tokenizer.image_token_id]
    # 32 px images: (32/4/2)² = 16 patches + 1 pooled token
    images = CLIPImageProcessor(size={"height": 32, "width": 32}, do_center_crop=False, image_seq_length=17)
    model.save_pretrained(folder)
    Florence2Processor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
    return folder
