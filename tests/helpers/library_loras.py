"""LoRA files written by the real libraries (LyCORIS 4.1.3, PEFT, diffusers) on a tiny module tree named as
diffusers names the arch's Linears, and the weight change each library's own merge gives (#47).

Run as `python -m helpers.library_loras SPEC OUT` (from tests/) with a Python that has lycoris-lora, peft and
diffusers (the `test` extra): SPEC is JSON {family: {"shapes": {diffusers name: [out, in]}, "seed": n, "pipeline":
the diffusers pipeline whose save_lora_weights writes the diffusers case}}; OUT/<family> gets one .safetensors per
case and <case>.delta.safetensors ({name: ΔW}, and "base.<name>": the base weights used). One process for every
family: the libraries' imports are most of its time.
A separate process, because a ComfyUI tree's venv may hold a transformers that PEFT cannot import."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

RANK, ALPHA = 4, 8.0
# case → how it is written: LyCORIS algo and its options, PEFT with DoRA, or diffusers' save_lora_weights
CASES = {
    "lycoris_lokr": {"algo": "lokr", "factor": 4},
    "lycoris_lokr_full": {"algo": "lokr", "factor": 4, "full_matrix": True},
    "lycoris_loha": {"algo": "loha"},
    "lycoris_locon": {"algo": "locon"},
    "lycoris_dora": {"algo": "lora", "dora_wd": True},
    "peft_dora": {"peft": True, "use_dora": True},
    "diffusers_lora": {"peft": True, "diffusers": True},
}


def tree(shapes: dict[str, list[int]], seed: int) -> torch.nn.Module:
    """A module tree with a Linear at each dotted name (no bias: a LoRA touches only weights here)."""
    torch.manual_seed(seed)
    root = torch.nn.Module()
    for name, (out, fan_in) in sorted(shapes.items()):
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        linear = torch.nn.Linear(fan_in, out, bias=False)
        torch.nn.init.normal_(linear.weight, std=0.5)
        parent.add_module(leaf, linear)
    return root


def weights(model: torch.nn.Module, shapes) -> dict[str, torch.Tensor]:
    return {name: model.get_submodule(name).weight.detach().clone() for name in shapes}


def _perturb(params, seed: int) -> None:
    """Trained-looking adapter weights: every zero-initialised tensor random, the rest nudged."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(noise * 0.2 if not p.any() else p * (1 + 0.1 * noise))


def lycoris(shapes, seed: int, out: Path, options: dict) -> dict[str, torch.Tensor]:
    from lycoris import create_lycoris

    model = tree(shapes, seed)
    base = weights(model, shapes)
    net = create_lycoris(model, 1.0, linear_dim=RANK, linear_alpha=ALPHA, **options)
    net.apply_to()
    _perturb(net.parameters(), seed + 1)
    net.save_weights(str(out), torch.float32, {"ss_network_module": "lycoris.kohya"})
    # What the network computes (its forward on the identity, the weight it trained): LyCORIS 4.1.3's merge_to
    # scales a LoKr by alpha/rank twice, (alpha/rank)² where its forward and ComfyUI use alpha/rank.
    with torch.no_grad():
        applied = {name: model.get_submodule(name)(torch.eye(shape[1])).T for name, shape in shapes.items()}
    return {name: applied[name] - base[name] for name in shapes} | {f"base.{name}": w for name, w in base.items()}


def peft(shapes, seed: int, out: Path, options: dict) -> dict[str, torch.Tensor]:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file

    model = tree(shapes, seed)
    base = weights(model, shapes)
    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=sorted(shapes), use_dora=options.get("use_dora", False)
    )
    wrapped = get_peft_model(model, config)
    _perturb([p for n, p in wrapped.named_parameters() if "lora_" in n], seed + 1)
    state = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(wrapped).items()}
    if options.get("diffusers"):
        import diffusers

        state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
        getattr(diffusers, options["diffusers"]).save_lora_weights(
            out.parent, state, weight_name=out.name, transformer_lora_adapter_metadata=config.to_dict()
        )
    else:  # PEFT's own file: alpha lives in adapter_config.json, not here, so alpha = rank keeps scale 1 as read
        wrapped.peft_config["default"].lora_alpha = RANK
        for module in wrapped.modules():
            if hasattr(module, "scaling") and isinstance(module.scaling, dict):
                module.scaling["default"] = 1.0
        save_file(state, str(out))
    merged = wrapped.merge_and_unload()
    return {name: merged.get_submodule(name).weight.detach() - base[name] for name in shapes} | {
        f"base.{name}": w for name, w in base.items()
    }


def main(spec_path: str, out_dir: str) -> None:
    from safetensors.torch import save_file

    for family, spec in json.loads(Path(spec_path).read_text()).items():
        out = Path(out_dir) / family
        out.mkdir(parents=True, exist_ok=True)
        for index, (case, options) in enumerate(CASES.items()):
            write = peft if options.get("peft") else lycoris
            options = {k: v for k, v in options.items() if k not in ("peft", "diffusers")} | (
                {"diffusers": spec["pipeline"]} if options.get("diffusers") else {}
            )
            delta = write(spec["shapes"], spec["seed"] + index, out / f"{case}.safetensors", options)
            save_file({k: v.float().contiguous() for k, v in delta.items()}, str(out / f"{case}.delta.safetensors"))


if __name__ == "__main__":
    main(*sys.argv[1:])
