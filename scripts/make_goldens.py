#!/usr/bin/env python3
"""Write the golden outputs that hold the MLX ports to ComfyUI: tests/goldens/<name>.safetensors.

Each golden is ComfyUI's own diffusion model, built from the seeded weights of trainer/demo/tiny_weights.py
(written to a temporary ComfyUI-format file and loaded through comfy.sd.load_diffusion_model, so
ComfyUI's shape-based detection runs), run in float32 on the CPU on seeded inputs. A golden file holds
the inputs and ComfyUI's output as F32 tensors; its metadata says how to rebuild the weights
(`kiln.weights`: the tiny_weights function and its JSON arguments) and what ComfyUI made it. The tests
(tests/trainer/backends/mlx_backend/test_*.py) need neither torch nor ComfyUI. Run it where ComfyUI is checked out and
commit the files:

    COMFYUI_PATH=/path/to/ComfyUI python scripts/make_goldens.py              # all goldens
    COMFYUI_PATH=/path/to/ComfyUI python scripts/make_goldens.py flux2_dev    # some of them

To add a model: write `golden_<name>(tmp_dir) -> (tensors, metadata)` and add it to GOLDENS.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from trainer import safetensors_io
from trainer.demo import tiny_weights  # noqa: E402

GOLDEN_DIR = ROOT / "tests" / "goldens"
MAX_BYTES = 200 * 1024


# ---------------------------------------------------------------- ComfyUI


def comfy():
    """Import ComfyUI from COMFYUI_PATH (CPU), as the tests do."""
    from helpers import comfy_env

    path = comfy_env.comfy_path()
    if path is None:
        raise SystemExit("set COMFYUI_PATH to a ComfyUI 0.17+ checkout")
    comfy_env.prepare(path)
    return path


def comfy_version(path: str) -> str:
    version_file = Path(path, "comfyui_version.py")
    lines = version_file.read_text().splitlines() if version_file.is_file() else []
    versions = [line.split("=", 1)[1].strip().strip("\"'") for line in lines if line.startswith("__version__")]
    return versions[0] if versions else "unknown"


def load_diffusion_model(tmp_dir: Path, name: str, weights: dict[str, np.ndarray]):
    """weights → a ComfyUI-format file → comfy.sd.load_diffusion_model (float32) → its diffusion model,
    checked to hold exactly these weights under exactly these names."""
    import comfy.model_management as mm
    import comfy.sd
    import torch

    path = tmp_dir / f"{name}.safetensors"
    safetensors_io.write(path, weights)
    with torch.inference_mode():
        patcher = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.float32})
        mm.load_models_gpu([patcher], force_full_load=True)
    dm = patcher.model.diffusion_model
    loaded = {k: v.float().cpu().numpy() for k, v in dm.state_dict().items()}
    if loaded.keys() != weights.keys():
        raise RuntimeError(
            f"{name}: ComfyUI's model has other keys than tiny_weights: "
            f"only ComfyUI {sorted(loaded.keys() - weights.keys())[:5]}, "
            f"only ours {sorted(weights.keys() - loaded.keys())[:5]}"
        )
    for key, value in weights.items():
        if not np.array_equal(loaded[key], value):
            raise RuntimeError(f"{name}: ComfyUI loaded {key} with other values")
    return patcher, dm


def run_dm(dm, **inputs):
    """The diffusion model's forward in ComfyUI's call convention, numpy in and out."""
    import torch

    tensors = {
        k: [torch.from_numpy(a) for a in v] if isinstance(v, list) else torch.from_numpy(v)
        for k, v in inputs.items()
        if v is not None
    }
    x, timestep = tensors.pop("x"), tensors.pop("timestep")
    with torch.inference_mode():
        out = dm(x, timestep, transformer_options={}, **tensors)
    return out.float().cpu().numpy()


# ---------------------------------------------------------------- goldens


def _flux2(tmp_dir: Path, *, dev: bool, seed: int = 0):
    """A tiny Flux2 (hidden 256, 2+2 blocks) on batch 2, latent 4×6, 8 context tokens."""
    name = "flux2_dev" if dev else "flux2_klein"
    sizes = {
        "hidden": 256,
        "double": 2,
        "single": 2,
        "context_dim": tiny_weights.FLUX2_CONTEXT_DIM,
        "in_channels": 128,
        "dev": dev,
    }
    patcher, dm = load_diffusion_model(tmp_dir, name, tiny_weights.flux2_weights(seed, **sizes))
    detected = patcher.model.model_config.unet_config
    if detected.get("image_model") != "flux2" or detected.get("guidance_embed") != dev:
        raise RuntimeError(f"{name}: ComfyUI detected {detected}")

    rng = np.random.default_rng(seed + 1000)
    batch, height, width, tokens = 2, 4, 6, 8
    inputs = {
        "x": rng.standard_normal((batch, 128, height, width)).astype(np.float32),
        "timestep": np.array([0.25, 0.8], np.float32),  # sigma: ComfyUI's Flux timestep
        "context": rng.standard_normal((batch, tokens, sizes["context_dim"])).astype(np.float32),
    }
    if dev:
        inputs["guidance"] = np.array([1.0, 3.5], np.float32)
    output = run_dm(dm, **inputs)
    metadata = {
        "kiln.weights": json.dumps({"function": "flux2_weights", "seed": seed, "kwargs": sizes}),
        "kiln.call": "dm(x, timestep, context=context, guidance=guidance) -> output",
    }
    return {**inputs, "output": output}, metadata


def golden_flux2_klein(tmp_dir: Path):
    return _flux2(tmp_dir, dev=False)


def golden_flux2_dev(tmp_dir: Path):
    return _flux2(tmp_dir, dev=True)


def golden_flux2_klein_edit(tmp_dir: Path):
    """Edit training's forward: the flux2_klein golden's model and inputs with reference latents (ComfyUI's
    ref_latents, as ReferenceLatent feeds them): output_1 with the first, output_2 with both; the second
    is of another size than the target (3×5 for 4×6), so its own position grid shows."""
    tensors, metadata = _flux2(tmp_dir, dev=False)
    _, dm = load_diffusion_model(
        tmp_dir, "flux2_klein_edit", tiny_weights.flux2_weights(0, **json.loads(metadata["kiln.weights"])["kwargs"])
    )
    if dm.params.default_ref_method != "index" or dm.params.ref_index_scale != 10.0:
        raise RuntimeError(
            f"flux2: ComfyUI places references by {dm.params.default_ref_method!r} "
            f"x{dm.params.ref_index_scale}; the MLX port assumes 'index' x10"
        )
    rng = np.random.default_rng(2000)
    references = [
        rng.standard_normal((2, 128, 4, 6)).astype(np.float32),
        rng.standard_normal((2, 128, 3, 5)).astype(np.float32),
    ]
    inputs = {k: tensors[k] for k in ("x", "timestep", "context")}
    out = {**inputs, "reference_0": references[0], "reference_1": references[1]}
    for count in (1, 2):
        out[f"output_{count}"] = run_dm(dm, **inputs, ref_latents=references[:count])
    metadata["kiln.call"] = "dm(x, timestep, context=context, ref_latents=[reference_0, ...]) -> output_<count>"
    return out, metadata


def comfy_zimage(weights: dict[str, np.ndarray]):
    """ModelPatcher of ComfyUI's NextDiT with the Z-Image config holding exactly `weights` (float32).

    ComfyUI detects Z-Image only at dim 3840, so this is load_diffusion_model_state_dict by hand (as
    tests/helpers/tiny_comfy.py does): supported_models.ZImage(model_detection's config at this size)."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models
    import torch

    dim, cap_feat_dim = weights["cap_embedder.1.weight"].shape
    unet_config = {
        "image_model": "lumina2",
        "patch_size": 2,
        "in_channels": 16,
        "dim": dim,
        "cap_feat_dim": cap_feat_dim,
        "n_layers": len({k.split(".")[1] for k in weights if k.startswith("layers.")}),
        "n_refiner_layers": len({k.split(".")[1] for k in weights if k.startswith("noise_refiner.")}),
        "qk_norm": True,
        "n_heads": dim // 128,
        "n_kv_heads": dim // 128,
        "axes_dims": [32, 48, 48],
        "axes_lens": [1536, 512, 512],
        "rope_theta": 256.0,
        "ffn_dim_multiplier": 8.0 / 3.0,
        "z_image_modulation": True,
        "time_scale": 1000.0,
        "pad_tokens_multiple": 32,
    }
    sd = {k: torch.from_numpy(v.copy()) for k, v in weights.items()}
    with torch.inference_mode():
        model_config = comfy.supported_models.ZImage(dict(unet_config))
        model_config.set_inference_dtype(torch.float32, None)
        model = model_config.get_model(sd, "")
        model.load_model_weights(sd, "")  # not strict: checked below
    loaded = {k: v.float().cpu().numpy() for k, v in model.diffusion_model.state_dict().items()}
    if loaded.keys() != weights.keys() or any(not np.array_equal(loaded[k], v) for k, v in weights.items()):
        raise RuntimeError(
            f"zimage: ComfyUI's NextDiT does not hold exactly zimage_weights(): only ComfyUI "
            f"{sorted(loaded.keys() - weights.keys())[:5]}, only ours "
            f"{sorted(weights.keys() - loaded.keys())[:5]}"
        )
    return comfy.model_patcher.ModelPatcher(
        model, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device()
    )


def _zimage(*, batch: int, height: int, width: int, tokens: int, sigmas: list[float], seed: int = 0):
    """A tiny Z-Image (dim 256, 2 layers, 2+2 refiners, caption dim 64) called as nodes/comfy/ calls it
    (make_forward: extra_conds → num_tokens, model_sampling.timestep, the casts)."""
    from helpers import comfy_env
    import torch

    bridge, archs = comfy_env.import_pack("nodes.comfy.bridge"), comfy_env.import_pack("trainer.archs")
    sizes = {"dim": 256, "n_layers": 2, "n_refiner_layers": 2, "cap_feat_dim": 64}
    patcher = comfy_zimage(tiny_weights.zimage_weights(seed, **sizes))
    rng = np.random.default_rng([seed, tokens])
    inputs = {
        "x": rng.standard_normal((batch, 16, height, width)).astype(np.float32),
        "timestep": np.asarray(sigmas, np.float32),  # sigma (Z-Image multiplier 1.0)
        "context": rng.standard_normal((batch, tokens, sizes["cap_feat_dim"])).astype(np.float32),
    }
    extras = archs.get_arch("zimage").model_extras(batch, [tokens] * batch)  # {"num_tokens": T}
    with torch.inference_mode():
        output = bridge.make_forward(patcher, "zimage")(
            bridge.diffusion_model(patcher),
            *(torch.from_numpy(inputs[k]) for k in ("x", "timestep", "context")),
            extras,
        )
    metadata = {
        "kiln.weights": json.dumps({"function": "zimage_weights", "seed": seed, "kwargs": sizes}),
        "kiln.call": "dm(x, timestep, context, num_tokens) -> output, via nodes/comfy/ make_forward",
        "kiln.num_tokens": str(extras["num_tokens"]),
    }
    return {**inputs, "output": output.float().cpu().numpy()}, metadata


def golden_zimage(tmp_dir: Path):
    """Batch 2, latent 8×8 (16 image tokens, padded to 32), 40 caption tokens (padded to 64)."""
    return _zimage(batch=2, height=8, width=8, tokens=40, sigmas=[0.25, 0.8])


def golden_zimage_short_caption(tmp_dir: Path):
    """Batch 2, latent 6×9 (odd: ComfyUI's circular patch padding), 7 caption tokens (padded to 32)."""
    return _zimage(batch=2, height=6, width=9, tokens=7, sigmas=[0.5, 0.95])


GOLDENS = {
    "flux2_klein": golden_flux2_klein,
    "flux2_dev": golden_flux2_dev,
    "flux2_klein_edit": golden_flux2_klein_edit,
    "zimage": golden_zimage,
    "zimage_short_caption": golden_zimage_short_caption,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"goldens to write, of {', '.join(GOLDENS)} (default: all)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in GOLDENS]
    if unknown:
        parser.error(f"unknown golden {unknown[0]!r}; known: {', '.join(GOLDENS)}")
    path = comfy()
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.names or list(GOLDENS):
            tensors, metadata = GOLDENS[name](Path(tmp))
            metadata = {"kiln.golden": name, "kiln.comfyui_version": comfy_version(path), **metadata}
            target = GOLDEN_DIR / f"{name}.safetensors"
            safetensors_io.write(target, tensors, metadata, dtype="F32")
            size = target.stat().st_size
            if size > MAX_BYTES:
                raise RuntimeError(f"{target}: {size} bytes, over the {MAX_BYTES}-byte budget; use smaller inputs")
            print(
                f"{target.relative_to(ROOT)}: {size // 1024} KB, output max |{max(np.abs(v).max() for k, v in tensors.items() if k.startswith('output')):.3f}|"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
