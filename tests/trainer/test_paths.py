"""Paths: names that would leave their folder are refused; dataset link loops are named, never followed;
the cache never writes or deletes outside itself."""

from __future__ import annotations

import os

import numpy as np
import pytest
from PIL import Image

from trainer import paths
from trainer.cli.main import main
from trainer.data.cache import Cache
from trainer.data.folder.scan import scan

EMPTY, ABSOLUTE, SEPARATOR = "is empty", "is an absolute path", "has a path separator"
PART = "has an empty, '.', '..' or space-padded part"
CHARACTERS = "has characters other than letters, digits, - _ . and spaces"
# Each name, and the problem paths.check_name names for it
ESCAPES = {
    "../x": PART,
    "a/../../x": PART,
    "/etc/passwd": ABSOLUTE,
    "/tmp/x": ABSOLUTE,
    "~/x": ABSOLUTE,
    "\\\\server\\share\\x": ABSOLUTE,
    "C:\\x": ABSOLUTE,
    "c:x": ABSOLUTE,
    "a\\b": SEPARATOR,
    "": EMPTY,
    "   ": EMPTY,
    ".": PART,
    "..": PART,
    "...": PART,
    "a//b": PART,
    "a/./b": PART,
    "x/": PART,
    " x": PART,
    "x ": PART,
    "a\x00b": CHARACTERS,
    "a\nb": CHARACTERS,
    "a:b": ABSOLUTE,
    "a*b": CHARACTERS,
}


@pytest.mark.parametrize("name,problem", ESCAPES.items(), ids=[repr(name) for name in ESCAPES])
def test_names_that_could_leave_the_folder_are_refused(tmp_path, name, problem):
    """Refused by the name alone, before any path is built: the message names the problem and the fix."""
    with pytest.raises(ValueError) as error:
        paths.inside(tmp_path, name, "Kiln Save LoRA: name", subfolders=True, suffix=".safetensors")
    assert str(error.value) == (
        f"Kiln Save LoRA: name: {name!r} {problem}; give a plain name (letters, digits, "
        "- _ . and spaces, sub-folders with /), not a path that leads outside its folder"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["kiln/my_lora", "my lora v2", "ünïcode-名前", "a.b_c-d"])
def test_plain_names_and_sub_folders_are_kept_inside(tmp_path, name):
    path = paths.inside(tmp_path, name, "name", subfolders=True, suffix=".safetensors")
    assert tmp_path.resolve() in path.parents and path.name.endswith(".safetensors")


def test_a_run_name_is_one_folder(tmp_path):
    with pytest.raises(ValueError, match="run.toml: run_name: 'a/b' has a path separator"):
        paths.inside(tmp_path, "a/b", "run.toml: run_name")
    assert paths.check_name("run-1", "run_name") == "run-1"


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symlinks")
def test_a_link_inside_the_folder_that_points_out_is_refused(tmp_path):
    (tmp_path / "loras").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "loras" / "out").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(ValueError) as error:
        paths.inside(tmp_path / "loras", "out/mine", "Kiln Save LoRA: name", subfolders=True, suffix=".safetensors")
    # a plain name, so refused only once the link is followed: the message says where it led
    root = tmp_path.resolve()
    assert str(error.value) == (
        f"Kiln Save LoRA: name: 'out/mine' leads to {root / 'elsewhere' / 'mine.safetensors'}, "
        f"outside {root / 'loras'} (through a link?); choose another name"
    )
    assert list((tmp_path / "elsewhere").iterdir()) == []


@pytest.mark.parametrize("run_name", ["../escaped", "/tmp/kiln-escaped", "a/b"])
def test_cli_train_refuses_a_run_name_that_leaves_output_dir(tmp_path, capsys, run_name):
    config = tmp_path / "run.toml"
    config.write_text(
        f'arch = "demo"\ndevice = "cpu"\ndataset_dir = "{tmp_path / "data"}"\n'
        f'output_dir = "{tmp_path / "runs"}"\nrun_name = "{run_name}"\n'
    )
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{config}: run_name: {run_name!r}" in err and "plain name" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]  # nothing written anywhere


def _png(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((80, 80, 3), 128, np.uint8)).save(path)
    path.with_suffix(".txt").write_text("a grey square", encoding="utf-8")


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symlinks")
def test_dataset_link_loops_are_named_and_not_followed(tmp_path):
    _png(tmp_path / "a" / "one.png")
    (tmp_path / "a" / "to_b").symlink_to(tmp_path / "b", target_is_directory=True)  # a → b → a
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "to_a").symlink_to(tmp_path / "a", target_is_directory=True)
    report = scan(tmp_path / "a", resolutions=[64])
    assert [item.path for item in report.items] == ["one.png"]
    assert {p.file: p.code for p in report.problems} == {"to_b/to_a": "symlink_loop"}
    (tmp_path / "a" / "self.png").symlink_to(tmp_path / "a" / "self.png")  # a link to itself
    (tmp_path / "a" / "ping").symlink_to(tmp_path / "a" / "pong")  # two links in a ring
    (tmp_path / "a" / "pong").symlink_to(tmp_path / "a" / "ping")
    report = scan(tmp_path / "a", resolutions=[64])
    assert [item.path for item in report.items] == ["one.png"]
    assert {p.file: p.code for p in report.problems} == {
        "to_b/to_a": "symlink_loop",
        "self.png": "symlink_loop",
        "ping": "symlink_loop",
        "pong": "symlink_loop",
    }
    assert all(p.severity == "skipped" for p in report.problems if p.file in ("self.png", "ping"))


def test_cache_keys_are_never_paths(tmp_path):
    cache = Cache(tmp_path / "cache")
    for key in ("../../evil", "/abs/key", "ab/../../x", "", "AB" * 16):
        with pytest.raises(ValueError, match="not a hex digest"):
            cache.put("latents", key, {"latent": np.zeros(2, np.float32)})
    assert not (tmp_path / "cache").exists()


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symlinks")
def test_pruning_the_cache_never_deletes_through_a_link(tmp_path):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / ("cd" + "0" * 62 + ".safetensors")).write_bytes(b"keep me")
    cache = Cache(tmp_path / "cache")
    cache.put("latents", "ab" + "0" * 62, {"latent": np.zeros(2, np.float32)})
    (tmp_path / "cache" / "latents" / "cd").symlink_to(outside, target_is_directory=True)
    cache.clear()
    assert (outside / ("cd" + "0" * 62 + ".safetensors")).read_bytes() == b"keep me"
    assert cache.usage().files == 0
