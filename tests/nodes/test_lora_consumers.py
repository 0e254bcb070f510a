"""Kiln's LoRA files in the tools that read them (#19): ComfyUI's LoraLoaderModelOnly, diffusers'
`pipe.load_lora_weights` (Flux2KleinPipeline, ZImagePipeline) and `transformer.load_lora_adapter`, and
Kiln's own reader, on tiny Flux2 Klein and Z-Image models.

diffusers' models are built from the tiny ComfyUI weights by diffusers' own single-file converters
(`convert_*_transformer_checkpoint_to_diffusers`, what `from_single_file` runs), loaded strictly. The truth
is the LoRA's definition, W + alpha/rank·B@A, on the weights Kiln's comfy file holds (bf16-rounded A and
B): in ComfyUI's model for ComfyUI and Kiln, and converted by diffusers' converter into diffusers' model for
diffusers. Each reader's output is compared with it relative to the LoRA's effect,
|out − truth| / |truth − base|: a LoRA applied at half strength scores 0.5, one not applied 1.0.
Every (format, reader) pair either matches within 1e-4 or fails the way README's table says it does.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from helpers import comfy_env
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()
pytest.importorskip(
    "diffusers", reason="needs diffusers (the `test` extra installs it): the real consumer of the diffusers export"
)
pytest.importorskip("peft", reason="needs peft (the `test` extra installs it): diffusers loads LoRAs through it")

import comfy.model_management as mm  # noqa: E402
import comfy.supported_models  # noqa: E402
import folder_paths  # noqa: E402
from helpers import tiny_comfy  # noqa: E402
from comfy.ldm.lumina.model import NextDiT  # noqa: E402
from diffusers import (  # noqa: E402
    Flux2KleinPipeline,
    Flux2Transformer2DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from diffusers.loaders import single_file_utils  # noqa: E402

import nodes  # noqa: E402
from trainer import archs  # noqa: E402
from trainer.lora import files as lf  # noqa: E402
from trainer.lora.files import LoraWeights  # noqa: E402
from trainer.lora.targets import select_targets  # noqa: E402

TOLERANCE = 1e-4  # relative to the LoRA's effect on the model output
FORMATS = list(lf.FORMATS)
READERS = ["comfyui", "kiln", "diffusers.load_lora_weights", "diffusers.load_lora_adapter"]

# What does not work, and why (README's table says the same). Every other pair matches within TOLERANCE.
FAILS: dict[tuple[str, str, str], str] = {
    # diffusers 0.42 reads a `diffusion_model.` file with lora_A/lora_B names only without `.alpha` keys:
    # its Flux2 converter (written for ai-toolkit's files) leaves every alpha unconsumed and raises; its
    # Z-Image converter renames `attention.out.alpha` to `to_out.0.alpha` but not the weights beside it,
    # and raises on the three left-over alphas.
    ("flux2_klein", "comfy", "diffusers.load_lora_weights"): "raises",
    ("zimage", "comfy", "diffusers.load_lora_weights"): "raises",
    # load_lora_adapter converts nothing: it takes the `transformer.` keys only, so a file with none
    # loads no adapter at all (diffusers logs a warning).
    ("flux2_klein", "comfy", "diffusers.load_lora_adapter"): "no effect",
    ("zimage", "comfy", "diffusers.load_lora_adapter"): "no effect",
    ("flux2_klein", "kohya", "diffusers.load_lora_adapter"): "no effect",
    ("zimage", "kohya", "diffusers.load_lora_adapter"): "no effect",
}


# ---------------------------------------------------------------- the two families

# The smallest Z-Image whose ComfyUI and diffusers shapes agree: diffusers' t_embedder is 1024 wide
# (ComfyUI's min(dim, 1024)) and its feed-forward int(8/3·dim) wide (ComfyUI's rounded up to 256), so
# dim ≥ 1024, a multiple of 96 and of the 128-wide heads: 1152. One block per stack keeps it small.
ZIMAGE_CONFIG = {
    **tiny_comfy.zimage_unet_config(),
    "dim": 1152,
    "n_heads": 9,
    "n_kv_heads": 9,
    "n_layers": 1,
    "n_refiner_layers": 1,
}


@dataclasses.dataclass(frozen=True)
class Family:
    arch: str
    build_comfy: Callable[[Path], object]  # tmp dir → ModelPatcher
    convert: Callable[[dict], dict]  # diffusers' single-file converter
    build_diffusers: Callable[[], torch.nn.Module]
    pipeline: type
    comfy_forward: Callable[[torch.nn.Module], torch.Tensor]
    diffusers_forward: Callable[[torch.nn.Module], torch.Tensor]


def _inputs(seed: int, *shapes) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator) for shape in shapes]


# Flux2: a 2×2 latent (4 image tokens), 8 text tokens, σ = 0.6. diffusers takes σ too (its pipeline passes
# t/1000 and the model multiplies by 1000). Each side is compared only with itself, so the ids need not match.
def _flux2_comfy_forward(model):
    x, context = _inputs(1, (1, 128, 2, 2), (1, 8, tiny_comfy.FLUX2_CONTEXT_DIM))
    return model(x, torch.tensor([0.6]), context, transformer_options={})


def _flux2_diffusers_forward(model):
    x, context = _inputs(1, (1, 4, 128), (1, 8, tiny_comfy.FLUX2_CONTEXT_DIM))
    img_ids = torch.tensor([[0, h, w, 0] for h in range(2) for w in range(2)], dtype=torch.float32)
    txt_ids = torch.tensor([[0, 0, 0, t] for t in range(8)], dtype=torch.float32)
    return model(
        hidden_states=x,
        encoder_hidden_states=context,
        timestep=torch.tensor([0.6]),
        img_ids=img_ids[None],
        txt_ids=txt_ids[None],
        return_dict=False,
    )[0]


def _zimage_comfy_forward(model):
    x, context = _inputs(2, (1, 16, 4, 4), (1, 8, tiny_comfy.ZIMAGE_TE_HIDDEN))
    return model(x, torch.tensor([0.6]), context, 8, transformer_options={})


def _zimage_diffusers_forward(model):
    x, context = _inputs(2, (16, 1, 4, 4), (8, tiny_comfy.ZIMAGE_TE_HIDDEN))
    return model([x], torch.tensor([0.6]), [context], return_dict=False)[0][0]


FAMILIES = {
    "flux2_klein": Family(
        "flux2_klein",
        lambda tmp: tiny_comfy.tiny_flux2(tmp),
        single_file_utils.convert_flux2_transformer_checkpoint_to_diffusers,
        lambda: Flux2Transformer2DModel(
            num_layers=2,
            num_single_layers=2,
            num_attention_heads=2,
            joint_attention_dim=tiny_comfy.FLUX2_CONTEXT_DIM,
            guidance_embeds=False,
        ),
        Flux2KleinPipeline,
        _flux2_comfy_forward,
        _flux2_diffusers_forward,
    ),
    "zimage": Family(
        "zimage",
        lambda tmp: tiny_comfy.assembled(comfy.supported_models.ZImage, NextDiT, ZIMAGE_CONFIG, 0),
        single_file_utils.convert_z_image_transformer_checkpoint_to_diffusers,
        lambda: ZImageTransformer2DModel(
            dim=ZIMAGE_CONFIG["dim"],
            n_layers=1,
            n_refiner_layers=1,
            n_heads=9,
            n_kv_heads=9,
            cap_feat_dim=ZIMAGE_CONFIG["cap_feat_dim"],
            axes_dims=ZIMAGE_CONFIG["axes_dims"],
            axes_lens=ZIMAGE_CONFIG["axes_lens"],
            rope_theta=ZIMAGE_CONFIG["rope_theta"],
        ),
        ZImagePipeline,
        _zimage_comfy_forward,
        _zimage_diffusers_forward,
    ),
}


# ---------------------------------------------------------------- helpers


def _targets(arch: archs.Arch, model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """The Linears the arch trains by default, as Kiln picks them: ComfyUI path → (out, in)."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return {
        path: (layers[path].out_features, layers[path].in_features)
        for path in select_targets(list(layers), list(arch.default_targets))
    }


def _random_lora(modules: dict[str, tuple[int, int]], seed: int, scale: float) -> lf.Lora:
    """A LoRA with a clear effect (ΔW about a fifth of W at scale 2), alpha = scale·rank, and two ranks
    (fused attention rank 8, the rest 4) so a reader that takes one module's scale for all would show it."""
    rng = np.random.default_rng(seed)
    lora = {}
    for path, (out, fan_in) in modules.items():
        rank = 8 if path.endswith("qkv") else 4
        A = rng.standard_normal((rank, fan_in), dtype=np.float32) / np.float32(np.sqrt(fan_in))
        B = rng.standard_normal((out, rank), dtype=np.float32) * np.float32(0.1 / np.sqrt(rank))
        lora[path] = LoraWeights(A, B, scale * rank)
    return lora


def _patched(base: dict[str, torch.Tensor], lora: lf.Lora) -> dict[str, torch.Tensor]:
    """The LoRA's definition applied: W + alpha/rank·B@A (fp64 product)."""
    out = dict(base)
    for path, w in lora.items():
        delta = (torch.from_numpy(w.B).double() @ torch.from_numpy(w.A).double()) * w.scale
        out[path + ".weight"] = (base[path + ".weight"].double() + delta).float()
    return out


def _relative(out: torch.Tensor, truth: torch.Tensor, base: torch.Tensor) -> float:
    return float((out - truth).norm() / (truth - base).norm())


class Bench:
    """One family's models, files and reference outputs, built once per module."""

    def __init__(self, family: Family, tmp: Path, *, scale: float = 2.0, dtype: str = "bf16"):
        self.family, self.dtype = family, dtype
        with torch.inference_mode():
            self.patcher = family.build_comfy(tmp)
        self.comfy_model = self.patcher.model.diffusion_model
        self.base = {k: v.detach().clone() for k, v in self.comfy_model.state_dict().items()}
        self.lora = _random_lora(_targets(archs.get_arch(family.arch), self.comfy_model), seed=7, scale=scale)
        self.files = self._write_files(tmp / "loras")
        self.truth_lora, _ = lf.load_lora(self.files["comfy"])  # the (bf16) weights every file came from
        truth = _patched(self.base, self.truth_lora)
        self.comfy_base, self.comfy_truth = self.comfy_output(self.base), self.comfy_output(truth)
        self.diffusers_base_model = self._diffusers_model(self.base)
        self.diffusers_base = self.diffusers_output(self.diffusers_base_model)
        self.diffusers_truth = self.diffusers_output(self._diffusers_model(truth))

    def _write_files(self, folder: Path) -> dict[str, Path]:
        folder.mkdir()
        metadata = lf.build_metadata(arch_name=self.family.arch, config={}, steps=1, trigger_words=[], title="t")
        files = {"comfy": folder / f"{self.family.arch}-comfy.safetensors"}
        lf.save_lora(files["comfy"], self.lora, arch=self.family.arch, fmt="comfy", dtype=self.dtype, metadata=metadata)
        for fmt in FORMATS:
            if fmt != "comfy":  # exported from the saved file, as `python -m trainer export` does
                files[fmt] = folder / f"{self.family.arch}-{fmt}.safetensors"
                lf.export(files["comfy"], files[fmt], fmt)
        return files

    def comfy_output(self, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """ComfyUI's diffusion model run with these weights in place of its own."""

        def call(*args, **kwargs):
            return torch.func.functional_call(self.comfy_model, weights, args, kwargs, strict=True)

        with torch.inference_mode():
            return self.family.comfy_forward(call).float().clone()

    def _diffusers_model(self, comfy_weights: dict[str, torch.Tensor]) -> torch.nn.Module:
        model = self.family.build_diffusers()
        model.load_state_dict(self.family.convert({k: v.clone() for k, v in comfy_weights.items()}), strict=True)
        return model.eval()

    def diffusers_output(self, model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return self.family.diffusers_forward(model).float().clone()

    # ---- the readers: each returns its relative error, or raises what the reader raised

    def read_comfyui(self, fmt: str, caplog) -> float:
        name = self.files[fmt].name
        with caplog.at_level(logging.WARNING):
            (patched,) = nodes.LoraLoaderModelOnly().load_lora_model_only(self.patcher, name, 1.0)
        assert "lora key not loaded" not in caplog.text, caplog.text  # every key matched
        mm.load_models_gpu([patched], force_full_load=True)  # ComfyUI merges W + ΔW into the weights
        try:
            with torch.inference_mode():
                out = self.family.comfy_forward(self.comfy_model).float().clone()
        finally:
            mm.load_models_gpu([self.patcher], force_full_load=True)
        return _relative(out, self.comfy_truth, self.comfy_base)

    def read_kiln(self, fmt: str) -> float:
        lora, _ = lf.load_lora(self.files[fmt])  # arch (and kohya's module names) from the file's metadata
        return _relative(self.comfy_output(_patched(self.base, lora)), self.comfy_truth, self.comfy_base)

    def read_diffusers(self, fmt: str, loader: str) -> float:
        model = copy.deepcopy(self.diffusers_base_model)
        if loader == "load_lora_weights":
            pipe = self.family.pipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=model)
            pipe.load_lora_weights(str(self.files[fmt]))
        else:
            model.load_lora_adapter(str(self.files[fmt]), prefix="transformer")
        return _relative(self.diffusers_output(model), self.diffusers_truth, self.diffusers_base)

    def read(self, fmt: str, reader: str, caplog) -> float:
        readers = {
            "comfyui": lambda: self.read_comfyui(fmt, caplog),
            "kiln": lambda: self.read_kiln(fmt),
            "diffusers.load_lora_weights": lambda: self.read_diffusers(fmt, "load_lora_weights"),
            "diffusers.load_lora_adapter": lambda: self.read_diffusers(fmt, "load_lora_adapter"),
        }
        return readers[reader]()


@pytest.fixture(scope="module")
def benches(tmp_path_factory):
    made: dict[str, Bench] = {}
    loras = tmp_path_factory.mktemp("loras_root")
    saved = folder_paths.folder_names_and_paths.get("loras")

    def get(arch: str) -> Bench:
        if arch not in made:
            made[arch] = Bench(FAMILIES[arch], tmp_path_factory.mktemp(arch))
            for path in made[arch].files.values():
                shutil.copy(path, loras / path.name)
        return made[arch]

    folder_paths.folder_names_and_paths["loras"] = ([str(loras)], folder_paths.supported_pt_extensions)
    try:
        yield get
    finally:
        if saved is not None:
            folder_paths.folder_names_and_paths["loras"] = saved


def test_the_lora_changes_both_models_clearly(benches):
    """The relative errors below mean something: in ComfyUI's model and in diffusers' (converted from it,
    every weight loaded strictly) the LoRA moves the output by more than 5 %."""
    for arch in FAMILIES:
        bench = benches(arch)
        comfy_effect = float((bench.comfy_truth - bench.comfy_base).norm() / bench.comfy_base.norm())
        diffusers_effect = float((bench.diffusers_truth - bench.diffusers_base).norm() / bench.diffusers_base.norm())
        assert comfy_effect > 0.05 and diffusers_effect > 0.05, (arch, comfy_effect, diffusers_effect)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_every_export_in_every_reader(benches, arch, fmt, reader, caplog):
    bench = benches(arch)
    expected = FAILS.get((arch, fmt, reader), "exact")
    if expected == "raises":
        with pytest.raises(ValueError, match="should be empty at this point"):  # diffusers' converters' check
            bench.read(fmt, reader, caplog)
        return
    error = bench.read(fmt, reader, caplog)
    print(f"{arch} {fmt} {reader}: relative error {error:.2e}")
    if expected == "no effect":
        assert error == pytest.approx(1.0, abs=1e-6)
    else:
        assert error < TOLERANCE, (arch, fmt, reader, error)


def test_any_scale_is_exact_in_fp32_files(tmp_path, caplog):
    """alpha/rank = 0.75 is no power of two: folded into B it is rounded once more in a bf16 file (about
    2e-3 of the effect, as diffusers' own kohya converter rounds it), and exact in an fp32 file."""
    bench = Bench(FAMILIES["flux2_klein"], tmp_path, scale=0.75, dtype="fp32")
    for fmt, reader in [
        ("diffusers", "kiln"),
        ("diffusers", "diffusers.load_lora_weights"),
        ("diffusers", "diffusers.load_lora_adapter"),
        ("kohya", "diffusers.load_lora_weights"),
    ]:
        assert bench.read(fmt, reader, caplog) < TOLERANCE, (fmt, reader)
