"""Headless validation samples, the library's side (#17 item 9): the sample_* settings and sample_prompts
(strings with ai-toolkit's flags, or tables) are checked with errors that name the prompt, the key and the
fix; the plan resolves each prompt's settings (its own, else sample_*, else the model family's); files are
named by step and prompt, PNGs carrying their settings. The sampling itself is ComfyUI's:
tests/test_headless.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from trainer import config as config
from trainer.archs import ARCHS
from trainer.config import ConfigError, from_dict
from trainer.config import files as config_file
from trainer.samples.plan import SamplePrompt, sample_path, sample_plan, save_sample


def turbo(**values):
    return from_dict({"arch": "zimage_turbo", **values})


def test_the_plan_takes_a_prompts_own_settings_then_sample_settings_then_the_familys():
    cfg = turbo(
        sample_prompts=[
            "ohwx at the beach",
            "ohwx --n blurry, dark --w 768 --h 1024 --seed 7 --cfg 4 --steps 20",
            {"prompt": "ohwx, portrait", "negative": "", "cfg": 2, "width": 512},
        ],
        sample_negative="lowres",
        sample_seed=100,
        sample_height=640,
    )
    beach, flags, table = sample_plan(cfg)
    # Z-Image Turbo's own: 8 res_multistep steps at cfg 1 (the example workflow's), walk seed on.
    assert beach == SamplePrompt(
        index=0,
        prompt="ohwx at the beach",
        negative="lowres",
        seed=100,
        steps=8,
        cfg=1.0,
        sampler_name="res_multistep",
        scheduler="simple",
        width=1024,
        height=640,
    )
    assert (flags.prompt, flags.negative, flags.width, flags.height, flags.seed, flags.cfg, flags.steps) == (
        "ohwx",
        "blurry, dark",
        768,
        1024,
        7,
        4.0,
        20,
    )
    assert (table.negative, table.seed, table.cfg, table.width, table.height) == ("", 102, 2.0, 512, 640)
    fixed = sample_plan(
        config.replace(
            cfg, sample_walk_seed=False, sample_steps=3, sample_cfg=1.5, sample_sampler="euler", sample_scheduler="beta"
        )
    )
    assert [p.seed for p in fixed] == [100, 7, 100] and fixed[2].cfg == 2.0
    assert (fixed[0].steps, fixed[0].cfg, fixed[0].sampler_name, fixed[0].scheduler) == (3, 1.5, "euler", "beta")
    assert sample_plan(turbo()) == []


def test_sampling_defaults_are_family_facts():
    assert {
        name: (a.sampling.steps, a.sampling.cfg, a.sampling.sampler) for name, a in ARCHS.items() if a.clip_type
    } == {
        "flux2_klein": (20, 1.0, "euler"),
        "flux2_dev": (20, 1.0, "euler"),
        "zimage_turbo": (8, 1.0, "res_multistep"),
        "zimage": (30, 4.0, "res_multistep"),
        "qwen_image": (20, 2.5, "euler"),
        "wan21_i2v": (20, 6.0, "uni_pc"),
        "wan21_t2v": (30, 6.0, "uni_pc"),
        "wan22_ti2v_5b": (20, 5.0, "uni_pc"),
        "wan22_t2v_high": (20, 3.5, "euler"),
        "wan22_t2v_low": (20, 3.5, "euler"),
        "wan22_i2v_high": (20, 3.5, "euler"),
        "wan22_i2v_low": (20, 3.5, "euler"),
        "chroma": (26, 3.5, "euler"),
        "lumina2": (30, 4.0, "res_multistep"),
    }
    base = sample_plan(from_dict({"arch": "zimage", "sample_prompts": ["x"]}))[0]
    assert (base.steps, base.cfg) == (30, 4.0)


@pytest.mark.parametrize(
    "values,message",
    [
        ({"sample_prompts": "a cat"}, r"sample_prompts must be a list of prompts \(strings or tables\), got str"),
        ({"sample_prompts": [3]}, r"sample_prompts\[0\] must be a string or a table"),
        (
            {"sample_prompts": ["a", {"promt": "b"}]},
            r"sample_prompts\[1\]: unknown key\(s\) 'promt' \(did you mean 'prompt'\?\)",
        ),
        ({"sample_prompts": [{"seed": 1}]}, r"sample_prompts\[0\]: a prompt table needs prompt = "),
        ({"sample_prompts": [{"prompt": 5}]}, r"sample_prompts\[0\]: prompt must be str, got int"),
        ({"sample_prompts": ["  "]}, r"sample_prompts\[0\]: the prompt text is empty"),
        ({"sample_prompts": ["--w 512"]}, r"sample_prompts\[0\]: the prompt text is empty"),
        ({"sample_prompts": ["a cat --w wide"]}, r"sample_prompts\[0\]: --w needs a whole number, got 'wide'"),
        ({"sample_prompts": ["a cat --cfg x"]}, r"sample_prompts\[0\]: --cfg needs a number, got 'x'"),
        ({"sample_prompts": ["a cat --m 1.0"]}, r"sample_prompts\[0\]: unknown flag --m; a prompt string takes --n"),
        (
            {"sample_prompts": [{"prompt": "a", "seed": -1}]},
            r"sample_prompts\[0\]: seed must be in 0..4294967295, got -1",
        ),
        ({"sample_prompts": [{"prompt": "a", "steps": 500}]}, r"sample_prompts\[0\]: steps must be in 0..200, got 500"),
        ({"sample_prompts": [{"prompt": "a", "cfg": True}]}, r"sample_prompts\[0\]: cfg must be float, got a boolean"),
        (
            {"sample_prompts": [{"prompt": "a", "cfg": float("nan")}]},
            r"sample_prompts\[0\]: cfg must be a finite number",
        ),
        (
            {"sample_prompts": ["a --h 1000"]},
            r"sample_prompts\[0\]: height 1000 must be a multiple of 16 for zimage_turbo "
            r"\(e.g. 992\)",
        ),
        ({"sample_width": 1000}, r"sample_width 1000 must be a multiple of 16"),
        ({"sample_width": 32}, r"sample_width must be in 64..4096, got 32"),
        ({"sample_every": -1}, r"sample_every must be in 0..1000000"),
        (
            {"sample_sampler": "euler a"},
            r"sample_sampler must be a ComfyUI sampler name \(e.g. euler, simple\) or auto",
        ),
        (
            {"arch": "demo", "sample_prompts": ["a cat"]},
            r"sample_prompts: arch 'demo' has no ComfyUI text encoder to "
            r"sample with .*leave sample_prompts empty",
        ),
    ],
)
def test_sample_settings_are_checked_with_errors_that_say_the_fix(values, message):
    with pytest.raises(ConfigError, match=message):
        from_dict({"arch": "zimage_turbo", **values})


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_sample_prompts_round_trip_through_config_files(tmp_path, suffix):
    cfg = turbo(
        sample_prompts=['a "quoted" cat --n dark --seed 3', {"prompt": "ñ dog", "cfg": 4, "width": 768}],
        sample_every=100,
    )
    assert cfg.sample_prompts[1]["cfg"] == 4.0
    path = tmp_path / f"run{suffix}"
    config_file.save(cfg, path)
    assert config_file.load(path) == cfg


def test_an_array_of_tables_is_a_list_of_prompts(tmp_path):
    """TOML's [[sample_prompts]] (after the top-level keys) is the same as the inline list."""
    path = tmp_path / "run.toml"
    path.write_text(
        'arch = "zimage_turbo"\nsample_every = 50\n\n[[sample_prompts]]\nprompt = "a cat"\nseed = 1\n\n'
        '[[sample_prompts]]\nprompt = "a dog"\nwidth = 512\nheight = 768\n',
        encoding="utf-8",
    )
    cfg = config_file.load(path)
    assert cfg.sample_prompts == [{"prompt": "a cat", "seed": 1}, {"prompt": "a dog", "width": 512, "height": 768}]
    assert [(p.seed, p.width, p.height) for p in sample_plan(cfg)] == [(1, 1024, 1024), (43, 512, 768)]


def test_samples_are_named_by_step_and_prompt_and_carry_their_settings(tmp_path):
    assert sample_path(tmp_path, 250, 0, 2) == tmp_path / "samples" / "step-000250-p0.png"
    assert sample_path(tmp_path, 0, 3, 12).name == "step-000000-p03.png"  # p00..p11 sort by prompt
    prompt = sample_plan(turbo(sample_prompts=["ohwx --n blurry"]))[0]
    image = np.linspace(-0.1, 1.1, 16 * 32 * 3, dtype=np.float32).reshape(16, 32, 3)
    path = save_sample(sample_path(tmp_path, 250, 0, 1), image, prompt, step=250, arch="zimage_turbo")
    with Image.open(path) as saved:
        pixels, text = np.asarray(saved), dict(saved.text)
    assert np.array_equal(pixels, np.clip(255.0 * image, 0, 255).astype(np.uint8))  # SaveImage's bytes
    assert text["parameters"] == (
        "ohwx\nNegative prompt: blurry\nSteps: 8, Sampler: res_multistep simple, "
        "CFG scale: 1, Seed: 42, Size: 1024x1024, Kiln step: 250"
    )
    assert json.loads(text["kiln.sample"]) == {
        "step": 250,
        "arch": "zimage_turbo",
        "index": 0,
        "prompt": "ohwx",
        "negative": "blurry",
        "seed": 42,
        "steps": 8,
        "cfg": 1.0,
        "sampler_name": "res_multistep",
        "scheduler": "simple",
        "width": 1024,
        "height": 1024,
    }
    assert sorted(p.name for p in path.parent.iterdir()) == ["step-000250-p0.png"]  # no temp file left


def test_the_readmes_config_examples_load():
    """The manual's TOML examples are valid configs (the [[sample_prompts]] one under a Z-Image Turbo run)."""
    import re

    from helpers.paths import REPO as root

    readme = "\n".join(
        p.read_text(encoding="utf-8") for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    )
    blocks = re.findall(r"```toml\n(.*?)```", readme, re.S)
    assert any("sample_prompts" in b for b in blocks) and any("[[sample_prompts]]" in b for b in blocks)
    for block in blocks:
        cfg = from_dict({"arch": "zimage_turbo", **config_file.tomllib.loads(block)})
        assert sample_plan(cfg) or "sample_prompts" not in block
