"""Kiln Train LoRA (several GPUs) in a real ComfyUI (#22): the node starts `torchrun -m trainer train` with
two gloo ranks on the demo arch as a child process, its bar follows the run, the Stop button leaves a
checkpoint on every rank, and queueing again resumes it and returns the LoRA through ComfyUI's loader.
A tiny Flux2 Klein run through headless.py: the dashboard gets its steps and samples, the node returns the
samples rank 0 drew with ComfyUI's sampler, and rank 1 never loads the VAE or text encoder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers import comfy_env
import pytest
from PIL import Image

comfy_env.require_comfy()

import comfy.model_management as mm
import comfy.sd
import folder_paths
from helpers import tiny_comfy as tc
import torch
from helpers.node_runs import out

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.nodes.dashboard as dashboard
import kiln_pack.nodes.launch_nodes as launch_nodes
import kiln_pack.trainer.cli.launch as launch
import kiln_pack.trainer.run.state as state
import kiln_pack.trainer.demo.run as demo

CHILD = Path(__file__).resolve().parents[1] / "helpers" / "launch_child.py"  # `-m trainer train` with the tiny encoders

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(
        not torch.distributed.is_available() or sys.platform == "win32",
        reason="needs torch.distributed with gloo (Linux, macOS)",
    ),
]
STEPS = 60  # Stop is pressed at step 3: the ranks are still training when it reaches them
OPTIONS = {
    "device": "cpu",
    "mixed_precision": "no",
    "batch_size": 1,
    "checkpoint_every": 20,
    "log_every": 1,
    "run_name": "several",
}


def queue(dataset, run_name: str = "several") -> object:
    node = launch_nodes.KilnTrainLoRATorchrun
    return node.execute(
        "demo",
        "none",
        "none",
        "none",
        str(dataset),
        "64",
        "",
        STEPS,
        1e-4,
        4,
        4.0,
        "none",
        0,
        2,
        "",
        options={**OPTIONS, "run_name": run_name},
    )


def test_the_node_declares_file_inputs_and_refuses_a_missing_model(comfy_dirs):
    schema = launch_nodes.KilnTrainLoRATorchrun.define_schema()
    names = [i.id for i in schema.inputs]
    assert names[:4] == ["arch", "model_file", "vae_file", "text_encoder_file"] and "gpus" in names
    sharding = schema.inputs[-1]  # new inputs go last (saved workflows' widgets_values are positional)
    assert sharding.id == "sharding" and sharding.options == ["auto", "replicate", "shard"] and sharding.optional
    assert all(i.tooltip for i in schema.inputs)
    args = ("flux2_klein", "none", "none", "none", str(comfy_dirs), "64", "", 10, 1e-4, 4, 4.0, "none", 0, 2, "")
    with pytest.raises(ValueError, match=r"(?s)Kiln Train LoRA \(several GPUs\): .*sample_prompts with sharding shard"):
        launch_nodes.KilnTrainLoRATorchrun.execute(
            "demo", *args[1:], sample_prompts="a cat", sharding="shard"
        )  # refused before anything starts: rank 0 samples alone
    with pytest.raises(ValueError, match=r"arch 'flux2_klein' trains ComfyUI's model from files; choose model_file"):
        launch_nodes.KilnTrainLoRATorchrun.execute(
            "flux2_klein", "none", "none", "none", str(comfy_dirs), "64", "", 10, 1e-4, 4, 4.0, "none", 0, 2, ""
        )


def test_stop_leaves_a_checkpoint_and_queueing_again_resumes_to_the_lora(comfy_dirs, monkeypatch):
    dataset = comfy_dirs / "input" / "shapes"
    demo.make_dataset(dataset)
    seen: list[int] = []
    real_progress = bridge.progress

    def progress(total):  # the Stop button pressed as step 3 is shown
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
    run_dir = comfy_dirs / "output" / "kiln" / "several"
    stopped = state.list_checkpoints(run_dir)
    assert stopped and 3 <= stopped[-1][0] < STEPS and seen[:3] == [1, 2, 3], (stopped, seen)
    assert state.load_checkpoint(run_dir).info["world_size"] == 2
    assert not mm.processing_interrupted()  # the raise cleared the request

    seen.clear()
    resumed = queue(dataset)
    lora, folder = out(resumed), out(resumed, 1)
    assert folder == str(run_dir) and seen[0] == stopped[-1][0] + 1 and seen[-1] == STEPS, seen
    assert state.list_checkpoints(run_dir)[-1][0] == STEPS
    assert lora and all(torch.is_tensor(v) for v in lora.values())
    seen.clear()
    again = queue(dataset)  # finished: its LoRA is read, nothing is launched
    assert not seen and "already trained" in "".join(again.ui.as_dict()["text"])
    assert (run_dir / "launch.toml").is_file()


def test_the_dashboard_pauses_and_resumes_a_launched_run_and_comfyuis_stop_ends_it_while_paused(
    comfy_dirs, monkeypatch
):
    """Pause at step 2 through the dashboard's route: the node writes <run>/PAUSE, both ranks wait after the
    same step and rank 0's KILN_PAUSED line shows the run paused; Resume (a moment later) goes on. A second
    pause ends by ComfyUI's Stop: a checkpoint at the paused step, the PAUSE file gone, and queueing again
    resumes from it without pausing."""
    import threading

    dataset = comfy_dirs / "input" / "shapes"
    demo.make_dataset(dataset)
    monkeypatch.setattr(bridge, "executing_node", lambda: ("kiln-launch-pause", "prompt-3"))
    events: list[tuple[str, dict]] = []
    pauses: list[tuple[int, bool, bool]] = []  # (step, paused, the GET answer's paused) per kiln.run pause event
    timers: list[threading.Timer] = []

    def later(action):
        timers.append(threading.Timer(0.5, action))
        timers[-1].start()

    def send_event(name, data):
        events.append((name, data))
        if name == "kiln.progress" and data["step"] in (2, 12):
            assert dashboard.REGISTRY.answer("POST", data["run_id"], "pause")[0] == 202
        if (
            name == "kiln.run"
            and data["status"] == "running"
            and data["paused"] != (pauses[-1][1] if pauses else False)
        ):
            pauses.append((data["step"], data["paused"], dashboard.REGISTRY.answer("GET", data["id"])[1]["paused"]))
            run_dir = comfy_dirs / "output" / "kiln" / "paused"
            if data["paused"] and len(pauses) == 1:  # paused: the file is there; Resume a moment later
                assert (run_dir / "PAUSE").is_file()
                later(lambda: dashboard.REGISTRY.answer("POST", data["id"], "resume"))
            elif data["paused"]:  # the second pause: ComfyUI's Stop
                later(lambda: mm.interrupt_current_processing(True))
        return True

    monkeypatch.setattr(bridge, "send_event", send_event)
    with pytest.raises(mm.InterruptProcessingException):
        queue(dataset, "paused")
    for timer in timers:
        timer.join()
    assert not mm.processing_interrupted()
    steps = [d["step"] for n, d in events if n == "kiln.progress"]
    first, second = pauses[0][0], pauses[2][0]
    # Paused, resumed, paused, and that pause ended by the stop; the dashboard's answer agreed each time.
    assert [(p, q) for _, p, q in pauses] == [(True, True), (False, False), (True, True), (False, False)], pauses
    assert pauses[1][0] == first and pauses[3][0] == second and 2 <= first < 12 <= second < STEPS, (pauses, steps)
    assert steps == list(range(1, second + 1)), steps  # every step once, none while paused
    # No step between a pause's start and its end: the progress events around the first pause are in order.
    names = [
        (n, d.get("paused")) for n, d in events if n == "kiln.run" or (n == "kiln.progress" and d["step"] == first + 1)
    ]
    # (the run, its plan before the first step, paused, resumed, then the next step)
    run, paused, resumed, step = ("kiln.run", False), ("kiln.run", True), ("kiln.run", False), ("kiln.progress", None)
    assert names[:5] == [run, run, paused, resumed, step], names
    run_dir = comfy_dirs / "output" / "kiln" / "paused"
    assert state.list_checkpoints(run_dir)[-1][0] == second and not (run_dir / "PAUSE").exists()
    detail = dashboard.REGISTRY.answer("GET", events[-1][1]["id"])[1]
    assert detail["status"] == "interrupted" and not detail["paused"]

    events.clear()
    resumed = queue(dataset, "paused")
    steps = [d["step"] for n, d in events if n == "kiln.progress"]
    assert steps == list(range(second + 1, STEPS + 1)) and out(resumed, 1) == str(run_dir)
    assert not [d for n, d in events if n == "kiln.run" and d.get("paused")]


def test_the_dashboards_stop_blocks_the_lora_and_run_folder_and_stop_and_save_passes_them_on(comfy_dirs, monkeypatch):
    """As Train LoRA's: after the dashboard's Stop the run is not done, so its lora and run_folder are blocked
    (nothing downstream saves or loads it); queueing again resumes, and Stop & save returns the LoRA."""
    dataset = comfy_dirs / "input" / "shapes"
    demo.make_dataset(dataset)
    monkeypatch.setattr(bridge, "executing_node", lambda: ("kiln-launch-stop", "prompt-4"))
    presses = {3: "stop", 6: "stop_save"}

    def send_event(name, data):
        if name == "kiln.progress" and data["step"] in presses:
            assert dashboard.REGISTRY.answer("POST", data["run_id"], presses.pop(data["step"]))[0] == 202
        return True

    monkeypatch.setattr(bridge, "send_event", send_event)
    stopped = queue(dataset, "blocked")
    text = "".join(stopped.ui.as_dict()["text"])
    assert bridge.is_blocked(out(stopped)) and bridge.is_blocked(out(stopped, 1)) and out(stopped, 2).ndim == 4
    assert "were skipped" in text and "queue again to resume" in text
    saved = queue(dataset, "blocked")  # resumes; Stop & save at step 6
    assert "Stop & save" in "".join(saved.ui.as_dict()["text"])
    lora, folder = out(saved), out(saved, 1)
    assert lora and all(torch.is_tensor(v) for v in lora.values()) and Path(folder).name.startswith("blocked")


PROMPTS = "a red cube --w 64 --h 64 --steps 1\na blue ball --w 64 --h 64 --steps 1 --seed 3"


def klein_files(tmp_path: Path) -> dict[str, Path]:
    files = {"tiny_flux2.safetensors": tc.write_flux2_file(tmp_path / "tiny_flux2.safetensors")}
    for stand_in in ("vae.safetensors", "te.safetensors"):  # launch_child.py's loaders give the tiny ones
        files[stand_in] = tmp_path / stand_in
        files[stand_in].write_bytes(b"stand-in")
    tc.write_photos(tmp_path / "ds")
    return files


def test_a_launched_run_feeds_the_dashboard_and_returns_rank_0s_samples(comfy_dirs, tmp_path, monkeypatch):
    files = klein_files(tmp_path)
    monkeypatch.setattr(bridge, "model_path", lambda folder, name: str(files[name]))
    monkeypatch.setattr(
        launch,
        "command",
        lambda config, processes, resume=False: [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(processes),
            str(CHILD),
            str(config),
            *(["--resume"] if resume else []),
        ],
    )
    (tmp_path / "temp").mkdir()
    monkeypatch.setattr(folder_paths, "temp_directory", str(tmp_path / "temp"))
    monkeypatch.setattr(bridge, "executing_node", lambda: ("kiln-launch-test", "prompt-1"))
    events: list[tuple[str, dict]] = []
    refusals: list = []

    def send_event(name, data):
        events.append((name, data))
        if name == "kiln.progress" and data["step"] == 2:  # Save now: the weights are in the child
            refusals.append(dashboard.REGISTRY.answer("POST", data["run_id"], "save"))
        return True

    monkeypatch.setattr(bridge, "send_event", send_event)
    options = {
        "device": "cpu",
        "mixed_precision": "no",
        "batch_size": 1,
        "checkpoint_every": 2,
        "log_every": 1,
        "run_name": "klein2",
    }
    result = launch_nodes.KilnTrainLoRATorchrun.execute(
        "flux2_klein",
        "tiny_flux2.safetensors",
        "vae.safetensors",
        "te.safetensors",
        str(tmp_path / "ds"),
        "64",
        "",
        4,
        1e-3,
        4,
        4.0,
        "none",
        0,
        2,
        "",
        options=options,
        sample_prompts=PROMPTS,
        sample_every=2,
    )
    lora, run_dir, images = out(result), Path(out(result, 1)), out(result, 2)

    # Rank 0 loaded the VAE and text encoder; rank 1 the diffusion model alone.
    assert json.loads((run_dir / "loaded-rank0.json").read_text()) == {"encoders": True}
    assert json.loads((run_dir / "loaded-rank1.json").read_text()) == {"encoders": False}
    # Rank 0 sampled both prompts before the first step, at step 2 and at the last, and wrote their grid
    # (2 prompts across, 3 steps down; the parent writes nothing over the child's files); the IMAGE output is
    # the last step's, as written.
    written = sorted(p.name for p in (run_dir / "samples").glob("*.png"))
    assert written == ["grid.png", *(f"step-{s:06d}-p{i}.png" for s in (0, 2, 4) for i in (0, 1))]
    with Image.open(run_dir / "samples" / "grid.png") as grid:
        assert grid.width > 2 * 64 and grid.height > 3 * 64  # two 64 px prompts across, three steps down, labels
    assert images.shape == (2, 64, 64, 3)
    for index in (0, 1):
        with Image.open(run_dir / "samples" / f"step-000004-p{index}.png") as png:
            assert torch.equal(images[index], bridge.image_tensor(png)[0])
    # The dashboard: every step with its loss, every sample, the run finished; Save now refused with the reason.
    progress = [data for name, data in events if name == "kiln.progress"]
    assert [d["step"] for d in progress] == [1, 2, 3, 4] and all(d["loss"] is not None for d in progress)
    # each GPU's peak (here the CPU's: 0) rides the ranks' stop vote, which answers from step 3 on
    assert [len(d["peak_memory_per_gpu"]) for d in progress] == [0, 0, 2, 2]
    assert [d["step"] for name, d in events if name == "kiln.sample"] == [0, 0, 2, 2, 4, 4]
    run_id = progress[0]["run_id"]
    status, detail = dashboard.REGISTRY.answer("GET", run_id)
    assert status == 200 and detail["status"] == "finished" and len(detail["history"]["loss"]) == 4
    assert detail["plan"][0].startswith("memory plan: "), detail["plan"]  # rank 0's KILN_PLAN line
    assert detail["samples"] and not detail["can_save"]
    assert refusals and refusals[0][0] == 409 and "torchrun child process" in refusals[0][1]["error"]
    # The LoRA, read by ComfyUI's loader, places every key on the model.
    model = comfy.sd.load_diffusion_model(str(files["tiny_flux2.safetensors"]))
    assert lora and bridge.unmatched_lora_keys(model, lora) == []


def test_a_full_runs_lora_output_names_its_model_file(tmp_path):
    """A full fine-tune's headless file is a diffusion model: the lora output stops a reader with where it is."""
    path = tmp_path / "run.safetensors"
    output = launch_nodes._lora_output({"adapter": "full"}, path)
    assert bridge.is_blocked(output) and str(path) in output.message and "Load Diffusion Model" in output.message
