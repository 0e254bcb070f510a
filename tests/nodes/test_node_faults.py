"""Faults and re-queues in a real ComfyUI (COMFYUI_PATH), in process, on a tiny Flux2:

- the stop button (comfy.model_management.interrupt_current_processing) pressed mid-forward ends
  training at the end of that step with a resumable checkpoint, and re-queueing continues to the
  same weights as a run never stopped;
- out of memory inside a step: the node fails with the fix named, the model is left without LoRA
  branches, in_training is reset, memory is handed back, and a re-queue resumes at the last good step;
- re-queueing (ComfyUI's cache emptied, e.g. after a restart): the same workflow loads the finished
  run without training, a changed setting trains anew, more steps continue the finished run;
- run folders: named by run_name as typed, -2 for another identity under the same name, each re-queue
  finding its own folder, a folder of the old <name>-<hash> kind resumed in place.
"""

from __future__ import annotations

from pathlib import Path

from helpers import comfy_env
import numpy as np
import pytest

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()

import comfy.model_management as mm  # noqa: E402
from helpers import tiny_comfy as tc  # noqa: E402
import torch  # noqa: E402
from helpers.node_runs import encoded_dataset, train  # noqa: E402

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.trainer.run.folders as run_folders
import kiln_pack.nodes.comfy.model as door_model  # what the training sequence calls
import kiln_pack.nodes.comfy.session as door_session
import kiln_pack.trainer.run.faults as faults
import kiln_pack.trainer.run.state as state_module


@pytest.fixture(scope="module")
def flux(comfy_dirs, tmp_path_factory):  # noqa: F811
    model = tc.tiny_flux2(tmp_path_factory.mktemp("faults"))
    return model, encoded_dataset(comfy_dirs, tc.tiny_vae(flux2=True), tc.tiny_klein_clip(), "ds_faults")


@pytest.fixture
def forwards(monkeypatch):
    """Counts the training forwards; `hooks[n]` runs inside the n-th one (1-based)."""
    calls, hooks = [], {}
    real = bridge.make_forward

    def make_forward(model, arch_name):
        inner = real(model, arch_name)

        def forward(*args):
            calls.append(1)
            if len(calls) in hooks:
                hooks[len(calls)]()
            return inner(*args)

        return forward

    monkeypatch.setattr(door_model, "make_forward", make_forward)
    return calls, hooks


def weights_equal(a, b):
    for path, w in a.lora.items():
        np.testing.assert_array_equal(w.A, b.lora[path].A)
        np.testing.assert_array_equal(w.B, b.lora[path].B)


def test_stop_button_mid_step_ends_that_step_and_requeue_continues_exactly(flux, forwards, same_kernels):
    model, ds = flux
    calls, hooks = forwards
    straight = train(model, ds, steps=8, options={"run_name": "stop_straight", **same_kernels}).result[2]
    calls.clear()
    hooks[5] = lambda: mm.interrupt_current_processing(True)  # the stop button, during step 5's forward
    try:
        with pytest.raises(bridge.Interrupted):
            train(model, ds, steps=8, options={"run_name": "stop_mid", **same_kernels})
    finally:
        mm.interrupt_current_processing(False)  # what ComfyUI does before the next prompt
        hooks.clear()
    assert len(calls) == 5  # no forward after the stop: within one step
    run_dir = Path(straight.run_dir).parent / "stop_mid"  # named as typed
    assert state_module.load_checkpoint(run_dir).step == 5  # the step in flight was finished and saved
    assert not mm.in_training and not mm.processing_interrupted()
    calls.clear()
    resumed = train(model, ds, steps=8, options={"run_name": "stop_mid", **same_kernels})
    assert "resuming from" in resumed.ui.value and "step-000005" in resumed.ui.value
    assert len(calls) == 3 and resumed.result[2].step == 8  # steps 6..8 only
    weights_equal(straight, resumed.result[2])


def test_out_of_memory_in_a_step_frees_the_model_and_requeue_resumes(flux, forwards, monkeypatch):
    model, ds = flux
    calls, hooks = forwards
    dm = bridge.diffusion_model(model)
    keys, flags = set(dm.state_dict()), [p.requires_grad for p in dm.parameters()]
    freed = []
    real_free = door_session.free_memory
    monkeypatch.setattr(door_session, "free_memory", lambda: freed.append(1) or real_free())

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    hooks[4] = oom
    with pytest.raises(faults.OutOfMemory) as caught:
        train(model, ds, steps=6, options={"run_name": "oom"})
    hooks.clear()
    message = str(caught.value)
    assert "out of memory at step 4" in message and "step-000003" in message
    assert "resolutions" in message and "fp8" in message and "gradient_checkpointing" not in message  # it is on
    assert freed  # memory handed back after the error
    assert all("forward" not in m.__dict__ for m in dm.modules())  # no LoRA branch left in ComfyUI's model
    assert set(dm.state_dict()) == keys and [p.requires_grad for p in dm.parameters()] == flags
    assert all(p.grad is None for p in dm.parameters())
    assert not mm.in_training
    calls.clear()
    again = train(model, ds, steps=6, options={"run_name": "oom"})
    assert "step-000003" in again.ui.value and len(calls) == 3 and again.result[2].step == 6


def test_requeue_reuses_a_finished_run_and_retrains_only_on_a_change(flux, forwards):
    """Kiln's own rule under ComfyUI's cache: ComfyUI reuses the node's outputs while its inputs are
    unchanged and the server runs; after a restart (or with the cache off) the node runs again and
    finds its run folder by the hash of every setting that shapes the result."""
    model, ds = flux
    calls, _ = forwards
    first = train(model, ds, steps=4, options={"run_name": "cache"})
    assert len(calls) == 4
    calls.clear()
    same = train(model, ds, steps=4, options={"run_name": "cache"})
    assert calls == [] and "already trained" in same.ui.value  # nothing trained, the result returned
    assert same.result[2].checkpoint == first.result[2].checkpoint
    for key, tensor in first.result[1].items():
        assert torch.equal(tensor, same.result[1][key])  # the same LORA_MODEL
    changed = train(model, ds, steps=4, options={"run_name": "cache", "weight_decay": 0.05})
    assert len(calls) == 4 and "training from step 0" in changed.ui.value
    assert Path(changed.result[2].run_dir) != Path(first.result[2].run_dir)
    calls.clear()
    longer = train(model, ds, steps=6, options={"run_name": "cache"})  # more steps: the finished run goes on
    assert len(calls) == 2 and "step-000004" in longer.ui.value and longer.result[2].step == 6
    assert Path(longer.result[2].run_dir) == Path(first.result[2].run_dir)


def test_run_folders_are_named_as_typed_a_clash_gets_a_suffix_and_each_requeue_finds_its_own(flux, forwards):
    model, ds = flux
    calls, _ = forwards
    first = train(model, ds, steps=2, options={"run_name": "my portrait"}).result[2]
    root = Path(first.run_dir).parent
    assert Path(first.run_dir) == root / "my portrait"
    other = train(model, ds, steps=2, options={"run_name": "my portrait", "weight_decay": 0.05}).result[2]
    assert Path(other.run_dir) == root / "my portrait-2"  # another identity: a suffix
    assert run_folders.read_identity(first.run_dir) != run_folders.read_identity(other.run_dir)
    calls.clear()
    longer = train(model, ds, steps=3, options={"run_name": "my portrait", "weight_decay": 0.05})
    assert Path(longer.result[2].run_dir) == root / "my portrait-2" and "step-000002" in longer.ui.value
    again = train(model, ds, steps=2, options={"run_name": "my portrait"})
    assert "already trained" in again.ui.value and Path(again.result[2].run_dir) == root / "my portrait"
    assert len(calls) == 1  # step 3 of the second run only
    assert sorted(p.name for p in root.glob("my portrait*")) == ["my portrait", "my portrait-2"]


def test_an_empty_run_name_names_the_run_after_its_dataset_folder(flux):
    model, ds = flux
    state = train(model, ds, steps=1, options={"run_name": ""}).result[2]
    assert Path(state.run_dir).name == "ds_faults"  # Load Dataset's folder


def test_a_run_folder_named_the_old_way_is_resumed_in_place(flux, forwards):
    """A run stopped before run folders were named as typed: output/kiln/<run_name>-<10 hex of its identity>,
    no identity file. Queued again, it resumes there and no new folder is made."""
    model, ds = flux
    calls, _ = forwards
    new_style = Path(train(model, ds, steps=2, options={"run_name": "old"}).result[2].run_dir)
    identity = run_folders.read_identity(new_style)
    (new_style / run_folders.IDENTITY_FILE).unlink()
    legacy = new_style.with_name(f"old-{identity[:10]}")
    new_style.rename(legacy)  # as the older Kiln left it
    calls.clear()
    resumed = train(model, ds, steps=4, options={"run_name": "old"})
    assert Path(resumed.result[2].run_dir) == legacy and "step-000002" in resumed.ui.value
    assert len(calls) == 2 and resumed.result[2].step == 4
    assert not new_style.exists()
