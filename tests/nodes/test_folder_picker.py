"""Load Dataset's and Load Run's folder pickers against a real ComfyUI (COMFYUI_PATH) with the pack: the
/kiln/folders routes list what exists (names only), and in ComfyUI's own frontend (headless Chromium) the
"choose…" button opens that list and types the picked name into the text field, while the workflow's
widgets_values and the prompt stay what they were without the button. Skips without node, Chromium or
playwright-core (fails in CI).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

from helpers import comfy_env  # noqa: E402

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
COMFY = comfy_env.require_comfy()  # skips the module without COMFYUI_PATH (fails in CI)

from helpers.comfy_server import (  # noqa: E402
    TINY_FILES,
    drive,
    driver_report,
    make_workflows,
    require_browser,
    running,
    tiny_base,
)

DATASET = TINY_FILES["dataset"]
EDITS = TINY_FILES["edit_dataset"]
CLIPS = TINY_FILES["clip_dataset"]


def fake_checkpoint(run_dir: Path, step: int, total: int | None = None) -> None:
    """What state.list_checkpoints counts as a complete checkpoint, with the run's total steps in its run.json
    (the picker reads nothing more)."""
    folder = run_dir / f"step-{step:06d}"
    folder.mkdir(parents=True)
    (folder / "state.safetensors").write_bytes(b"")
    (folder / "run.json").write_text(json.dumps({"config": {"steps": total}} if total else {}), encoding="utf-8")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tiny_base(tmp_path_factory.mktemp("comfy_folders"))
    (base / "input" / "no_images_here").mkdir()  # not a dataset: no images
    (base / "input" / "no_images_here" / "notes.txt").write_text("x", encoding="utf-8")
    (base / "input" / "loose.png").write_bytes(b"")  # a file, not a folder
    kiln = base / "output" / "kiln"
    fake_checkpoint(kiln / "portrait-0a1b2c3d4e", 4)
    fake_checkpoint(kiln / "portrait-0a1b2c3d4e", 12)  # a run folder named the old way
    fake_checkpoint(kiln / "portrait", 4, total=8)  # stopped (or resumed and stopped again)
    fake_checkpoint(kiln / "portrait-2", 8, total=8)
    times = {"portrait-0a1b2c3d4e": 1, "portrait": 3, "portrait-2": 2}
    for name, seconds in times.items():  # newest first: by the folder's time
        os.utime(kiln / name, (1_700_000_000 + seconds, 1_700_000_000 + seconds))
    (kiln / "crashed-before-a-checkpoint" / ".tmp-step-000002").mkdir(parents=True)
    with running(COMFY, base) as comfy:
        yield comfy


def test_the_routes_list_datasets_and_runs_by_name(server):
    datasets = server.get("/kiln/folders/datasets")
    # The test server's three datasets (tiny_base); an edit dataset's control/ images are not counted as its own.
    assert datasets == {
        "root": "input",
        "folders": [
            {"name": CLIPS, "detail": "2 clips, 2 captions"},
            {"name": DATASET, "detail": "4 images, 4 captions"},
            {"name": EDITS, "detail": "2 images, 2 captions"},
        ],
    }
    runs = server.get("/kiln/folders/runs")
    # One entry per run folder (a stopped run resumes into its own), its newest state; no hashes in new names.
    assert runs == {
        "root": "output/kiln",
        "folders": [
            {"name": "portrait", "detail": "step 4 of 8"},
            {"name": "portrait-2", "detail": "finished, step 8"},
            {"name": "portrait-0a1b2c3d4e", "detail": "step 12"},
        ],
    }


def test_an_unknown_list_is_refused_with_the_known_ones(server):
    status, body = server._request("/kiln/folders/models")
    assert status == 404 and "datasets, runs" in json.loads(body)["error"]


def test_the_choose_button_types_the_picked_folder(server, tmp_path):
    require_browser("the folder picker test")
    picks = {"KilnLoadDataset": DATASET, "KilnLoadRun": "portrait-2"}
    done = drive(
        "folder_picker.mjs",
        server,
        tmp_path,
        *[arg for node, name in picks.items() for arg in ("--pick", f"{node}={name}")],
        timeout=600,
    )
    report = driver_report(done)
    assert report["ok"], report.get("error")
    info = server.get("/object_info", timeout=60)
    mw = make_workflows()
    for node_type, name in picks.items():
        seen = report["nodes"][node_type]
        assert "error" not in seen, seen
        field = {"KilnLoadDataset": "folder", "KilnLoadRun": "run_folder"}[node_type]
        assert any(entry.startswith(name) for entry in seen["menu"]), seen["menu"]
        assert dict(seen["widgets"])[field] == name
        # The button is not part of the workflow or the prompt: the saved values are the node's own slots.
        slots = mw.widget_slots(info[node_type])
        assert len(seen["serialized"]) == len(slots), (seen["serialized"], slots)
        assert seen["serialized"][[s.removesuffix(".control") for s in slots].index(field)] == name
        assert seen["prompt"][field] == name and seen["label"] not in seen["prompt"], seen["prompt"]
    assert report["nodes"]["KilnLoadDataset"]["menu"] == [
        f"{CLIPS}   (2 clips, 2 captions)",
        f"{DATASET}   (4 images, 4 captions)",
        f"{EDITS}   (2 images, 2 captions)",
    ]
    assert report["nodes"]["KilnLoadRun"]["menu"] == [
        "portrait   (step 4 of 8)",
        "portrait-2   (finished, step 8)",
        "portrait-0a1b2c3d4e   (step 12)",
    ]
    kiln_errors = [e for e in report["console"] if "kiln" in (e["text"] + e["url"]).lower()]
    assert kiln_errors == [] and [e for e in report["pageErrors"] if "kiln" in e.lower()] == []
