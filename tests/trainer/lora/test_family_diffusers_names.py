"""The diffusers export of the arch files whose ComfyUI layers fuse what diffusers splits unevenly (Chroma's
single-block linear1 = q, k, v and the MLP input; Lumina 2's qkv with grouped k/v heads): on diffusers' own
full-size models, built on the meta device (no weights), every exported name is a module there and every A/B
fits its Linear, and the file reads back to the ComfyUI layers it came from."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.lora import files as lf

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers", reason="the `test` extra installs diffusers")


def _lora(shapes: dict[str, tuple[int, int]], rank: int = 2) -> dict:
    rng = np.random.default_rng(0)
    return {
        path: lf.LoraWeights(
            rng.standard_normal((rank, fan_in)).astype(np.float32),
            rng.standard_normal((fan_out, rank)).astype(np.float32),
            float(rank),
        )
        for path, (fan_in, fan_out) in shapes.items()
    }


def _chroma_layers(D: int = 3072, M: int = 4 * 3072) -> dict[str, tuple[int, int]]:
    """ComfyUI's Chroma Linears (comfy/ldm/flux/layers.py at Chroma's size): (in, out)."""
    double = {"img_attn.qkv": (D, 3 * D), "img_attn.proj": (D, D), "img_mlp.0": (D, M), "img_mlp.2": (M, D)}
    double |= {k.replace("img", "txt"): v for k, v in double.items()}
    single = {"linear1": (D, 3 * D + M), "linear2": (D + M, D)}
    return {f"double_blocks.18.{k}": v for k, v in double.items()} | {
        f"single_blocks.37.{k}": v for k, v in single.items()
    }


def _lumina2_layers(D: int = 2304, kv: int = 8 * 96, F: int = 9216) -> dict[str, tuple[int, int]]:
    """ComfyUI's NextDiT Linears at Lumina 2's size (24 heads and 8 k/v heads of 96, SwiGLU 9216): (in, out)."""
    block = {
        "attention.qkv": (D, D + 2 * kv),
        "attention.out": (D, D),
        "feed_forward.w1": (D, F),
        "feed_forward.w2": (F, D),
        "feed_forward.w3": (D, F),
    }
    groups = ("layers.25", "noise_refiner.1", "context_refiner.0")
    return {f"{group}.{k}": v for group in groups for k, v in block.items()}


@pytest.mark.parametrize(
    "arch,model_class,layers",
    [
        ("chroma", "ChromaTransformer2DModel", _chroma_layers()),
        ("lumina2", "Lumina2Transformer2DModel", _lumina2_layers()),
    ],
)
def test_diffusers_names_fit_the_diffusers_model(arch, model_class, layers):
    with torch.device("meta"):
        model = getattr(diffusers, model_class)()  # the class defaults are the released model's sizes
    modules = dict(model.named_modules())
    lora = _lora(layers)
    tensors = lf.to_tensors(lora, "diffusers", arch)
    for key, value in tensors.items():
        name, part = key.removeprefix("transformer.").rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        module = modules[name]
        assert isinstance(module, torch.nn.Linear), name
        assert value.shape == ((2, module.in_features) if part == "lora_A" else (module.out_features, 2)), key
    back, found = lf.from_tensors(tensors, arch=arch)
    assert found == "diffusers" and sorted(back) == sorted(lora)
    for path, weights in lora.items():  # alpha = rank: nothing folded into B
        np.testing.assert_allclose(back[path].B @ back[path].A, weights.B @ weights.A, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "arch,model_class,config",
    [
        ("zimage", "ZImageTransformer2DModel", {}),
        ("flux2_klein", "Flux2Transformer2DModel", {"num_layers": 1, "num_single_layers": 1}),
        ("chroma", "ChromaTransformer2DModel", {"num_layers": 1, "num_single_layers": 1}),
        ("lumina2", "Lumina2Transformer2DModel", {"num_layers": 1, "num_refiner_layers": 1}),
    ],
)
def test_modules_outside_the_block_rules_have_their_diffusers_names(arch, model_class, config):
    """trainer/lora/outside.py: every diffusers name it gives an embedder, modulation or final layer is a Linear
    of diffusers' own model (#47), and the names it gives none are refused with the module named."""
    from trainer.archs import get_arch
    from trainer.lora import keys, outside

    with torch.device("meta"):
        model = getattr(diffusers, model_class)(**config)
    modules = dict(model.named_modules())
    rules = outside.OUTSIDE[get_arch(arch).family]
    named = [target.format(*["0"] * target.count("{")) for rule in rules for target in rule.targets]
    missing = [n for n in named if not isinstance(modules.get(n), torch.nn.Linear)]
    assert named and not missing, missing
    for rule in (r for r in rules if not r.targets):
        path = keys.fill_groups(rule.comfy, ["0"] * rule.comfy.count("("))
        with pytest.raises(ValueError, match=f"{path}: no plain diffusers name"):
            lf.to_tensors(_lora({path: (8, 8)}), "diffusers", arch)
