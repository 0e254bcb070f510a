"""The dashboard's Stop and Stop & save, and Save LoRA's record of the run that wrote a file, in a real ComfyUI
(COMFYUI_PATH), in process, on a tiny Flux2.

The graphs run through ComfyUI's own executor (execution.PromptExecutor, its output cache kept between
prompts as a running server keeps it), so what is checked is what a user sees: after Stop, Save LoRA does
not run and writes nothing, and queueing the same graph again resumes the run (a blocked output is not a
cached result that stops the resume) and saves the finished LoRA; after Stop & save, Save LoRA writes the
LoRA as of that step and the finished run's save replaces it. The buttons are pressed through the
registry's own answers (what POST /kiln/runs/{id}/stop and /stop_save call), from the event hook.
Also: Save LoRA refuses another run's file and a file of no run unless overwrite; Save now while paused.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

from helpers import comfy_env
import numpy as np
import pytest

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()

import execution  # noqa: E402
from helpers import tiny_comfy as tc  # noqa: E402
from helpers.node_runs import encoded_dataset  # noqa: E402

import nodes as comfy_nodes  # noqa: E402

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.nodes.dashboard as dashboard
import kiln_pack.nodes.train_nodes as tn
import kiln_pack.nodes.lora_nodes as ln
import kiln_pack.nodes.run as run_module
import kiln_pack.trainer.lora.files as lora_format
import kiln_pack.trainer.run.state as state_module

STEPS = 6
SOURCES: dict = {}  # what the test source node hands the graph (a tiny model, a dataset)
OPTIONS = {"device": "cpu", "mixed_precision": "no", "checkpoint_every": 0, "log_every": 1}


class KilnTestSource:
    """A graph's model, encoded dataset and Training Options (a test-only V1 node)."""

    RETURN_TYPES = ("MODEL", "KILN_DATASET", "KILN_TRAIN_OPTIONS")
    FUNCTION = "run"
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802 (ComfyUI's name)
        return {"required": {"run_name": ("STRING", {"default": ""})}}

    def run(self, run_name):
        return SOURCES["model"], SOURCES["dataset"], {**OPTIONS, "run_name": run_name}


class Server:
    """What PromptExecutor asks of ComfyUI's PromptServer: no client, messages kept."""

    client_id = None
    last_node_id = None
    sockets_metadata: dict = {}

    def __init__(self):
        self.messages: list = []

    def send_sync(self, event, data, sid=None):
        self.messages.append((event, data))


def graph(run_name: str, lora_name: str) -> dict:
    """source → Train LoRA → Save LoRA (its lora and state), as an API prompt."""
    return {
        "1": {"class_type": "KilnTestSource", "inputs": {"run_name": run_name}},
        "2": {
            "class_type": "KilnTrainLoRA",
            "inputs": {
                "model": ["1", 0],
                "dataset": ["1", 1],
                "options": ["1", 2],
                "steps": STEPS,
                "learning_rate": 1e-3,
                "rank": 4,
                "alpha": 4.0,
                "optimizer": "adamw",
                "preset": "none",
                "backend": "torch",
                "seed": 1,
            },
        },
        "3": {
            "class_type": "KilnSaveLoRA",
            "inputs": {
                "lora": ["2", 1],
                "state": ["2", 2],
                "name": lora_name,
                "format": "comfy",
                "dtype": "bf16",
                "trigger_word": "",
                "notes": "",
                "overwrite": False,
            },
        },
    }


@pytest.fixture(scope="module")
def tiny(comfy_dirs, tmp_path_factory):
    SOURCES.update(
        model=tc.tiny_flux2(tmp_path_factory.mktemp("stopsave")),
        dataset=encoded_dataset(comfy_dirs, tc.tiny_vae(flux2=True), tc.tiny_klein_clip(), "ds_stopsave"),
    )
    yield SOURCES
    SOURCES.clear()


@pytest.fixture
def executor(tiny, monkeypatch):
    """ComfyUI's executor with the three nodes registered; `presses[step] = action` presses a dashboard button
    as that step's progress arrives."""
    for node in (KilnTestSource, tn.KilnTrainLoRA, ln.KilnSaveLoRA):
        monkeypatch.setitem(comfy_nodes.NODE_CLASS_MAPPINGS, getattr(node, "__name__"), node)
    presses: dict[int, str] = {}

    def send_event(name, data):
        if name == "kiln.progress" and data["step"] in presses:
            assert dashboard.REGISTRY.answer("POST", data["run_id"], presses.pop(data["step"]))[0] == 202
        return True

    monkeypatch.setattr(bridge, "send_event", send_event)
    comfy = execution.PromptExecutor(Server(), cache_type=False, cache_args={"lru": 0, "ram": 0, "ram_inactive": 0})
    comfy.presses = presses
    return comfy


def queue(comfy, prompt: dict, prompt_id: str) -> dict:
    """Run the prompt as the queue would (a fresh copy, as each POST /prompt parses one: ComfyUI notes its
    fingerprints in it); each executed node's ui output (its text report joined)."""
    comfy.execute(copy.deepcopy(prompt), prompt_id, {}, ["2", "3"])
    assert comfy.success, [m for m in comfy.server.messages if m[0] == "execution_error"]
    outputs = comfy.history_result["outputs"]
    return {node: "".join(ui.get("text", [])) for node, ui in outputs.items()}


def run_folder(comfy_dirs: Path, name: str) -> Path:
    (found,) = (comfy_dirs / "output" / "kiln").glob(f"{name}*")  # the run names here are no prefix of another
    return found


def test_stop_skips_save_lora_and_queueing_again_resumes_and_saves_the_finished_lora(comfy_dirs, executor):
    prompt, target = graph("stop_skips", "kiln/stop_skips"), comfy_dirs / "loras" / "kiln" / "stop_skips.safetensors"
    executor.presses[3] = "stop"
    reports = queue(executor, prompt, "p-stop")
    assert "3" not in reports and not target.exists()  # Save LoRA did not run
    train_report = reports["2"]
    assert "stopped at step 3" in train_report and "were skipped" in train_report
    assert "queue again to continue" in train_report.lower()
    folder = run_folder(comfy_dirs, "stop_skips")
    assert (folder / "step-000003" / "run.json").is_file()  # the checkpoint, as before

    reports = queue(executor, prompt, "p-again")  # the same graph, the cache kept
    assert "resuming from" in reports["2"] and "step-000003" in reports["2"]
    assert reports["3"].startswith("saved ") and target.is_file()
    lora, metadata = lora_format.load_lora(target)
    assert metadata["kiln.steps"] == str(STEPS) and metadata["kiln.run"] == folder.name
    assert bridge.unmatched_lora_keys(SOURCES["model"], bridge.load_lora_file(target)) == []


def test_stop_and_save_writes_the_lora_of_that_step_and_the_finished_run_replaces_it(comfy_dirs, executor):
    prompt, target = graph("stop_saves", "kiln/stop_saves"), comfy_dirs / "loras" / "kiln" / "stop_saves.safetensors"
    executor.presses[2] = "stop_save"
    reports = queue(executor, prompt, "p-stopsave")
    assert "stopped at step 2" in reports["2"] and "Stop & save" in reports["2"]
    assert reports["3"].startswith("saved ") and lora_format.load_lora(target)[1]["kiln.steps"] == "2"

    reports = queue(executor, prompt, "p-stopsave-again")  # resumes; Save LoRA replaces its file
    assert "step-000002" in reports["2"] and reports["3"].startswith("replaced (same run)")
    _, metadata = lora_format.load_lora(target)
    assert metadata["kiln.steps"] == str(STEPS) and metadata["kiln.run"] == run_folder(comfy_dirs, "stop_saves").name
    assert bridge.unmatched_lora_keys(SOURCES["model"], bridge.load_lora_file(target)) == []


def test_save_lora_refuses_a_file_of_another_run_or_of_no_run_unless_overwrite(comfy_dirs, executor):
    queue(executor, graph("foreign", "kiln/foreign"), "p-foreign")
    folder = run_folder(comfy_dirs, "foreign")
    state = run_module.KilnState.from_checkpoint(state_module.list_checkpoints(folder)[-1][1])
    lora = bridge.lora_model_from(state.best_lora(), state.arch)
    other = dataclasses.replace(state, run_dir=str(folder.parent / "someone-0123456789"))

    def save(name, run_state, overwrite=False):
        return ln.KilnSaveLoRA.execute(lora, name, "comfy", "bf16", "", "", overwrite, run_state)

    with pytest.raises(ValueError, match=f"written by another run, {folder.name}; .*turn on overwrite"):
        save("kiln/foreign", other)
    assert (
        save("kiln/foreign", other, overwrite=True)
        .ui.as_dict()["text"][0]
        .startswith(f"replaced (run {folder.name}; overwrite on)")
    )
    assert (
        lora_format.load_lora(comfy_dirs / "loras" / "kiln" / "foreign.safetensors")[1]["kiln.run"]
        == "someone-0123456789"
    )

    save("kiln/no_run", None)  # no state: a file of no run
    assert "kiln.run" not in lora_format.load_lora(comfy_dirs / "loras" / "kiln" / "no_run.safetensors")[1]
    with pytest.raises(ValueError, match="written by no Kiln run"):
        save("kiln/no_run", state)
    with pytest.raises(ValueError, match="exists; choose another name or turn on overwrite"):
        save("kiln/no_run", None)  # without a state: as it always was
    assert save("kiln/no_run", state, overwrite=True).ui.as_dict()["text"][0].startswith("replaced (a file of no")


def test_save_now_while_paused_writes_the_lora_at_once(comfy_dirs, tiny, monkeypatch):
    """Pause after step 2; Save now pressed while the loop waits is written during the wait (the EMA weights of
    step 2), shown on the dashboard; then Stop ends the pause and the run (its outputs blocked)."""
    import kiln_pack.trainer.run.pause as pause

    events: list[tuple[str, dict]] = []
    waits: list[int] = []

    def send_event(name, data):
        events.append((name, data))
        if name == "kiln.progress" and data["step"] == 2:
            assert dashboard.REGISTRY.answer("POST", data["run_id"], "pause")[0] == 202
        return True

    def sleep(seconds):  # the paused loop polls: Save now at the first wait, Stop at the second
        run_id = events[0][1]["id"]
        waits.append(len(waits))
        if len(waits) == 1:
            assert not any(data.get("saved") for _, data in events)
            assert dashboard.REGISTRY.answer("POST", run_id, "save")[0] == 202
        else:
            saved = [data for name, data in events if name == "kiln.run" and data.get("saved")]
            assert saved and saved[-1]["paused"] and saved[-1]["saved"][-1]["step"] == 2  # written in the pause
            assert dashboard.REGISTRY.answer("POST", run_id, "stop")[0] == 202

    monkeypatch.setattr(pause.time, "sleep", sleep)
    monkeypatch.setattr(bridge, "send_event", send_event)
    monkeypatch.setattr(bridge, "executing_node", lambda: ("kiln-pause-save", "prompt-ps"))
    result = tn.KilnTrainLoRA.execute(
        SOURCES["model"],
        SOURCES["dataset"],
        steps=STEPS,
        learning_rate=1e-3,
        rank=4,
        alpha=4.0,
        optimizer="adamw",
        preset="none",
        backend="torch",
        seed=1,
        options={**OPTIONS, "run_name": "pause_save", "ema": True, "ema_decay": 0.9},
    )
    assert len(waits) == 2 and [d["step"] for n, d in events if n == "kiln.progress"] == [1, 2]
    assert all(bridge.is_blocked(value) for value in result.result[:3])  # a plain Stop: nothing saves it
    name = next(data for name, data in events if data.get("saved"))["saved"][-1]["name"]
    assert name in bridge.lora_names()
    saved, metadata = lora_format.load_lora(comfy_dirs / "loras" / name)
    assert metadata["kiln.steps"] == "2"
    state = run_module.KilnState.from_checkpoint(run_folder(comfy_dirs, "pause_save") / "step-000002")
    for path, weights in saved.items():  # the EMA weights of step 2 (bf16 in the file), not the raw ones
        np.testing.assert_allclose(weights.B, state.ema_lora[path].B, rtol=1e-2, atol=1e-6)
    assert any(not np.allclose(state.ema_lora[p].B, state.lora[p].B, rtol=1e-2, atol=1e-6) for p in saved)
