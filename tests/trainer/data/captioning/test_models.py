"""The transformers captioner on a tiny random Florence-2 (tests/conftest.py): `python -m trainer caption`,
model folders found and refused with a fix, a killed run leaves whole captions and resumes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainer.cli.main import main
from trainer.data.captioning import models as captioners
from trainer.data.captioning.models import (
    list_models,
    resolve_model,
    transformers_captioner,
)

ROOT = Path(__file__).resolve().parents[4]
pytest.importorskip(
    "transformers", reason="the transformers captioner's tests need transformers (pip install -e '.[test]')"
)


def dataset(root: Path, names="abc") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        Image.fromarray(rng.integers(0, 255, (72, 80, 3), dtype=np.uint8)).save(root / f"{name}.png")
    return root


def direct_caption(model_dir: Path, picture: Image.Image, task: str) -> str:
    """What transformers itself makes of the image: Florence-2's documented processor → generate → decode."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, local_files_only=True)
    inputs = processor(text=task, images=picture, return_tensors="pt")
    ids = model.generate(**inputs, max_new_tokens=8)
    return processor.batch_decode(ids, skip_special_tokens=True)[0]


def test_cli_captions_a_folder_with_florence(tiny_florence, tmp_path, capsys):
    root = dataset(tmp_path / "set")
    (root / "b.txt").write_text("mine", encoding="utf-8")
    code = main(["caption", str(root), "--model", str(tiny_florence), "--trigger", "zkw", "--max-tokens", "8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Florence-2 takes task tokens" in out and "<CAPTION>" in out and "2 captions written" in out
    assert (root / "b.txt").read_text(encoding="utf-8") == "mine"
    picture = Image.open(root / "a.png").convert("RGB")
    expected = re.sub(r"\s+", " ", direct_caption(tiny_florence, picture, "<CAPTION>")).strip()
    assert re.fullmatch(r"[a-z ]+", expected)  # the tiny model writes letters: a real caption to compare
    assert (root / "a.txt").read_text(encoding="utf-8") == f"zkw, {expected}\n"
    assert (root / "c.txt").read_text(encoding="utf-8").startswith("zkw, ")


def test_florence_tasks_by_style(tiny_florence):
    picture = Image.new("RGB", (40, 40), "white")
    detailed = transformers_captioner(tiny_florence, style="detailed", max_tokens=8)
    assert "<MORE_DETAILED_CAPTION>" in detailed.note
    assert detailed(picture, "Describe it.") == direct_caption(tiny_florence, picture, "<MORE_DETAILED_CAPTION>")
    assert detailed(picture, "<OCR>") == direct_caption(tiny_florence, picture, "<OCR>")  # a task token is kept
    with pytest.raises(ValueError, match="Florence-2 writes sentences, not tags"):
        transformers_captioner(tiny_florence, style="tags")


def test_model_folders_are_listed_and_bad_ones_refused(tiny_florence, tmp_path):
    llm = tiny_florence.parent
    assert list_models([llm]) == ["Florence-2-tiny"]
    assert resolve_model("Florence-2-tiny", [llm]) == tiny_florence
    with pytest.raises(ValueError, match=r"models/LLM/.*florence-community/Florence-2-base"):
        resolve_model("Florence-3", [llm])

    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(
        json.dumps({"model_type": "my_florence", "auto_map": {"AutoConfig": "configuration_florence2.Florence2Config"}})
    )
    with pytest.raises(ValueError, match="ships its own model code"):
        transformers_captioner(remote)

    from safetensors.torch import load_file, save_file

    partial = tmp_path / "partial"
    partial.mkdir()
    for file in tiny_florence.iterdir():
        (partial / file.name).write_bytes(file.read_bytes())
    weights = load_file(partial / "model.safetensors")
    weights.pop(max(weights))
    save_file(weights, partial / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="weights missing"):
        transformers_captioner(partial)


def test_without_transformers_the_error_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(captioners.MissingDependency, match="pip install"):
        transformers_captioner(tmp_path)


def test_a_killed_run_leaves_whole_captions_and_resumes(tiny_florence, tmp_path):
    root = dataset(tmp_path / "set", names="abcd")
    command = [
        sys.executable,
        "-m",
        "trainer",
        "caption",
        str(root),
        "--model",
        str(tiny_florence),
        "--max-tokens",
        "6",
    ]
    env = {**os.environ, "KILN_FAULT": f"write:{root / 'c.txt'}"}  # SIGKILL with c.txt's bytes not yet renamed
    killed = subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode != 0
    assert sorted(p.name for p in root.glob("*.txt")) == ["a.txt", "b.txt"]
    before = {name: (root / name).read_bytes() for name in ("a.txt", "b.txt")}
    again = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "2 captions written" in again.stdout and "2 image(s) already captioned" in again.stdout
    assert sorted(p.name for p in root.glob("*.txt")) == ["a.txt", "b.txt", "c.txt", "d.txt"]
    assert {name: (root / name).read_bytes() for name in before} == before
