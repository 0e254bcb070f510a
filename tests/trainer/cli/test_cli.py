"""`python -m trainer` as a user runs it: demo, resume, inspect, export, estimate, train, --help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]


def cli(*args, cwd=ROOT, env=None):
    return subprocess.run(
        [sys.executable, "-m", "trainer", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A short demo stopped part-way, then resumed: the user's two commands."""
    out = tmp_path_factory.mktemp("demo")
    first = cli("demo", "--output", out, "--steps", 12, "--stop-after", 6)
    assert first.returncode == 0, first.stderr
    assert "stopped at step 6/12" in first.stdout
    assert "[Kiln] memory plan: " in first.stderr  # what auto chose, though the CLI has no log handler
    second = cli("demo", "--output", out, "--steps", 12, "--resume")
    assert second.returncode == 0, second.stderr
    assert "finished at step 12/12" in second.stdout
    return out / "demo"


def test_demo_writes_lora_run_folder_and_curve(demo_run):
    assert (demo_run / "demo_lora.safetensors").is_file()
    assert (demo_run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (demo_run / "step-000012" / "run.json").is_file()
    assert len(list((demo_run / "dataset").glob("*.png"))) == 12
    info = json.loads((demo_run / "step-000012" / "run.json").read_text())
    assert len(info["history"]["loss"]) == 12  # the resumed run kept the first six losses


def test_inspect_and_export(demo_run, tmp_path):
    shown = cli("inspect", demo_run / "demo_lora.safetensors", "--json")
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert info["format"] == "comfy" and 16 in info["ranks"]
    for fmt in ("diffusers", "kohya"):
        target = tmp_path / f"{fmt}.safetensors"
        exported = cli("export", demo_run / "demo_lora.safetensors", "--format", fmt, "-o", target)
        assert exported.returncode == 0, exported.stderr
        assert json.loads(cli("inspect", target, "--json").stdout)["format"] == fmt
    text = cli("inspect", demo_run / "demo_lora.safetensors").stdout
    assert "format         comfy" in text and "modules by block:" in text and "totals: " in text


def _small_lora(path, fmt="comfy"):
    from trainer.lora import files as lf

    lora = {
        name: lf.LoraWeights(np.ones((4, 8), np.float32), np.zeros((8, 4), np.float32), 4.0)
        for name in (
            "double_blocks.0.img_attn.qkv",
            "double_blocks.0.img_attn.proj",
            "double_blocks.10.txt_mlp.0",
            "double_blocks.2.img_attn.qkv",
            "img_in",
        )
    }
    metadata = lf.build_metadata(
        arch_name="flux2_klein",
        config={"rank": 4, "learning_rate": 3e-4, "steps": 1000},
        steps=1000,
        trigger_words=["ohwx"],
        title="mine",
    )
    lf.save_lora(path, lora, arch="flux2_klein", fmt=fmt, metadata=metadata)
    return path


def test_export_refuses_to_overwrite_without_overwrite(tmp_path):
    src, dst = _small_lora(tmp_path / "src.safetensors"), tmp_path / "dst.safetensors"
    dst.write_bytes(b"mine")
    refused = cli("export", src, "--format", "kohya", "-o", dst)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr == f"error: {dst} already exists; pass --overwrite to replace it, or choose another -o\n"
    assert dst.read_bytes() == b"mine"
    replaced = cli("export", src, "--format", "kohya", "-o", dst, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads(cli("inspect", dst, "--json").stdout)["format"] == "kohya"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst.safetensors", "src.safetensors"]  # no temp file left


@pytest.mark.parametrize("fmt", ["comfy", "kohya"])
def test_inspect_prints_metadata_settings_and_modules_by_block(tmp_path, fmt):
    path = _small_lora(tmp_path / "lora.safetensors", fmt)
    result = cli("inspect", path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "  arch           flux2_klein" in lines and "  steps          1000" in lines
    assert "  trigger words  ohwx" in lines and "  modelspec.title = mine" in lines
    assert (
        "  rank = 4" in lines and "  learning_rate = 0.0003" in lines and "  steps = 1000" not in lines
    )  # the default
    blocks = lines[lines.index("modules by block:") + 1 : -1]
    assert blocks == [
        "  double_blocks.0: img_attn.proj r4 α4 bf16, img_attn.qkv r4 α4 bf16",
        "  double_blocks.2: img_attn.qkv r4 α4 bf16",
        "  double_blocks.10: txt_mlp.0 r4 α4 bf16",
        "  other: img_in r4 α4 bf16",
    ]
    assert lines[-1] == "totals: 5 modules, 320 parameters, ranks 4, alphas 4, dtypes BF16, F32"


def test_estimate_prints_a_table(tmp_path):
    config = tmp_path / "klein.toml"
    config.write_text('arch = "flux2_klein"\nresolutions = [512, 1024]\nrank = 32\n')
    result = cli("estimate", config, "--variant", "flux2-klein-4b", "--memory-gb", 24)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("GiB") >= 4 and "1024 px" in result.stdout and "fits in 24 GiB" in result.stdout


def test_estimate_counts_a_clips_frames(tmp_path):
    """Wan at 480 px: 81 frames are 21 latent frames of 30 x 30 tokens; MLX has no video model."""
    config = tmp_path / "wan.toml"
    config.write_text('arch = "wan21_t2v"\nresolutions = [480]\n')
    clip = cli("estimate", config, "--variant", "wan2.1-t2v-14b", "--frames", 81)
    assert clip.returncode == 0, clip.stderr
    assert "480 px × 81 frames" in clip.stdout and f"{21 * 30 * 30 + 512} tokens per step" in clip.stdout
    mlx = cli("estimate", config, "--frames", 81, "--backend", "mlx")
    assert mlx.returncode != 0 and "--backend torch" in mlx.stderr


def test_estimate_says_what_the_held_out_loss_costs(tmp_path):
    config = tmp_path / "klein.toml"
    config.write_text('arch = "flux2_klein"\nholdout = 0.1\nholdout_sigmas = 4\nbatch_size = 2\n')
    result = cli("estimate", config, "--variant", "flux2-klein-4b")
    assert result.returncode == 0, result.stderr
    assert "note: held-out loss (holdout 0.1): forward passes without gradients" in result.stdout
    assert "2 pass(es) per held-out image every 100 steps" in result.stdout


def test_estimate_shows_what_the_auto_budget_picks_on_a_gpu(tmp_path):
    """checkpoint_budget auto (the default): on a 24 GiB GPU a Z-Image 1024 px step keeps little (weights
    11.5 GiB, 4 GiB margin, the estimate counted 1.25x); on an 80 GiB one everything; with no --memory-gb
    it says so."""
    config = tmp_path / "zimage.toml"
    config.write_text('arch = "zimage_turbo"\nresolutions = [1024]\n')
    small, large, unsaid = (cli("estimate", config, *args) for args in (("--memory-gb", 24), ("--memory-gb", 80), ()))
    assert small.returncode == large.returncode == unsaid.returncode == 0, small.stderr
    assert "checkpoint_budget auto → 0.1 on a 24 GiB GPU" in small.stdout and "(checkpoint budget 0.1)" in small.stdout
    assert "checkpoint_budget auto → 1 on a 80 GiB GPU" in large.stdout
    assert "Give --memory-gb to see what a GPU would get" in unsaid.stdout


def test_estimate_names_the_step_graphs_pool(tmp_path):
    """step_graphs (auto on a CUDA GPU where it fits): the pool of the recorded small steps is named beside the
    table, twice the 768 px step's need here; not where every bucket is large, not on MLX, not when off."""

    def run(text, *args):
        config = tmp_path / "run.toml"
        config.write_text(f'arch = "flux2_klein"\n{text}\n')
        result = cli("estimate", config, "--variant", "flux2-klein-4b", *args)
        assert result.returncode == 0, result.stderr
        return result.stdout

    mixed = run("resolutions = [512, 768, 1024]")
    assert "note: step_graphs on a CUDA GPU: steps of up to 800x800 px replay as CUDA graphs" in mixed
    assert "where it fits beside the largest step (auto" in mixed
    pool = float(mixed.split("memory pool of ~")[1].split(" GiB")[0])
    from trainer.estimate.torch_step import GRAPH_POOL_FACTOR, estimate

    at_800 = estimate("flux2-klein-4b", resolution=800)
    assert pool == pytest.approx(GRAPH_POOL_FACTOR * (at_800.total - at_800.weights) / 2**30, abs=0.06)
    assert "where it fits" not in run("resolutions = [512]\nstep_graphs = true")
    assert "step_graphs" not in run("resolutions = [1024]")
    assert "step_graphs" not in run("resolutions = [512]\nstep_graphs = false")
    assert "step_graphs" not in run('resolutions = [512]\nbackend = "mlx"')


def test_estimate_for_a_mac(tmp_path):
    config = tmp_path / "zimage.toml"
    config.write_text('arch = "zimage"\nbackend = "mlx"\nbase_quantize = "int4"\nresolutions = [1024]\n')
    result = cli("estimate", config, "--variant", "zimage", "--memory-gb", 32)
    assert result.returncode == 0, result.stderr
    assert "base int4" in result.stdout and "backend mlx" in result.stdout and "fits in a 32 GB Mac" in result.stdout


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_estimate_counts_an_edit_datasets_references_on_both_backends(tmp_path, backend):
    for folder in ("control", "control_2"):
        (tmp_path / "edit" / folder).mkdir(parents=True)
    config = tmp_path / "edit.toml"
    config.write_text(
        f'arch = "flux2_klein"\nbackend = "{backend}"\ndataset_dir = "{tmp_path / "edit"}"\nresolutions = [512]\n'
    )
    result = cli("estimate", config, "--variant", "flux2-klein-4b")
    assert result.returncode == 0, result.stderr
    assert "3072 image + 512 text tokens per sample" in result.stdout
    assert "(2 reference images included)" in result.stdout
    assert ("backend mlx" in result.stdout) == (backend == "mlx")


def test_estimate_from_the_arch_when_model_path_is_missing(tmp_path):
    config = tmp_path / "turbo.toml"
    config.write_text(f'arch = "zimage_turbo"\nmodel_path = "{tmp_path / "gone.safetensors"}"\nresolutions = [512]\n')
    result = cli("estimate", config)
    assert result.returncode == 0, result.stderr
    assert "Memory estimate: zimage, 512 px" in result.stdout
    assert "gone.safetensors not found, so not read; estimated from arch zimage_turbo" in result.stdout


def test_estimate_takes_an_arch_name_as_variant(tmp_path):
    config = tmp_path / "turbo.toml"
    config.write_text('arch = "zimage_turbo"\nresolutions = [512]\n')
    same = cli("estimate", config, "--variant", "zimage")
    by_arch = cli("estimate", config, "--variant", "zimage_turbo")
    assert by_arch.returncode == 0, by_arch.stderr
    assert by_arch.stdout == same.stdout  # one variant: nothing to say


def test_estimate_of_a_family_with_several_sizes_says_which(tmp_path):
    config = tmp_path / "klein.toml"
    config.write_text('arch = "flux2_klein"\nresolutions = [512]\n')
    for args in ((), ("--variant", "flux2_klein")):
        result = cli("estimate", config, *args)
        assert result.returncode == 0, result.stderr
        assert "Memory estimate: flux2-klein-4b, 512 px" in result.stdout
        assert (
            "note: flux2_klein comes in flux2-klein-4b, flux2-klein-9b; estimated the smallest, "
            "flux2-klein-4b; pick another with --variant flux2-klein-9b"
        ) in result.stdout


def test_estimate_unknown_variant_lists_both_vocabularies(tmp_path):
    config = tmp_path / "klein.toml"
    config.write_text('arch = "flux2_klein"\n')
    result = cli("estimate", config, "--variant", "flux3")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "error: unknown --variant 'flux3'" in result.stderr
    assert "flux2-klein-9b" in result.stderr and "zimage_turbo" in result.stderr and "qwen_image" in result.stderr


def test_train_demo_arch_from_a_config(tmp_path, demo_run):
    config = tmp_path / "run.toml"
    config.write_text(
        f'arch = "demo"\ndevice = "cpu"\nmixed_precision = "no"\nsteps = 3\nrank = 4\nalpha = 4.0\n'
        f'dataset_dir = "{demo_run / "dataset"}"\noutput_dir = "{tmp_path / "runs"}"\n'
        f'run_name = "mine"\nresolutions = [128]\ncheckpoint_every = 0\n'
    )
    result = cli("train", config)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "runs" / "mine" / "mine.safetensors").is_file()
    assert (tmp_path / "runs" / "mine" / "step-000003").is_dir()


NO_COMFYUI = (
    "this architecture trains ComfyUI's own model code, and ComfyUI is not importable here: set "
    "COMFYUI_PATH to a ComfyUI checkout (0.17 or newer) and run again, or use arch 'demo' to try the "
    "trainer without it"
)


def test_train_comfy_arch_without_comfyui_says_what_to_do(tmp_path):
    config = tmp_path / "klein.toml"
    config.write_text('arch = "flux2_klein"\n')
    env = {k: v for k, v in os.environ.items() if k != "COMFYUI_PATH"}
    result = cli("train", config, env=env)
    # SystemExit(message): exit status 1, the message alone on stderr, nothing started
    assert (result.returncode, result.stdout, result.stderr) == (1, "", NO_COMFYUI + "\n")


def test_bad_config_is_a_clear_error(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("rank = 0\n")
    result = cli("train", config)
    assert result.returncode == 2 and "bad.toml: rank must be in 1..256, got 0" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "command,options",
    [
        ("demo", ["--output", "--resume", "--steps", "--stop-after"]),
        ("train", ["config", "--resume"]),
        ("estimate", ["--variant", "--backend", "--base-dtype", "--memory-gb"]),
        ("export", ["--format", "--output", "--arch"]),
        ("export", ["--overwrite"]),
        ("inspect", ["lora", "--json"]),
    ],
)
def test_help_documents_every_option(command, options):
    result = cli(command, "--help")
    assert result.returncode == 0
    for option in options:
        assert option in result.stdout


def test_train_names_skipped_files_in_the_log(tmp_path, demo_run):
    import shutil

    dataset = tmp_path / "ds"
    shutil.copytree(demo_run / "dataset", dataset, ignore=shutil.ignore_patterns(".kiln_cache"))
    (dataset / "empty.png").write_bytes(b"")
    config = tmp_path / "run.toml"
    config.write_text(
        f'arch = "demo"\ndevice = "cpu"\nmixed_precision = "no"\nsteps = 2\nrank = 4\nalpha = 4.0\n'
        f'dataset_dir = "{dataset}"\noutput_dir = "{tmp_path / "runs"}"\nrun_name = "x"\n'
        f"resolutions = [128]\ncheckpoint_every = 0\n"
    )
    result = cli("train", config)
    assert result.returncode == 0, result.stderr
    assert "zero_byte" in result.stderr and "empty.png" in result.stderr


def test_check_dataset_on_the_demo_folder(demo_run):
    result = cli("check-dataset", demo_run / "dataset", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["usable"] == 12 and report["ok"] is True


def test_presets_lists_each_preset_its_line_and_the_settings_it_sets():
    from trainer.config import PRESET_LINES, PRESETS

    done = cli("presets")
    assert done.returncode == 0, done.stderr
    blocks = done.stdout.strip().split("\n\n")
    assert [block.splitlines()[0] for block in blocks] == list(PRESETS)  # every preset, in order, by name
    for block, (name, settings) in zip(blocks, PRESETS.items()):
        _, line, sets = block.splitlines()
        assert line.strip() == PRESET_LINES[name]
        assert sets.strip().startswith("sets: ") and all(f"{key} " in sets for key in settings)
    assert "learning_rate 0.0001" in blocks[list(PRESETS).index("klein_base")]
    assert "training_adapter" in blocks[list(PRESETS).index("zimage_turbo")]  # says to connect the adapter
