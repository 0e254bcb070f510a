"""`python -m trainer train CONFIG` for a ComfyUI architecture, with ComfyUI as a library (COMFYUI_PATH).

ComfyUI cannot detect tiny VAE and text-encoder files, so the loaders are swapped for the tiny
ComfyUI objects; the diffusion model really is loaded from its file by ComfyUI's own loader.
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers import comfy_env
import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()

import comfy.sd  # noqa: E402
from helpers import tiny_comfy as tc  # noqa: E402

import kiln_pack.headless as headless
import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.trainer.lora.files as lora_format
import kiln_pack.nodes.train_nodes as tn
from trainer.cli.train import train_config  # noqa: E402  (reads the config once, then calls headless.train_command)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_headless_train_of_a_flux2_file(tmp_path, capsys, backend):
    if backend == "mlx":
        pytest.importorskip("mlx.core", reason="backend mlx needs MLX (mlx[cpu] on Linux)")
    model_file = tc.write_flux2_file(tmp_path / "tiny_flux2.safetensors")
    for name in ("vae", "te"):
        (tmp_path / f"{name}.safetensors").write_bytes(b"stand-in: the loaders below return tiny models")
    data = tc.write_photos(tmp_path / "ds")
    config = tmp_path / "klein.toml"
    config.write_text(
        f'arch = "flux2_klein"\nbackend = "{backend}"\ndevice = "{"auto" if comfy_env.gpu() else "cpu"}"\n'
        f'mixed_precision = "{"bf16" if comfy_env.gpu() else "no"}"\nsteps = 4\nrank = 4\nalpha = 4.0\n'
        f'model_path = "{model_file}"\nvae_path = "{tmp_path / "vae.safetensors"}"\n'
        f'text_encoder_path = "{tmp_path / "te.safetensors"}"\ndataset_dir = "{data}"\n'
        f'output_dir = "{tmp_path / "runs"}"\nrun_name = "klein"\nresolutions = [64]\ncheckpoint_every = 2\n'
    )

    def loaders(cfg):
        return comfy.sd.load_diffusion_model(cfg.model_path), tc.tiny_vae(flux2=True), tc.tiny_klein_clip()

    assert train_config(str(config), False, loaders=loaders) == 0
    lora_file = tmp_path / "runs" / "klein" / "klein.safetensors"
    assert lora_file.is_file() and (tmp_path / "runs" / "klein" / "step-000004").is_dir()
    model = comfy.sd.load_diffusion_model(str(model_file))
    assert bridge.unmatched_lora_keys(model, bridge.load_lora_file(lora_file)) == []
    lora, metadata = lora_format.load_lora(lora_file)
    assert metadata["kiln.arch"] == "flux2_klein" and metadata["kiln.steps"] == "4"
    assert "finished at step 4/4" in capsys.readouterr().out


def test_the_cli_reaches_the_same_headless_module():
    from trainer.cli.main import _headless

    assert _headless() is headless


# ---------------------------------------------------------------- validation samples (#17 item 9)

import kiln_pack.nodes.run as run_module
import kiln_pack.trainer.config as config_module
import kiln_pack.trainer.run.state as state_module

PROMPTS = '["a red cube --seed 5", {prompt = "a blue ball", negative = "blurry", cfg = 2.0, width = 80, height = 64}]'


def klein_run(tmp_path, name: str, *, steps: int = 4, extra: str = "") -> Path:
    """A headless Flux2 Klein config (tiny file, 3 images) in tmp_path; its run folder's path."""
    model_file = tmp_path / "tiny_flux2.safetensors"
    if not model_file.is_file():
        tc.write_flux2_file(model_file)
        for stand_in in ("vae", "te"):
            (tmp_path / f"{stand_in}.safetensors").write_bytes(b"stand-in: the loaders below return tiny models")
        tc.write_photos(tmp_path / "ds")
    config = tmp_path / f"{name}.toml"
    attention = 'attention = "flash"' if comfy_env.gpu() else ""  # the same_kernels fixture's, on the GPU
    config.write_text(
        f'arch = "flux2_klein"\ndevice = "{"auto" if comfy_env.gpu() else "cpu"}"\n'
        f'mixed_precision = "{"bf16" if comfy_env.gpu() else "no"}"\nsteps = {steps}\nrank = 4\nalpha = 4.0\n'
        f"{attention}\n"
        f'learning_rate = 0.02\nmodel_path = "{model_file}"\nvae_path = "{tmp_path / "vae.safetensors"}"\n'
        f'text_encoder_path = "{tmp_path / "te.safetensors"}"\ndataset_dir = "{tmp_path / "ds"}"\n'
        f'output_dir = "{tmp_path / "runs"}"\nrun_name = "{name}"\nresolutions = [64]\ncheckpoint_every = 2\n'
        f"{extra}",
        encoding="utf-8",
    )
    return config


def tiny_loaders(cfg):
    return comfy.sd.load_diffusion_model(cfg.model_path), tc.tiny_vae(flux2=True), tc.tiny_klein_clip()


def png(path: Path) -> tuple[np.ndarray, dict]:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB")), dict(image.text)


def same_lora(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(
        np.array_equal(a[k].A, b[k].A) and np.array_equal(a[k].B, b[k].B) and a[k].alpha == b[k].alpha for k in a
    )


def as_saved(images) -> np.ndarray:
    """An IMAGE as ComfyUI's SaveImage stores it (255·x clipped, to uint8)."""
    return np.clip(255.0 * images[0].float().cpu().numpy(), 0, 255).astype(np.uint8)


def test_headless_samples_its_prompts_into_the_run_folder_through_comfys_sampler(tmp_path, capsys, same_kernels):
    """Two sample prompts every 2 steps of 4: files by step and prompt before the first step, at 2 and at 4,
    each with its settings in the PNG. Before training the image is bitwise what ComfyUI's sampler gives the
    plain model (bridge.sample, the node's path); at the end, what it gives the model with the run's LoRA
    (patched through ComfyUI's loader, not bitwise: ComfyUI merges the LoRA into the weights); the prompts'
    own settings win over sample_*; the LoRA is the one a run without samples trains."""
    plain = klein_run(tmp_path, "plain")
    assert train_config(str(plain), False, loaders=tiny_loaders) == 0
    sampled = klein_run(
        tmp_path,
        "sampled",
        extra=f"sample_every = 2\nsample_steps = 2\nsample_width = 64\n"
        f"sample_height = 64\nsample_prompts = {PROMPTS}\n"
        "log_tensorboard = true\n",
    )
    assert train_config(str(sampled), False, loaders=tiny_loaders) == 0
    out = capsys.readouterr().out
    run = tmp_path / "runs" / "sampled"
    assert "samples: 2 prompt(s) every 2 steps and at the end (and before the first step)" in out
    assert f"samples (6, newest step-000004-p1.png): {run / 'samples'}" in out
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["grid.png"] + [
        f"step-{step:06d}-p{index}.png" for step in (0, 2, 4) for index in (0, 1)
    ]
    # the grid: a column per prompt, a labelled row per sampling step (64 px samples, never upscaled)
    import kiln_pack.trainer.samples.grid as grid_module

    with Image.open(run / "samples" / "grid.png") as grid:
        assert grid.size == (
            grid_module.LABEL_PX + 2 * (grid_module.CELL_PX + grid_module.GAP_PX),
            grid_module.HEADER_PX + 3 * (64 + grid_module.GAP_PX),
        )
    assert not (tmp_path / "runs" / "plain" / "samples").exists()
    # The samples before the first step reach TensorBoard too (step 0), with those of steps 2 and 4.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert {tag: [e.step for e in events.Images(tag)] for tag in events.Tags()["images"]} == {
        "validation/0": [0, 2, 4],
        "validation/1": [0, 2, 4],
    }

    model = comfy.sd.load_diffusion_model(str(tmp_path / "tiny_flux2.safetensors"))
    clip, vae = tc.tiny_klein_clip(), tc.tiny_vae(flux2=True)
    red = dict(
        positive=tc.conditioning(clip, "a red cube"),
        negative=tc.conditioning(clip, ""),
        seed=5,
        steps=2,
        cfg=1.0,
        sampler_name="euler",
        scheduler="simple",
        width=64,
        height=64,
    )
    blue = dict(
        positive=tc.conditioning(clip, "a blue ball"),
        negative=tc.conditioning(clip, "blurry"),
        seed=43,
        steps=2,
        cfg=2.0,
        sampler_name="euler",
        scheduler="simple",
        width=80,
        height=64,
    )
    for index, settings in enumerate((red, blue)):
        pixels, text = png(run / "samples" / f"step-000000-p{index}.png")
        assert np.array_equal(pixels, as_saved(bridge.sample(model, vae=vae, **settings)))
        info = json.loads(text["kiln.sample"])
        assert {k: info[k] for k in ("step", "arch", "seed", "steps", "cfg", "width", "height")} == dict(
            step=0,
            arch="flux2_klein",
            seed=settings["seed"],
            steps=2,
            cfg=settings["cfg"],
            width=settings["width"],
            height=settings["height"],
        )
    assert png(run / "samples" / "step-000000-p1.png")[1]["parameters"].startswith(
        "a blue ball\nNegative prompt: blurry\nSteps: 2, Sampler: euler simple, CFG scale: 2, Seed: 43, Size: 80x64"
    )

    lora = state_module.checkpoint_lora(state_module.load_checkpoint(run / "step-000004"))
    trained = bridge.apply_lora(model, bridge.lora_model_from(lora, "flux2_klein"), 1.0)
    first, last = png(run / "samples" / "step-000000-p0.png")[0], png(run / "samples" / "step-000004-p0.png")[0]
    expected = as_saved(bridge.sample(trained, vae=vae, **red))
    apart, moved = np.abs(last.astype(int) - expected), np.abs(last.astype(int) - first)
    if comfy_env.gpu():
        # bf16: ComfyUI samples the LoRA merged into the weights, rounded to bf16; the run sampled it as a side
        # branch (H200: mean 0.77 of 255 apart, max 8, against 20.6 from the untrained sample)
        assert apart.mean() < 0.1 * moved.mean(), (apart.mean(), moved.mean())
    else:
        assert apart.max() <= 2
    assert moved.max() > 10, "the LoRA should have changed the sample"
    # Sampling leaves training alone: the same LoRA as the run without samples.
    same, _ = lora_format.load_lora(tmp_path / "runs" / "sampled" / "sampled.safetensors")
    theirs, _ = lora_format.load_lora(tmp_path / "runs" / "plain" / "plain.safetensors")
    assert same_lora(same, theirs)


def test_sample_settings_are_outside_the_run_and_its_resume(tmp_path, monkeypatch, same_kernels):
    """Headless: a run stopped at step 2 resumes under other sample settings (other prompts, every step) to
    the LoRA it would have trained straight, sampling from where it resumed (no second 'before' sample).
    The node: its run folder's name (the settings hash) ignores every sample_* setting."""
    straight = klein_run(
        tmp_path,
        "straight",
        extra='sample_prompts = ["a red cube"]\nsample_steps = 1\nsample_width = 64\nsample_height = 64\n',
    )
    assert train_config(str(straight), False, loaders=tiny_loaders) == 0
    first = klein_run(
        tmp_path,
        "resumed",
        steps=2,
        extra='sample_prompts = ["a red cube"]\nsample_steps = 1\nsample_width = 64\nsample_height = 64\n',
    )
    assert train_config(str(first), False, loaders=tiny_loaders) == 0
    second = klein_run(
        tmp_path,
        "resumed",
        extra=f"sample_prompts = {PROMPTS}\nsample_every = 1\nsample_steps = 1\n"
        "sample_width = 64\nsample_height = 64\nsample_walk_seed = false\n",
    )
    assert train_config(str(second), True, loaders=tiny_loaders) == 0
    samples = tmp_path / "runs" / "resumed" / "samples"
    assert sorted(p.name for p in samples.iterdir()) == [
        "grid.png",
        "step-000000-p0.png",
        "step-000002-p0.png",
        "step-000003-p0.png",
        "step-000003-p1.png",
        "step-000004-p0.png",
        "step-000004-p1.png",
    ]
    import kiln_pack.trainer.samples.grid as grid_module

    with Image.open(samples / "grid.png") as grid:  # the resumed run's grid keeps the rows of steps 0 and 2
        assert grid.height == grid_module.HEADER_PX + 4 * (64 + grid_module.GAP_PX)
    theirs, _ = lora_format.load_lora(tmp_path / "runs" / "straight" / "straight.safetensors")
    ours, _ = lora_format.load_lora(tmp_path / "runs" / "resumed" / "resumed.safetensors")
    assert same_lora(ours, theirs)

    monkeypatch.setattr(run_module, "dataset_identity", lambda dataset: "one dataset")
    cfg = config_module.from_dict({"arch": "flux2_klein", "rank": 4})
    other_samples = config_module.replace(
        cfg,
        sample_prompts=["a cat", {"prompt": "a dog", "seed": 3}],
        sample_every=7,
        sample_first=False,
        sample_seed=1,
        sample_walk_seed=False,
        sample_negative="x",
        sample_steps=3,
        sample_cfg=2.0,
        sample_sampler="ddim",
        sample_scheduler="beta",
        sample_width=512,
        sample_height=768,
    )
    assert run_module.run_identity(other_samples, None, None) == run_module.run_identity(cfg, None, None)
    assert run_module.run_identity(config_module.replace(cfg, rank=8), None, None) != run_module.run_identity(
        cfg, None, None
    )
    assert not set(config_module.SAMPLE_FIELDS) & set(tn.OPTION_FIELDS)


def test_a_sampler_comfyui_does_not_know_is_refused_before_loading(tmp_path):
    config = klein_run(tmp_path, "bad", extra='sample_prompts = ["a cat"]\nsample_sampler = "eulerr"\n')

    def loaders(cfg):
        raise AssertionError("loaded models for a config that names an unknown sampler")

    with pytest.raises(
        SystemExit, match="bad.toml: sample_sampler 'eulerr' is not a sampler of this ComfyUI; choose one of \\['euler'"
    ):
        train_config(str(config), False, loaders=loaders)


def test_wan21_i2v_is_refused_before_loading_with_the_comfyui_route(tmp_path):
    """Headless training loads no CLIP vision model, so it cannot give Wan 2.1 I2V its start images' features."""
    config = klein_run(tmp_path, "i2v")
    config.write_text(config.read_text().replace('arch = "flux2_klein"', 'arch = "wan21_i2v"'), encoding="utf-8")

    def loaders(cfg):
        raise AssertionError("loaded models for a run headless training cannot feed")

    with pytest.raises(SystemExit, match="i2v.toml: wan21_i2v reads .* Kiln Encode Images' clip_vision input"):
        train_config(str(config), False, loaders=loaders)
