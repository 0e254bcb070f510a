"""Kiln Train LoRA (several GPUs) in a real ComfyUI (#22): the node starts `torchrun -m trainer train` with
two gloo ranks on the demo arch as a child process, its bar follows the run, the Stop button leaves a
checkpoint on every rank, and queueing again resumes it and returns the LoRA through ComfyUI's loader."""
from __future__ import annotations

import sys

import comfy_env
import pytest

comfy_env.require_comfy()

import comfy.model_management as mm
import torch
from test_nodes import comfy_dirs, out  # noqa: F401

bridge = comfy_env.import_pack("nodes.comfy.bridge")
launch_nodes = comfy_env.import_pack("nodes.launch_nodes")
state = comfy_env.import_pack("trainer.state")
demo = comfy_env.import_pack("trainer.demo")

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or sys.platform == "win32",
                                reason="needs torch.distributed with gloo (Linux, macOS)")
STEPS = 60   # Stop is pressed at step 3: the ranks are still training when it reaches them
OPTIONS = {"device": "cpu", "mixed_precision": "no", "batch_size": 1, "checkpoint_every": 20, "log_every": 1,
           "run_name": "several"}


def queue(dataset) -> object:
    node = launch_nodes.KilnTrainLoRATorchrun
    return node.execute("demo", "none", "none", "none", str(dataset), "64", "", STEPS, 1e-4, 4, 4.0, "none", 0, 2,
                        "", options=OPTIONS)


def test_the_node_declares_file_inputs_and_refuses_a_missing_model(comfy_dirs):  # noqa: F811
    schema = launch_nodes.KilnTrainLoRATorchrun.define_schema()
    names = [i.id for i in schema.inputs]
    assert names[:4] == ["arch", "model_file", "vae_file", "text_encoder_file"] and "gpus" in names
    assert all(i.tooltip for i in schema.inputs)
    with pytest.raises(ValueError, match=r"arch 'flux2_klein' trains ComfyUI's model from files; choose model_file"):
        launch_nodes.KilnTrainLoRATorchrun.execute("flux2_klein", "none", "none", "none", str(comfy_dirs), "64",
                                                   "", 10, 1e-4, 4, 4.0, "none", 0, 2, "")


def test_stop_leaves_a_checkpoint_and_queueing_again_resumes_to_the_lora(comfy_dirs, monkeypatch):  # noqa: F811
    dataset = comfy_dirs / "input" / "shapes"
    demo.make_dataset(dataset)
    seen: list[int] = []
    real_progress = bridge.progress

    def progress(total):   # the Stop button pressed as step 3 is shown
        bar = real_progress(total)
        real_update = bar.update

        def update(step, *args, **kwargs):
            seen.append(step)
            if step == 3:
                mm.interrupt_current_processing(True)
            real_update(step, *args, **kwargs)
        bar.update = update
        return bar

    monkeypatch.setattr(bridge, "progress", progress)
    with pytest.raises(mm.InterruptProcessingException):
        queue(dataset)
    run_dir = next((comfy_dirs / "output" / "kiln").glob("several-*"))
    stopped = state.list_checkpoints(run_dir)
    assert stopped and 3 <= stopped[-1][0] < STEPS and seen[:3] == [1, 2, 3], (stopped, seen)
    assert state.load_checkpoint(run_dir).info["world_size"] == 2
    assert not mm.processing_interrupted()   # the raise cleared the request

    seen.clear()
    resumed = queue(dataset)
    lora, folder = out(resumed), out(resumed, 1)
    assert folder == str(run_dir) and seen[0] == stopped[-1][0] + 1 and seen[-1] == STEPS, seen
    assert state.list_checkpoints(run_dir)[-1][0] == STEPS
    assert lora and all(torch.is_tensor(v) for v in lora.values())
    seen.clear()
    again = queue(dataset)   # finished: its LoRA is read, nothing is launched
    assert not seen and "already trained" in "".join(again.ui.as_dict()["text"])
    assert (run_dir / "launch.toml").is_file()
