"""Preservation through the nodes in a real ComfyUI (COMFYUI_PATH), on a tiny Flux2: Encode Captions caches the
class-word captions (preservation_class), Train LoRA takes a regularisation set on reg_dataset, and a run with
both trains on torch and MLX alike and saves a LoRA ComfyUI's loader reads whole."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from helpers import comfy_env
import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()

from helpers import tiny_comfy as tc

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.nodes.dataset_nodes as dn
import kiln_pack.nodes.train_nodes as tn
import kiln_pack.nodes.run as run


def make_images(folder: Path, count: int, caption: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(caption.format(i=i), encoding="utf-8")


def out(result, index=0):
    return result.result[index] if hasattr(result, "result") else result[index]


def encoded(name: str, trigger: str, repeats: int, vae, clip, preservation_class: str = ""):
    loaded = out(dn.KilnLoadDataset.execute(name, trigger, "", "", "64", repeats, 0.0))
    return out(dn.KilnEncodeCaptions.execute(out(dn.KilnEncodeImages.execute(loaded, vae)), clip, preservation_class))


def test_a_graph_trains_with_dop_and_a_regularisation_set(comfy_dirs, tmp_path_factory):
    model, vae, clip = tc.tiny_flux2(tmp_path_factory.mktemp("f")), tc.tiny_vae(flux2=True), tc.tiny_klein_clip()
    make_images(comfy_dirs / "input" / "subject", 3, "{{trigger}}, a photo number {i}", seed=0)
    make_images(comfy_dirs / "input" / "people", 2, "a photo of a person, number {i}", seed=1)
    with pytest.raises(ValueError, match="Kiln Encode Captions: preservation_class 'person'.*no trigger word"):
        encoded("subject", "", 1, vae, clip, "person")
    subject = encoded("subject", "ohwx", 1, vae, clip, "person")
    assert "person, a photo number 0" in subject.texts() and subject.preservation_class == "person"
    people = encoded("people", "", 2, vae, clip)
    options = {
        "device": "cpu",
        "mixed_precision": "no",
        "checkpoint_every": 0,
        "gradient_checkpointing": False,
        "preservation_weight": 1.0,
        "reg_weight": 0.5,
    }
    curves = {}
    for backend in ("torch", "mlx"):
        if backend == "mlx" and importlib.util.find_spec("mlx") is None:
            continue
        result = tn.KilnTrainLoRA.execute(
            model,
            subject,
            steps=6,
            learning_rate=1e-3,
            rank=4,
            alpha=4.0,
            optimizer="adamw",
            preset="none",
            backend=backend,
            seed=1,
            options={**options, "run_name": f"preserve_{backend}"},
            reg_dataset=people,
        )
        _, lora, state, _, _ = result.result
        assert state.step == 6 and all(np.isfinite(state.history.loss))
        assert state.config["preservation_class"] == "person" and state.config["preservation_weight"] == 1.0
        assert Path(state.config["reg_dataset_dir"]).name == "people" and state.config["reg_repeats"] == 2
        assert bridge.unmatched_lora_keys(model, lora) == []
        curves[backend] = np.array(state.history.loss)
    if "mlx" in curves:
        np.testing.assert_allclose(curves["mlx"], curves["torch"], rtol=1e-3)
    # The regularisation set and the class word are part of what a run is: other run folders without them.
    assert run.dataset_identity(subject.with_regularisation(people)) != run.dataset_identity(subject)
    assert run.dataset_identity(subject) != run.dataset_identity(subject.with_preservation(""))
    with pytest.raises(ValueError, match="preservation_class.*Kiln Encode Captions"):
        tn.KilnTrainLoRA.execute(
            model,
            subject.with_preservation(""),
            steps=2,
            learning_rate=1e-3,
            rank=4,
            alpha=4.0,
            optimizer="adamw",
            preset="none",
            backend="torch",
            seed=1,
            options={**options, "run_name": "no_class"},
        )
