"""The dashboard's hooks in a real ComfyUI (COMFYUI_PATH), in process, on a tiny Flux2: what Stop and
Save now do to a Train LoRA run, and the events a page receives (nodes/live.py).

Stop and Save now are pressed through the registry's own answers (what POST /kiln/runs/{id}/stop and
/save call), from inside the event hook, at fixed steps.
"""

from __future__ import annotations

from pathlib import Path

from helpers import comfy_env
import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()

import folder_paths  # noqa: E402
from helpers import tiny_comfy as tc  # noqa: E402

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.nodes.dashboard as dashboard
import kiln_pack.nodes.dataset_nodes as dn
import kiln_pack.nodes.train_nodes as tn
import kiln_pack.nodes.run as run
import kiln_pack.trainer.lora.files as lora_format


@pytest.fixture
def comfy_dirs(tmp_path, monkeypatch):
    for name in ("input", "output", "loras", "temp"):
        (tmp_path / name).mkdir()
    monkeypatch.setattr(folder_paths, "input_directory", str(tmp_path / "input"))
    monkeypatch.setattr(folder_paths, "output_directory", str(tmp_path / "output"))
    monkeypatch.setattr(folder_paths, "temp_directory", str(tmp_path / "temp"))
    monkeypatch.setitem(
        folder_paths.folder_names_and_paths, "loras", ([str(tmp_path / "loras")], folder_paths.supported_pt_extensions)
    )
    bridge.refresh_loras()
    return tmp_path


def encoded_dataset(root: Path, vae, clip):
    folder = root / "input" / "live"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        size = (64, 64) if i % 2 else (96, 64)
        Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"{{trigger}}, a photo number {i}", encoding="utf-8")
    loaded = dn.KilnLoadDataset.execute("live", "kiln", "", "", "64", 1, 0.0).result[0]
    return dn.KilnEncodeCaptions.execute(dn.KilnEncodeImages.execute(loaded, vae).result[0], clip).result[0]


def sampled_run_inputs(root: Path):
    """A tiny Klein, its encoded dataset and validation samples every 2 steps."""
    model, vae, clip = tc.tiny_flux2(root), tc.tiny_vae(flux2=True), tc.tiny_klein_clip()
    validation = tn.KilnValidationSettings.execute(
        positive=tc.conditioning(clip, "kiln"),
        negative=tc.conditioning(clip, ""),
        vae=vae,
        seed=0,
        steps=1,
        cfg=1.0,
        sampler_name="euler",
        scheduler="simple",
        width=32,
        height=32,
        every=2,
    ).result[0]
    return model, encoded_dataset(root, vae, clip), validation


def test_save_now_and_stop_from_the_dashboard_then_resume(comfy_dirs, monkeypatch):
    model, ds, validation = sampled_run_inputs(comfy_dirs)
    events: list[tuple[str, dict]] = []

    def send_event(name, data):
        events.append((name, data))
        if name == "kiln.progress" and data["step"] == 2:
            assert dashboard.REGISTRY.answer("POST", data["run_id"], "save")[0] == 202
        if name == "kiln.progress" and data["step"] == 4:
            assert dashboard.REGISTRY.answer("POST", data["run_id"], "stop")[0] == 202
        return True

    monkeypatch.setattr(bridge, "send_event", send_event)
    monkeypatch.setattr(bridge, "executing_node", lambda: ("kiln-live-test", "prompt-1"))
    fingerprint = tn.KilnTrainLoRA.fingerprint_inputs()

    def train():
        return tn.KilnTrainLoRA.execute(
            model,
            ds,
            steps=8,
            learning_rate=1e-3,
            rank=4,
            alpha=4.0,
            optimizer="adamw",
            preset="none",
            backend="torch",
            seed=1,
            validation=validation,
            options={
                "device": "cpu",
                "mixed_precision": "no",
                "checkpoint_every": 0,
                "run_name": "live",
                "ema": True,
                "ema_decay": 0.9,
                "log_every": 1,
            },
        )

    stopped = train()
    # Stop: the run is not done, so model, lora and state are blocked (Save LoRA downstream is skipped).
    assert all(bridge.is_blocked(value) for value in stopped.result[:3])
    assert "stopped at step 4 from the dashboard" in stopped.ui.value and "skipped" in stopped.ui.value
    state = run.KilnState.from_checkpoint(comfy_dirs / "output" / "kiln" / events[-1][1]["name"])
    assert state.step == 4 and Path(state.checkpoint).name == "step-000004"
    assert (Path(state.checkpoint) / "run.json").is_file()

    names = [name for name, _ in events]
    assert names[0] == "kiln.run" and events[0][1]["status"] == "running" and events[0][1]["node"] == "kiln-live-test"
    progress = [data for name, data in events if name == "kiln.progress"]
    assert [p["step"] for p in progress] == [1, 2, 3, 4]
    run_id = progress[0]["run_id"]
    assert all(p["run_id"] == run_id and p["total"] == 8 and p["loss"] is not None for p in progress)
    samples = [data for name, data in events if name == "kiln.sample"]
    assert [s["step"] for s in samples] == [2, 4]
    for sample in samples:  # a JPEG that ComfyUI's /view serves from its temp folder
        image = sample["image"]
        assert image["type"] == "temp" and "/" not in image["filename"]
        assert (comfy_dirs / "temp" / image["subfolder"] / image["filename"]).is_file()
    saved_event = next(data for name, data in events if name == "kiln.run" and data.get("saved"))
    assert events[-1][0] == "kiln.run" and events[-1][1]["status"] == "stopped"

    # Save now wrote the LoRA as of step 2 (the EMA weights: EMA is on) where LoraLoader lists it.
    name = saved_event["saved"][0]["name"]
    assert name == f"kiln/{Path(state.run_dir).name}-step000002.safetensors" and name in bridge.lora_names()
    lora, metadata = lora_format.load_lora(comfy_dirs / "loras" / name)
    assert set(lora) == set(state.lora) and metadata["kiln.steps"] == "2"
    assert metadata["kiln.run"] == Path(state.run_dir).name  # the run that wrote it, as Save LoRA records it

    # Queueing again: the node's fingerprint moved on (ComfyUI runs it instead of reusing the cached
    # outputs) and the run resumes at step 4 with its history.
    assert tn.KilnTrainLoRA.fingerprint_inputs() == fingerprint + 1
    finished = train().result[2]
    assert finished.step == 8 and finished.run_dir == state.run_dir
    # One run on the dashboard across the stop and the resume: the same entry, its history joined, finished.
    resumed = dashboard.REGISTRY.answer("GET", events[-1][1]["id"])[1]
    assert resumed["id"] == run_id and resumed["start_step"] == 4 and resumed["status"] == "finished"
    assert resumed["history"]["step"] == list(range(1, 9)) and resumed["prompt_ids"] == ["prompt-1"]
    assert [r["id"] for r in dashboard.REGISTRY.answer("GET")[1]["runs"] if r["name"] == "live"] == [run_id]
    assert [s["step"] for s in resumed["samples"]] == [2, 4, 6, 8]


def test_checkpoint_loras_go_to_models_loras_kiln_and_leave_the_run_identity_alone(comfy_dirs, monkeypatch):
    """Training Options' checkpoint_loras: each checkpoint's LoRA (and the last step's) is also written where
    LoraLoader lists it, named by run and step, and shown on the dashboard; turning it off afterwards finds
    the same run (it is an output setting, not part of what the run trains)."""
    model, vae, clip = tc.tiny_flux2(comfy_dirs), tc.tiny_vae(flux2=True), tc.tiny_klein_clip()
    ds = encoded_dataset(comfy_dirs, vae, clip)
    saved: list[dict] = []
    monkeypatch.setattr(bridge, "send_event", lambda name, data: saved.extend(data.get("saved", [])))

    def train(checkpoint_loras: bool):
        return tn.KilnTrainLoRA.execute(
            model,
            ds,
            steps=5,
            learning_rate=1e-3,
            rank=4,
            alpha=4.0,
            optimizer="adamw",
            preset="none",
            backend="torch",
            seed=1,
            options={
                "device": "cpu",
                "mixed_precision": "no",
                "checkpoint_every": 2,
                "run_name": "ckl",
                "log_every": 1,
                "checkpoint_loras": checkpoint_loras,
            },
        )

    state = train(True).result[2]
    run = Path(state.run_dir).name
    expected = [f"kiln/{run}-step{step:06d}.safetensors" for step in (2, 4, 5)]  # every 2 steps, and the end
    assert sorted(
        p.relative_to(comfy_dirs / "loras").as_posix() for p in (comfy_dirs / "loras").rglob("*.safetensors")
    ) == expected and all(name in bridge.lora_names() for name in expected)
    assert [entry["name"] for entry in saved][-3:] == expected
    for step, name in zip((2, 4, 5), expected):
        lora, metadata = lora_format.load_lora(comfy_dirs / "loras" / name)
        assert set(lora) == set(state.lora) and metadata["kiln.steps"] == str(step) and metadata["kiln.run"] == run
        assert bridge.unmatched_lora_keys(model, bridge.load_lora_file(comfy_dirs / "loras" / name)) == []
    again = train(False)
    assert "already trained" in again.ui.value and again.result[2].run_dir == state.run_dir


def test_pause_resume_and_stop_while_paused_from_the_dashboard_with_the_grid_and_held_out_loss(comfy_dirs, monkeypatch):
    """Pause after step 2: the loop waits inside the node (it is still executing: no further step, no event)
    until Resume; a second Pause at step 4 ends by ComfyUI's own stop button, which saves a resumable
    checkpoint at step 4. Samples every 2 steps build <run>/samples/grid.png (shown through kiln.grid), and
    a held-out image gives the dashboard its second loss line."""
    import kiln_pack.trainer.run.pause as pause

    model, ds, validation = sampled_run_inputs(comfy_dirs)
    events: list[tuple[str, dict]] = []
    waits: list[int] = []

    def send_event(name, data):
        events.append((name, data))
        if name == "kiln.progress" and data["step"] in (2, 4):
            assert dashboard.REGISTRY.answer("POST", data["run_id"], "pause")[0] == 202
        return True

    def sleep(seconds):  # the paused loop polls: Resume at its 3rd wait, ComfyUI's stop in the second pause
        step = [d for n, d in events if n == "kiln.progress"][-1]
        waits.append(step["step"])
        assert dashboard.REGISTRY.answer("GET", step["run_id"])[1]["pause_requested"]
        if waits.count(step["step"]) == 3:
            if step["step"] == 2:
                assert dashboard.REGISTRY.answer("POST", step["run_id"], "resume")[0] == 202
            else:
                import comfy.model_management as mm

                mm.interrupt_current_processing(True)

    monkeypatch.setattr(pause.time, "sleep", sleep)
    monkeypatch.setattr(bridge, "send_event", send_event)
    monkeypatch.setattr(bridge, "executing_node", lambda: ("kiln-pause-test", "prompt-2"))
    with pytest.raises(bridge.Interrupted):
        tn.KilnTrainLoRA.execute(
            model,
            ds,
            steps=8,
            learning_rate=1e-3,
            rank=4,
            alpha=4.0,
            optimizer="adamw",
            preset="none",
            backend="torch",
            seed=1,
            validation=validation,
            options={
                "device": "cpu",
                "mixed_precision": "no",
                "checkpoint_every": 0,
                "run_name": "paused",
                "log_every": 1,
                "holdout": 1,
                "holdout_every": 2,
            },
        )
    import comfy.model_management as mm

    mm.interrupt_current_processing(False)
    assert waits == [2, 2, 2, 4, 4, 4]
    # The loop's own word: the memory plan before step 1, paused after step 2, on again, paused after step 4,
    # then the run ended (not paused).
    runs = [d for n, d in events if n == "kiln.run"]
    assert runs[1]["plan"] and runs[1]["plan"][0].startswith("memory plan: "), runs[1]
    assert [(d["step"], d["paused"]) for d in runs] == [
        (0, False),
        (0, False),
        (2, True),
        (2, False),
        (4, True),
        (4, False),
        (4, False),
    ]
    progress = [data for name, data in events if name == "kiln.progress"]
    assert [p["step"] for p in progress] == [1, 2, 3, 4]  # nothing ran while paused
    assert [p["holdout_loss"] is not None for p in progress] == [False, True, False, True]
    assert events[-1][0] == "kiln.run" and events[-1][1]["status"] == "interrupted"
    run_dir = next(p for p in (comfy_dirs / "output" / "kiln").iterdir() if p.name.startswith("paused"))
    assert (run_dir / "step-000004" / "run.json").is_file()  # saved on ComfyUI's stop
    grids = [data for name, data in events if name == "kiln.grid"]
    assert [g["step"] for g in grids] == [2, 4]
    assert (comfy_dirs / "temp" / grids[-1]["image"]["subfolder"] / grids[-1]["image"]["filename"]).is_file()
    with Image.open(run_dir / "samples" / "grid.png") as grid:
        assert grid.height > 2 * 32 and grid.width > 32  # two rows of 32 px samples, labelled
    assert sorted(p.name for p in (run_dir / "samples").glob("step-*.png")) == [
        "step-000002-p0.png",
        "step-000004-p0.png",
    ]


def test_chained_validation_settings_sample_each_prompt_in_a_grid_column_headed_by_its_text(comfy_dirs, monkeypatch):
    """Two Validation Settings chained (the second's `validation` input takes the first): Train LoRA samples
    both prompts at each sampling step, in chain order, as often as the smaller `every` asks; the grid has a
    column per prompt, headed by the text of the CLIP Text Encode behind each `positive` (found through the
    queued prompt, through a Flux Guidance node for the second)."""
    from kiln_pack.nodes.train_nodes import io
    import kiln_pack.trainer.samples.grid as sample_grid

    model, vae, clip = tc.tiny_flux2(comfy_dirs), tc.tiny_vae(flux2=True), tc.tiny_klein_clip()
    ds = encoded_dataset(comfy_dirs, vae, clip)
    queued = {  # the API-format prompt ComfyUI hands the nodes (hidden PROMPT), as the frontend sends it
        "1": {"class_type": "CLIPTextEncode", "inputs": {"text": "kiln on a hill", "clip": ["9", 0]}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "kiln at night", "clip": ["9", 0]}},
        "3": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["2", 0], "guidance": 3.5}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["9", 0]}},
        "10": {
            "class_type": "KilnValidationSettings",
            "inputs": {"positive": ["1", 0], "negative": ["4", 0]},
            "_meta": {"title": "Kiln Validation Settings"},
        },
        "11": {
            "class_type": "KilnValidationSettings",
            "_meta": {"title": "Night"},
            "inputs": {"positive": ["3", 0], "negative": ["4", 0], "validation": ["10", 0]},
        },
    }

    def settings(node_id: str, text: str, every: int, before=None):
        node = tn.KilnValidationSettings.PREPARE_CLASS_CLONE(  # how ComfyUI runs a V3 node: hidden inputs set
            {"hidden_inputs": {io.Hidden.prompt: queued, io.Hidden.unique_id: node_id}}
        )
        return node.execute(
            positive=tc.conditioning(clip, text),
            negative=tc.conditioning(clip, ""),
            vae=vae,
            seed=0,
            steps=1,
            cfg=1.0,
            sampler_name="euler",
            scheduler="simple",
            width=32,
            height=32,
            every=every,
            validation=before,
        ).result[0]

    chain = settings("11", "kiln at night", 4, before=settings("10", "kiln on a hill", 2))
    assert chain.prompts == ["kiln on a hill", "kiln at night"] and chain.every == 2
    events: list[tuple[str, dict]] = []
    monkeypatch.setattr(bridge, "send_event", lambda name, data: events.append((name, data)) or True)
    result = tn.KilnTrainLoRA.execute(
        model,
        ds,
        steps=4,
        learning_rate=1e-3,
        rank=4,
        alpha=4.0,
        optimizer="adamw",
        preset="none",
        backend="torch",
        seed=1,
        validation=chain,
        options={"device": "cpu", "mixed_precision": "no", "checkpoint_every": 0, "run_name": "chained"},
    )
    assert result.result[4].shape[0] == 4  # 2 prompts × steps 2 and 4
    samples = [data for name, data in events if name == "kiln.sample"]
    assert [(s["step"], s["image"]["filename"].rsplit("-", 1)[1]) for s in samples] == [
        (2, "p0.jpg"),
        (2, "p1.jpg"),
        (4, "p0.jpg"),
        (4, "p1.jpg"),
    ]
    assert [data["step"] for name, data in events if name == "kiln.grid"] == [2, 4]  # once per sampling step
    run_dir = Path(result.result[2].run_dir)
    assert sorted(p.name for p in (run_dir / "samples").glob("step-*.png")) == [
        "step-000002-p0.png",
        "step-000002-p1.png",
        "step-000004-p0.png",
        "step-000004-p1.png",
    ]
    # The grid is exactly the one headed by the two prompts' texts (not by the node's name).
    expected = sample_grid.SampleGrid(run_dir, ["kiln on a hill", "kiln at night"]).load_existing().render()
    by_node = sample_grid.SampleGrid(run_dir, ["Validation Settings"] * 2).load_existing().render()
    with Image.open(run_dir / "samples" / "grid.png") as grid:
        written = np.asarray(grid.convert("RGB"))
    assert written.shape[1] == sample_grid.LABEL_PX + 2 * (sample_grid.CELL_PX + sample_grid.GAP_PX)
    assert np.array_equal(written, np.asarray(expected)) and not np.array_equal(written, np.asarray(by_node))


def test_the_grid_header_falls_back_to_the_node_title_without_a_prompt_text():
    import kiln_pack.nodes.validation_chain as vc

    queued = {
        "5": {"class_type": "StringConcat", "inputs": {"a": ["6", 0]}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": ["5", 0]}},  # text computed by a node
        "7": {"class_type": "PrimitiveStringMultiline", "inputs": {"value": "  a kiln, in watercolour "}},
        "8": {"class_type": "CLIPTextEncode", "inputs": {"text": ["7", 0]}},
        "9": {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["8", 0], "latent": ["3", 0]}},
        "10": {
            "class_type": "KilnValidationSettings",
            "inputs": {"positive": ["6", 0]},
            "_meta": {"title": "Style check"},
        },
        "11": {"class_type": "KilnValidationSettings", "inputs": {"positive": ["9", 0]}},
        "12": {"class_type": "KilnValidationSettings", "inputs": {"positive": ["6", 0]}},
    }
    assert vc.header(queued, "10") == "Style check"  # no text to find: the node's title
    assert vc.header(queued, "11") == "a kiln, in watercolour"  # through a primitive and a reference
    assert vc.header(queued, "12") == vc.header(None, None) == "Validation Settings"
