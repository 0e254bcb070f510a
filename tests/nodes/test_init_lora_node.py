"""Kiln Train LoRA started from an existing LoRA (#19 item 4), in a real ComfyUI: a LORA_MODEL input or a
file from models/loras; the output LoRA's metadata names where it started and loads in ComfyUI's loader."""

from __future__ import annotations

import json

from helpers import comfy_env
import numpy as np
import pytest

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()

from helpers import tiny_comfy as tc
from helpers.node_runs import encoded_dataset, out, train

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.nodes.lora_nodes as ln
import kiln_pack.trainer.safetensors_io as safetensors_io
import kiln_pack.trainer.lora.files as lora_format
import kiln_pack.trainer.run.init_lora as init_lora
import kiln_pack.trainer.lora.sources as lora_sources


@pytest.fixture(scope="module")
def flux2(comfy_dirs, tmp_path_factory):
    model, vae, clip = tc.tiny_flux2(tmp_path_factory.mktemp("init")), tc.tiny_vae(flux2=True), tc.tiny_klein_clip()
    return model, encoded_dataset(comfy_dirs, vae, clip, "ds_init")


def near(trained: dict, start: dict, bound: float) -> bool:
    return all(
        np.abs(trained[k].A - start[k].A).max() <= bound and np.abs(trained[k].B - start[k].B).max() <= bound
        for k in start
    )


def test_train_lora_continues_a_lora_model_and_names_it(comfy_dirs, flux2):
    model, ds = flux2
    first = train(model, ds, steps=3, options={"run_name": "init_first"})
    start_lora = first.result[1]
    start = bridge.lora_weights_from(start_lora, "flux2_klein")
    result = train(model, ds, steps=1, init_lora=start_lora, options={"run_name": "init_second"})
    _, lora, state, _, _ = result.result
    assert state.config["rank"] == 4 and state.config["init_lora"] == "LORA_MODEL"
    # One AdamW step (lr 1e-3) from the input's weights, not from a new LoRA's random A.
    assert near(state.lora, start, 1.2e-3) and not near(state.lora, start, 0.0)
    path = out(ln.KilnSaveLoRA.execute(lora, "kiln/from_init", "comfy", "fp32", "", "", False, state))
    _, metadata = safetensors_io.read(path)
    recorded = json.loads(metadata["kiln.init_lora"])
    expected = init_lora.tensors_sha256(bridge.lora_arrays(start_lora))
    assert recorded == {"name": "LORA_MODEL", "sha256": expected}
    assert bridge.unmatched_lora_keys(model, bridge.load_lora_file(path)) == []
    _, checkpoint_metadata = safetensors_io.read(f"{state.checkpoint}/lora.safetensors")
    assert json.loads(checkpoint_metadata["kiln.init_lora"]) == recorded


def test_train_lora_starts_from_a_file_of_another_layout(comfy_dirs, flux2):
    model, ds = flux2
    first = train(model, ds, steps=2, options={"run_name": "init_source"})
    weights = bridge.lora_weights_from(first.result[1], "flux2_klein")
    for w in weights.values():
        w.alpha = 2.0  # rank 4, alpha 2: the file's alpha, not the node's 4
    name = "kiln/start_kohya.safetensors"
    lora_format.save_lora(
        comfy_dirs / "loras" / name, weights, arch="flux2_klein", fmt="kohya", dtype="fp32", metadata={}
    )
    bridge.refresh_loras()
    result = train(model, ds, steps=1, init_lora_file=name, options={"run_name": "init_file"})
    state = result.result[2]
    assert (state.config["rank"], state.config["alpha"]) == (4, 2.0)
    assert near(state.lora, weights, 1.2e-3)
    _, metadata = safetensors_io.read(f"{state.checkpoint}/lora.safetensors")
    assert json.loads(metadata["kiln.init_lora"]) == lora_sources.file_identity(comfy_dirs / "loras" / name)
    with pytest.raises(ValueError, match="both init_lora and init_lora_file"):
        train(model, ds, steps=1, init_lora=first.result[1], init_lora_file=name)
    with pytest.raises(ValueError, match="resume continues a run.*connect one"):
        train(model, ds, steps=3, init_lora_file=name, resume=first.result[2])
