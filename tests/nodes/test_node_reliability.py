"""Reliability through the nodes (COMFYUI_PATH): names that would leave ComfyUI's folders are refused,
and a training adapter or adapter file whose tensors do not fit the model is refused by name
(ComfyUI's own loader would log the mismatch and leave the weight unpatched)."""

from __future__ import annotations

from helpers import comfy_env
import numpy as np
import pytest

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()

from helpers import tiny_comfy as tc  # noqa: E402

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.nodes.run as run
import kiln_pack.nodes.train_nodes as tn
import kiln_pack.nodes.lora_nodes as ln
import kiln_pack.trainer.safetensors_io as safetensors_io

SafetensorsError = safetensors_io.SafetensorsError
QKV = "diffusion_model.double_blocks.0.img_attn.qkv"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tc.tiny_flux2(tmp_path_factory.mktemp("model"))


def _adapter(model, *, in_features_delta=0) -> dict[str, np.ndarray]:
    weight = bridge.diffusion_model(model).double_blocks[0].img_attn.qkv.weight
    out_features, in_features = weight.shape
    return {
        f"{QKV}.lora_A.weight": np.full((4, in_features + in_features_delta), 0.01, np.float32),
        f"{QKV}.lora_B.weight": np.full((out_features, 4), 0.01, np.float32),
    }


@pytest.mark.parametrize("name", ["../escape", "/tmp/abs", "kiln\\\\x", "a/../../b", "C:\\\\x", "~/x"])
def test_save_lora_refuses_names_outside_the_loras_folder(comfy_dirs, model, name):
    lora = bridge.lora_model_from(
        {
            "double_blocks.0.img_attn.qkv": ln.lora_format.LoraWeights(
                A=np.ones((2, 8), np.float32), B=np.zeros((8, 2), np.float32), alpha=2.0
            )
        }
    )
    with pytest.raises(ValueError, match="Kiln Save LoRA: name") as error:
        ln.KilnSaveLoRA.execute(lora, name, "comfy", "bf16")
    assert "plain name" in str(error.value)
    assert sorted(p.name for p in comfy_dirs.iterdir()) == ["input", "loras", "output"]


@pytest.mark.parametrize("run_name", ["../escape", "/tmp/abs", "a/b"])
def test_train_lora_refuses_a_run_name_outside_output_kiln(comfy_dirs, run_name):
    cfg = run.cfg_module.from_dict({"arch": "demo", "run_name": run_name})
    with pytest.raises(ValueError, match=f"Kiln Training Options: run_name: {run_name!r}"):
        run.execute(cfg, None, None, output_root=comfy_dirs / "output" / "kiln")
    assert list((comfy_dirs / "output").iterdir()) == []


def test_load_run_refuses_a_name_that_leaves_output_kiln(comfy_dirs):
    with pytest.raises(ValueError, match="leaves output/kiln"):
        run.resolve_run("../../etc")


def test_load_run_says_a_folder_does_not_exist_and_lists_the_runs_that_do(comfy_dirs):
    kiln = comfy_dirs / "output" / "kiln"
    with pytest.raises(ValueError, match=r"nope does not exist; runs under output/kiln/: none yet"):
        run.resolve_run("nope")
    (kiln / "empty").mkdir(parents=True)  # a folder without a checkpoint is not a run
    (kiln / "done-1a2b" / "step-000010").mkdir(parents=True)
    for name in ("run.json", "state.safetensors"):  # what makes a checkpoint complete (state.list_checkpoints)
        (kiln / "done-1a2b" / "step-000010" / name).write_text("{}", encoding="utf-8")
    with pytest.raises(ValueError, match=r"nope does not exist; runs under output/kiln/: done-1a2b$"):
        run.resolve_run("nope")
    with pytest.raises(ValueError, match=r"empty has no complete checkpoint .* yet; runs with one .*: done-1a2b$"):
        run.resolve_run("empty")
    assert run.resolve_run("done-1a2b") == (kiln / "done-1a2b" / "step-000010").resolve()
    with pytest.raises(ValueError, match=r"done-1a2 does not exist; did you mean 'done-1a2b'\?; runs under"):
        run.resolve_run("done-1a2")


def test_a_misshapen_training_adapter_is_refused_by_name(comfy_dirs, model):
    path = comfy_dirs / "loras" / "bad_adapter.safetensors"
    safetensors_io.write(path, _adapter(model, in_features_delta=3))
    loaded = bridge.load_lora_file(path)
    assert bridge.unmatched_lora_keys(model, loaded)  # ComfyUI alone would only log it
    with pytest.raises(ValueError, match="Kiln Train LoRA: training_adapter 'bad_adapter.safetensors'.*do not fit"):
        tn.KilnTrainLoRA.execute(
            model, None, 2, 1e-3, 4, 4.0, "adamw", "none", "torch", 0, training_adapter="bad_adapter.safetensors"
        )
    with pytest.raises(ValueError, match="Kiln Invert Adapter: adapter_file 'bad_adapter.safetensors'"):
        ln.KilnInvertAdapter.execute(model, "bad_adapter.safetensors", 1.0)
    good = comfy_dirs / "loras" / "good_adapter.safetensors"
    safetensors_io.write(good, _adapter(model))
    assert bridge.unmatched_lora_keys(model, bridge.load_lora_file(good)) == []
    ln.KilnInvertAdapter.execute(model, "good_adapter.safetensors", 1.0)  # the same file, fitting: accepted


def test_a_truncated_adapter_file_names_the_file(comfy_dirs, model):
    path = comfy_dirs / "loras" / "cut_adapter.safetensors"
    safetensors_io.write(path, _adapter(model))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(SafetensorsError, match=r"cut_adapter\.safetensors.*re-download or re-save"):
        ln.KilnInvertAdapter.execute(model, "cut_adapter.safetensors", 1.0)
