"""trainer/estimate/torch_step.py and estimate_common.py: full-size dims, parameter counts, header detection, the memory model."""

import subprocess
import sys

import pytest

from trainer.archs import get_arch, qwen_image
from trainer.archs.layout import ModelDims
from trainer.estimate.common import (
    GIB,
    VARIANTS,
    format_estimate,
    linear_layers,
    param_count,
    variant_from_header,
)
from trainer.estimate.torch_step import estimate

# Published sizes. Klein 4B's "4B" rounds 3.88B up: its bf16 checkpoint is ~7.75 GB, and
# ComfyUI's own module holds 3,875,544,576 parameters (3.1% under 4.0B), hence 3.5% there.
# Qwen-Image's model card says "a 20B MMDiT"; its module holds 20.43B (2.2 % over).
PUBLISHED = {
    "flux2-klein-4b": (4.0e9, 0.035),
    "flux2-klein-9b": (9.0e9, 0.03),
    "flux2-dev": (32.0e9, 0.03),
    "zimage": (6.15e9, 0.03),
    "qwen-image": (20.0e9, 0.03),
    "wan2.1-i2v-14b": (16.4e9, 0.03),  # "14B": 14B of T2V plus the image cross-attention and img_emb
    "wan2.1-t2v-1.3b": (1.3e9, 0.1),
    "wan2.1-t2v-14b": (14.0e9, 0.03),
    "wan2.2-ti2v-5b": (5.0e9, 0.03),
    "chroma": (8.9e9, 0.01),
    "lumina2": (2.6e9, 0.01),  # Lumina Image 2.0: "2.6B"
}

# Exact counts of ComfyUI 0.17's Flux / NextDiT / QwenImageTransformer2DModel modules built on the
# meta device from the config model_detection.py sets for each checkpoint (checked when this file
# was written; Qwen-Image's also on 0.33, the same).
COMFYUI_COUNTS = {
    "flux2-klein-4b": 3_875_544_576,
    "flux2-klein-9b": 9_078_581_248,
    "flux2-dev": 32_223_281_152,
    "zimage": 6_154_908_736,
    "qwen-image": 20_430_401_088,
    "wan2.1-i2v-14b": 16_394_878_784,  # comfy.ldm.wan.model.WanModel on the meta device
    "wan2.1-t2v-1.3b": 1_418_996_800,
    "wan2.1-t2v-14b": 14_288_491_584,
    "wan2.2-ti2v-5b": 4_999_787_712,
    "chroma": 8_899_983_424,  # comfy.ldm.chroma.model.Chroma, model_detection.py's Chroma config (0.17)
    "lumina2": 2_609_769_152,  # NextDiT, the `dim == 2304` config (0.17)
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_param_count_matches_published_size(variant):
    published, tolerance = PUBLISHED[variant]
    assert param_count(VARIANTS[variant]) == pytest.approx(published, rel=tolerance)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_param_count_matches_comfyui_module(variant):
    assert param_count(VARIANTS[variant]) == COMFYUI_COUNTS[variant]


def test_linear_shapes_follow_comfyui():
    klein = linear_layers(VARIANTS["flux2-klein-4b"])
    assert klein["double_blocks.0.img_attn.qkv"] == (3072, 9216)
    assert klein["double_blocks.4.txt_mlp.0"] == (3072, 2 * 9216)  # gated: gate | up
    assert klein["single_blocks.19.linear1"] == (3072, 3 * 3072 + 2 * 9216)
    assert klein["single_blocks.0.linear2"] == (3072 + 9216, 3072)
    assert klein["txt_in"] == (7680, 3072) and "guidance_in.in_layer" not in klein
    assert len(klein) == 5 * 8 + 20 * 2 + 9
    assert "guidance_in.in_layer" in linear_layers(VARIANTS["flux2-dev"])
    zimage = linear_layers(VARIANTS["zimage"])
    assert zimage["layers.29.feed_forward.w1"] == (3840, 10240)
    assert zimage["noise_refiner.1.adaLN_modulation.0"] == (256, 4 * 3840)
    assert "context_refiner.0.adaLN_modulation.0" not in zimage  # context refiner is unmodulated
    assert zimage["cap_embedder.1"] == (2560, 3840)


def header(variant, prefix=""):
    return {f"{prefix}{name}.weight": [out, inp] for name, (inp, out) in linear_layers(VARIANTS[variant]).items()}


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_from_header(variant, prefix):
    shapes = header(variant, prefix)
    shapes["__metadata__"] = {"format": "pt"}  # a raw safetensors header carries this; it is skipped
    assert variant_from_header(shapes) == variant


def test_header_of_another_model_is_rejected():
    flux1 = {"double_blocks.0.img_attn.qkv.weight": [9216, 3072], "img_in.weight": [3072, 64]}
    with pytest.raises(ValueError, match="not a Flux2 or Z-Image"):
        variant_from_header(flux1)
    small = {k: v for k, v in header("flux2-klein-4b").items() if not k.startswith("single_blocks.19.")}
    with pytest.raises(ValueError, match="flux2-klein-9b"):  # 19 single blocks: no known variant; lists them
        variant_from_header(small)


def test_unknown_variant_lists_variants():
    with pytest.raises(ValueError) as err:
        estimate("flux3", resolution=1024)
    assert all(name in str(err.value) for name in VARIANTS)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("resolution", [512, 1024])
def test_checkpointing_lowers_activations(variant, resolution):
    on = estimate(variant, resolution=resolution, gradient_checkpointing=True)
    off = estimate(variant, resolution=resolution, gradient_checkpointing=False)
    assert on.activations * 4 < off.activations
    assert on.total < off.total and on.weights == off.weights


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_activations_grow_linearly_in_tokens(variant):
    # SDPA/flash keeps no T x T matrix, so bytes per token stay put as the image grows.
    small, large = (estimate(variant, resolution=r, gradient_checkpointing=False) for r in (1024, 2048))
    assert large.tokens >= 3 * small.tokens  # 4x the image tokens, the same caption (Wan 2.2 5B: exactly 3x)
    assert large.activations / small.activations == pytest.approx(large.tokens / small.tokens, rel=0.05)
    batched = estimate(variant, resolution=1024, batch_size=2, gradient_checkpointing=False)
    assert batched.activations == 2 * small.activations and batched.tokens == 2 * small.tokens


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "prodigy"])
def test_rank_doubles_lora_bytes(optimizer):
    r16, r32 = (estimate("zimage", resolution=512, rank=rank, optimizer=optimizer) for rank in (16, 32))
    assert r32.lora_params == 2 * r16.lora_params
    assert (r32.lora, r32.gradients, r32.optimizer) == (2 * r16.lora, 2 * r16.gradients, 2 * r16.optimizer)


def test_lora_params_follow_targets():
    rank, klein = 32, linear_layers(VARIANTS["flux2-klein-4b"])
    qkv_only = estimate("flux2-klein-4b", resolution=512, rank=rank, targets=("img_attn.qkv",))
    assert qkv_only.lora_params == 5 * rank * (3072 + 9216)
    default = estimate("flux2-klein-4b", resolution=512, rank=rank)
    blocks = [shape for name, shape in klein.items() if name.startswith(("double_blocks.", "single_blocks."))]
    assert default.lora_params == sum(rank * (i + o) for i, o in blocks)  # arch defaults: every block Linear
    regex = estimate("flux2-klein-4b", resolution=512, rank=rank, targets=(r"re:single_blocks\.0\.linear[12]",))
    assert regex.lora_params == rank * (3072 + 27648 + 12288 + 3072)
    with pytest.raises(ValueError, match="img_attn.qvk"):
        estimate("flux2-klein-4b", resolution=512, targets=("img_attn.qvk",))


def test_optimizer_and_dtype_bytes():
    adamw, adam8, prodigy, adafactor = (
        estimate("flux2-klein-9b", resolution=512, optimizer=o) for o in ("adamw", "adamw8bit", "prodigy", "adafactor")
    )
    assert adamw.optimizer == 8 * adamw.lora_params == 4 * adam8.optimizer
    assert prodigy.optimizer == 2 * adamw.optimizer
    assert 0 < adafactor.optimizer < adamw.optimizer / 20  # factored: rows + cols per matrix
    lion, came, free, ao8 = (
        estimate("flux2-klein-9b", resolution=512, optimizer=o)
        for o in ("lion", "came", "schedulefree", "adamw8bit_torchao")
    )
    assert 2 * lion.optimizer == free.optimizer == adamw.optimizer and ao8.optimizer == adam8.optimizer
    assert lion.optimizer + 2 * adafactor.optimizer == came.optimizer  # its moment, two factored statistics
    fp8 = estimate("flux2-klein-9b", resolution=512, base_dtype="fp8")
    assert 2 * fp8.weights == adamw.weights == 2 * param_count(VARIANTS["flux2-klein-9b"])
    fp32 = estimate("flux2-klein-9b", resolution=512, mixed_precision="no")
    assert fp32.activations > adamw.activations
    for bad in ({"optimizer": "sgd"}, {"base_dtype": "int4"}, {"resolution": 1000}, {"rank": 0}):
        with pytest.raises(ValueError):
            estimate("flux2-klein-9b", **{"resolution": 512, **bad})


def test_tokens_per_family():
    assert estimate("flux2-klein-4b", resolution=1024).tokens == 64 * 64 + 512
    assert estimate("zimage", resolution=1024).tokens == 64 * 64 + 512
    assert estimate("zimage", resolution=16 * 33).tokens == 1120 + 512  # 33² = 1089 padded to 32s


def test_format_estimate_says_fit_or_not():
    est = estimate("flux2-klein-4b", resolution=1024, gradient_checkpointing=False)
    table = format_estimate(est)
    assert "weights" in table and "activations" in table and "total" in table and "fit" not in table
    assert "fits in 80 GiB" in format_estimate(est, device_memory_gb=80)
    advice = format_estimate(est, device_memory_gb=12)
    assert "does not fit in 12 GiB" in advice and "gradient checkpointing on" in advice
    assert advice.rstrip().endswith("(fits)")
    hopeless = format_estimate(estimate("flux2-dev", resolution=1024), device_memory_gb=8)
    assert "still too large" in hopeless
    assert f"{est.total / GIB:.2f}" in table


def test_estimate_imports_no_torch():
    code = "import sys, trainer.estimate.torch_step; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_every_counted_variant_is_estimated():
    assert set(VARIANTS) == set(COMFYUI_COUNTS)  # VARIANTS comes from the registered archs' layouts


def test_qwen_image_layout_follows_comfyui():
    """The layout alone, against ComfyUI's module: runs before (and after) its arch is registered."""
    dims = qwen_image.LAYOUT.variants[0]
    layers = qwen_image.linear_layers(dims, 16 * 2**2)  # Wan 2.1 latents: 16 channels, patch 2
    assert layers["transformer_blocks.59.img_mod.1"] == (3072, 6 * 3072)
    assert layers["transformer_blocks.0.txt_mlp.net.0.proj"] == (3072, 4 * 3072)  # GELU, no gate
    assert layers["transformer_blocks.7.attn.add_k_proj"] == (3072, 3072)
    assert layers["txt_in"] == (3584, 3072) and layers["proj_out"] == (3072, 64)
    assert len(layers) == 60 * 14 + 6
    params = sum(i * o for i, o in layers.values()) + qwen_image.extra_params(dims, layers)
    assert params == COMFYUI_COUNTS["qwen-image"]


def test_each_variant_is_listed_by_its_own_arch_layout():
    for name, dims in VARIANTS.items():
        assert dims in get_arch(dims.arch).layout.variants, name


def test_an_arch_without_layout_names_the_fix():
    demo = ModelDims("demo-size", "demo", 64, 1, 1, 1, 128, 32, 8)
    with pytest.raises(ValueError, match="arch 'demo' has no Layout"):
        estimate(demo, resolution=512)


def test_the_two_estimates_share_a_module_and_import_neither_other():
    code = (
        "import sys, trainer.estimate.mlx_step; assert 'trainer.estimate.torch_step' not in sys.modules; "
        "del sys.modules['trainer.estimate.mlx_step']; import trainer.estimate.torch_step; "
        "assert 'trainer.estimate.mlx_step' not in sys.modules"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_arch_names_and_variant_names_are_one_vocabulary():
    from trainer.estimate.common import arch_variants, resolve_variant

    assert resolve_variant("flux2_klein") == ["flux2-klein-4b", "flux2-klein-9b"]  # smallest first
    assert [resolve_variant(a) for a in ("zimage_turbo", "zimage", "flux2_dev", "qwen_image")] == [
        ["zimage"],
        ["zimage"],
        ["flux2-dev"],
        ["qwen-image"],
    ]
    assert all(resolve_variant(v) == [v] for v in VARIANTS)
    assert arch_variants("demo") == []
    with pytest.raises(ValueError, match="unknown --variant 'demo'.*qwen-image.*zimage_turbo"):
        resolve_variant("demo")


def test_streamed_blocks_leave_the_gpu_and_a_ring_takes_their_place():
    from trainer.estimate.torch_step import block_weight_bytes, streamed_bytes
    from trainer.estimate.variants import get_dims

    dims = get_dims("zimage")
    sizes = block_weight_bytes(dims, "bf16")
    assert len(sizes) == 34  # 2 noise and 2 context refiners, 30 layers
    resident, streamed = (estimate("zimage", resolution=1024, stream_blocks=n) for n in (0, 34))
    moved, ring = streamed_bytes(dims, "bf16", 34)
    assert moved == sum(sizes) and ring == 3 * max(sizes)
    assert resident.weights - streamed.weights == moved - ring
    assert streamed.activations == resident.activations and "34 blocks streamed" in streamed.notes[-1]
    half, _ = streamed_bytes(dims, "bf16", 17)
    assert 0.4 * moved < half < 0.6 * moved


def test_advice_offers_the_fewest_streamed_blocks_that_fit_and_mlx_none():
    text = format_estimate(estimate("zimage", resolution=1024), device_memory_gb=12)
    last = text.splitlines()[-1]
    assert last.startswith("  or, every other setting kept: stream_blocks ") and last.endswith("(fits)")
    count = int(last.split("stream_blocks ")[1].split()[0])
    assert estimate("zimage", resolution=1024, stream_blocks=count).total <= 12 * GIB
    assert estimate("zimage", resolution=1024, stream_blocks=count - 1).total > 12 * GIB
    assert "fits in 24 GiB" in format_estimate(estimate("zimage", resolution=1024), device_memory_gb=24)
    from trainer.estimate.common import backend_rules

    on_a_mac = format_estimate(backend_rules("mlx").estimate("zimage", resolution=1024), device_memory_gb=8)
    assert "does not fit" in on_a_mac and "stream_blocks" not in on_a_mac  # a Mac's GPU shares the host's memory


def test_frames_count_a_clips_latent_frames():
    """Wan: 81 frames are 21 latent frames of (h/16)(w/16) tokens each; an image is one frame."""
    image = estimate("wan2.1-t2v-14b", resolution=480, gradient_checkpointing=False)
    clip = estimate("wan2.1-t2v-14b", resolution=480, frames=81, gradient_checkpointing=False)
    assert image.tokens == 30 * 30 + 512 and clip.tokens == 21 * 30 * 30 + 512
    assert clip.activations / image.activations == pytest.approx(clip.tokens / image.tokens, rel=0.01)
    assert clip.weights == image.weights and "× 81 frames" in format_estimate(clip)
    assert "frames" not in format_estimate(image)  # an image's report is as it was
    five_b = estimate("wan2.2-ti2v-5b", resolution=704, frames=121)  # /16 VAE x patch 2: 22 x 22 tokens a frame
    assert five_b.tokens == 31 * 22 * 22 + 512
    with pytest.raises(ValueError, match="4k\\+1"):
        estimate("wan2.1-t2v-14b", resolution=480, frames=80)
    with pytest.raises(ValueError, match="image model"):
        estimate("zimage", resolution=512, frames=5)


def test_wan21_i2v_counts_its_image_layers_and_clip_vision_tokens():
    """Wan 2.1 I2V: img_emb and each block's k_img/v_img in the weights and LoRA (default targets), and the start
    image's 257 CLIP vision tokens beside the caption's in the blocks' activations."""
    i2v = estimate("wan2.1-i2v-14b", resolution=480, frames=81, gradient_checkpointing=False)
    t2v = estimate("wan2.1-t2v-14b", resolution=480, frames=81, gradient_checkpointing=False)
    assert i2v.weights > t2v.weights and i2v.lora > t2v.lora
    per_block_tokens = 21 * 30 * 30 + 512
    assert i2v.activations / t2v.activations == pytest.approx((per_block_tokens + 257) / per_block_tokens, rel=0.01)
    assert "CLIP vision's 257" in format_estimate(i2v)


# ---------------------------------------------------------------- a full fine-tune (adapter full)


def test_a_full_fine_tune_counts_every_weight_its_gradient_optimizer_state_and_ema_by_hand():
    """Z-Image's weights (ComfyUI's module holds P): bf16 weights and gradients 2 B each, AdamW 8 B, EMA 4 B;
    the optimizer step's fp32 copies (6 B) and AdamW's temporary (4 B) for one chunk of weights (Prodigy: for
    all of them), where larger than the forward's."""
    from trainer.estimate.full_step import STEP_CHUNK_WEIGHTS, full_state
    from trainer.estimate.variants import get_dims, linear_layers

    p, dims = COMFYUI_COUNTS["zimage"], get_dims("zimage")
    est = estimate("zimage", resolution=1024, adapter="full", ema=True)
    assert (est.weights, est.lora, est.gradients, est.optimizer) == (2 * p, 4 * p, 2 * p, 8 * p)
    largest = max(i * o for i, o in linear_layers(dims).values())
    assert full_state(dims, "adamw", "bf16", True, 1)["step"] == 10 * (STEP_CHUNK_WEIGHTS + largest)
    assert est.total == 16 * p + est.activations + est.workspace and est.lora_params == p
    assert est.total < 18 * p  # the forward's activations and workspace outweigh one chunk's copies
    prodigy = estimate("zimage", resolution=1024, adapter="full", optimizer="prodigy")
    assert prodigy.workspace == 10 * p - prodigy.activations  # stepped whole: the step's transient is the larger
    assert full_state(dims, "adamw", "fp32", False, 1)["step"] == 4 * p  # fp32 weights: all at once, no copies
    assert estimate("zimage", resolution=1024, adapter="full").lora == 0  # EMA off
    assert estimate("zimage", resolution=1024, adapter="full", optimizer="adamw8bit").optimizer == 2 * p
    lora = estimate("zimage", resolution=1024)
    assert lora.activations == est.activations and lora.weights == 2 * p  # the same step, the base frozen
    text = format_estimate(est)
    assert "full fine-tune, adamw" in text and "EMA (fp32)" in text and "trained params (every weight) 6154.9 M" in text
    with pytest.raises(ValueError, match="adapter full trains the base weights"):
        estimate("zimage", resolution=1024, adapter="full", base_dtype="int8")


def test_under_shard_each_gpu_holds_a_share_and_the_gathered_block_with_its_buffer():
    from trainer.estimate.torch_step import block_weight_bytes
    from trainer.estimate.variants import get_dims

    p, block = COMFYUI_COUNTS["zimage"], max(block_weight_bytes(get_dims("zimage"), "bf16"))
    one = estimate("zimage", resolution=1024, adapter="full", ema=True)
    two = estimate("zimage", resolution=1024, adapter="full", ema=True, shards=2)
    assert (two.weights, two.lora, two.gradients, two.optimizer) == (p + 2 * block, 2 * p, p, 4 * p)
    assert two.activations == one.activations  # each rank its own rows
    lora, sharded = estimate("zimage", resolution=1024), estimate("zimage", resolution=1024, shards=4)
    assert sharded.weights == lora.weights // 4 + 2 * block and sharded.lora == lora.lora  # the LoRA stays whole


def test_a_sharded_base_too_large_for_its_share_is_told_its_shards_go_to_the_host(tmp_path, capsys):
    """Qwen-Image over two 24 GB cards: a rank's half of the base and the step do not fit, so the plan keeps some
    blocks' shards on the host (what the run's stream_blocks auto does beside sharding shard). A stream_blocks
    number and an fp8 base, both refused beside shard, are not offered."""
    from trainer.cli.main import main

    config = tmp_path / "qwen.toml"
    config.write_text('arch = "qwen_image"\nsharding = "shard"\nresolutions = [1024]\n')
    assert main(["estimate", str(config), "--processes", "2", "--memory-gb", "24"]) == 0
    out = capsys.readouterr().out
    assert "stream_blocks auto → " in out and "blocks' shards in pinned host memory" in out
    assert "over the 2 ranks" in out and "GB copied host→GPU a step on each GPU" in out
    assert "stream_blocks 1" not in out.replace("stream_blocks auto", "") and "base weights fp8" not in out


def test_the_estimate_command_reads_a_full_run_and_its_ranks(tmp_path, capsys):
    from trainer.cli.main import main

    config = tmp_path / "full.toml"
    config.write_text('arch = "zimage"\nadapter = "full"\nema = true\nsharding = "shard"\nresolutions = [1024]\n')
    assert main(["estimate", str(config), "--processes", "2", "--memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "each part 1/2 per GPU (sharding shard over 2 ranks)" in out and "fits in 80 GiB" in out
    assert "stream_blocks" not in out  # a full run streams nothing: no such advice
    with pytest.raises(SystemExit, match="torch backend only"):
        main(["estimate", str(config), "--backend", "mlx"])
