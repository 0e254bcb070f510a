"""What Kiln draws on its nodes, end to end: a real ComfyUI (COMFYUI_PATH) with the pack, its frontend in headless
Chromium driven by playwright-core (tests/web/e2e_node_ui.mjs), running the tiny Flux2 workflow for a few steps with
validation samples and Save LoRA.

Checks each node's report box (Load Dataset's check, Train LoRA's summary, Save LoRA's "saved …"), that no box or
dashboard enters the saved workflow or the prompt, the idle Train LoRA as one line, the dashboard's header and
buttons in view with a sample grid present (also with its body scrolled to the end), a second workflow tab with
the same node ids staying idle and without reports, and the first tab's run and reports coming back after a tab
switch and a page reload. Needs what test_dashboard_e2e.py needs (skips with the reason, fails in CI). The
screenshots are kept under runs/test-reports/node-ui-<ComfyUI version>/.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

from helpers import comfy_env  # noqa: E402

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
COMFY = comfy_env.require_comfy()  # skips the module without COMFYUI_PATH

from helpers.comfy_server import drive, driver_report, require_browser, running, tiny_base  # noqa: E402

require_browser("the node UI e2e test")  # skips the module without node/Chromium/playwright (fails in CI)

REPORTING = ("4", "8", "9")  # Load Dataset, Train LoRA, Save LoRA
FRONTEND_ONLY = {"kiln_report", "kiln_dashboard"}


def node_ui_workflow() -> dict:
    """tiny_flux2_api.json for 4 steps with validation samples every 2 steps (a sample grid), then Save LoRA."""
    prompt = json.loads((HERE / "workflows" / "tiny_flux2_api.json").read_text(encoding="utf-8"))
    prompt["8"]["inputs"].update(steps=4, validation=["12", 0])
    prompt["7"]["inputs"].update(run_name="node_ui", checkpoint_every=0)
    prompt["9"]["inputs"].update(name="kiln_test/node_ui")
    for node_id, text in (("10", "kiln, a photo"), ("11", "")):
        prompt[node_id] = {
            "class_type": "CLIPTextEncode",
            "inputs": {"text": text, "clip": ["2", 0]},
            "_meta": {"title": "Positive" if text else "Negative"},
        }
    prompt["12"] = {
        "class_type": "KilnValidationSettings",
        "_meta": {"title": "Kiln Validation Settings"},
        "inputs": {
            "positive": ["10", 0],
            "negative": ["11", 0],
            "vae": ["3", 0],
            "seed": 0,
            "steps": 1,
            "cfg": 1.0,
            "sampler_name": "euler",
            "scheduler": "simple",
            "width": 64,
            "height": 64,
            "every": 2,
        },
    }
    return prompt


def kiln_errors(report: dict) -> list[str]:
    """Console errors, page errors and failed requests that come from Kiln's files or routes."""
    found = [
        f"console: {e['text']} ({e['url']})"
        for e in report["console"]
        if e["type"] == "error" and "kiln" in (e["text"] + e["url"]).lower()
    ]
    found += [f"page error: {e['text']}" for e in report["pageErrors"] if "kiln" in (e["text"] + e["stack"]).lower()]
    return found


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One browser session over the whole story (a training run is the slow part); its report, screenshots kept."""
    base = tmp_path_factory.mktemp("comfy_node_ui")
    workflow = base / "workflow.json"
    workflow.write_text(json.dumps(node_ui_workflow()), encoding="utf-8")
    shots = base / "browser"
    with running(COMFY, tiny_base(base / "comfy")) as server:
        done = drive("e2e_node_ui.mjs", server, shots, "--workflow", str(workflow), "--timeout-s", "420")
        log = server.log_tail(60)
    artifacts = REPO / "runs" / "test-reports" / f"node-ui-{comfy_env.version()}"
    artifacts.mkdir(parents=True, exist_ok=True)
    for picture in shots.glob("*.png"):
        shutil.copyfile(picture, artifacts / picture.name)
    found = driver_report(done)
    assert found["ok"], f"{found.get('error')}\n{done.stderr[-3000:]}\nserver:\n{log}"
    assert kiln_errors(found) == [], kiln_errors(found)
    return found


def test_each_node_draws_its_report(report):
    nodes = report["ran"]["nodes"]
    assert "usable images" in nodes["4"]["report"]["text"], nodes["4"]["report"]
    assert "run folder:" in nodes["8"]["report"]["text"] and "trained to step 4/4" in nodes["8"]["report"]["text"]
    saved = nodes["9"]["report"]["text"]
    assert saved.startswith("saved ") and "kiln_test/node_ui.safetensors" in saved, saved
    for node_id in REPORTING:
        box = nodes[node_id]["report"]
        assert box["tag"] == "TEXTAREA" and box["readOnly"] and box["height"] >= 20, box  # selectable, not editable
        assert "mono" in box["font"].lower(), box["font"]
        assert nodes[node_id]["widgets"].count("kiln_report") == 1, nodes[node_id]["widgets"]  # drawn once
    assert all(report["idle"]["nodes"][node_id]["report"] is None for node_id in REPORTING)  # none before a run


def test_reports_and_dashboard_stay_out_of_the_workflow_and_the_prompt(report):
    idle, ran = report["idle"], report["ran"]
    assert ran["widgetsValues"] == idle["widgetsValues"], (idle["widgetsValues"], ran["widgetsValues"])
    assert ran["promptInputs"] == idle["promptInputs"]
    for node_id in REPORTING:
        assert not FRONTEND_ONLY & set(ran["promptInputs"][node_id]), ran["promptInputs"][node_id]
        # frontend-only widgets come last, so the positional widgets_values keep their slots
        widgets = ran["nodes"][node_id]["widgets"]
        assert len(ran["widgetsValues"][node_id]) <= len([w for w in widgets if w not in FRONTEND_ONLY])


def test_idle_train_lora_is_one_line(report):
    idle = report["idle"]
    assert idle["dashboard"]["status"] == "idle" and idle["dashboard"]["run"] == ""
    assert idle["dashboard"]["height"] <= 40, idle["dashboard"]
    assert idle["nodes"]["8"]["size"][1] <= idle["idleMinHeight"] + 10, (idle["nodes"]["8"], idle["idleMinHeight"])


def test_dashboard_header_and_buttons_stay_in_view_with_a_grid(report):
    for stage in ("ran", "scrolled"):
        dashboard = report[stage]["dashboard"]
        assert dashboard["status"] == "finished" and dashboard["grid"]["width"] > 0, dashboard
        assert dashboard["grid"]["height"] <= 80, dashboard["grid"]  # a thumbnail on the node
        assert dashboard["bodyScrolls"] and dashboard["topInside"], dashboard
        for name, button in dashboard["buttons"].items():
            assert button == {"inside": True, "onTop": True}, (stage, name, button)


def test_a_second_tab_with_the_same_node_ids_shows_no_run_of_the_first(report):
    second = report["second"]
    assert second["tab"].endswith("/kiln_node_ui_second.json") and report["ran"]["tab"].endswith("/kiln_node_ui.json")
    assert second["dashboard"]["status"] == "idle" and second["dashboard"]["run"] == "", second["dashboard"]
    assert all(second["nodes"][node_id]["report"] is None for node_id in REPORTING), second["nodes"]
    assert second["nodes"]["8"]["size"][1] <= second["idleMinHeight"] + 10


@pytest.mark.parametrize("stage", ["back", "reloaded"])
def test_the_first_tab_shows_its_run_and_reports_again(report, stage):
    """After switching back to its tab, and after a page reload (ComfyUI reopens the tab)."""
    again, ran = report[stage], report["ran"]
    assert again["tab"] == ran["tab"]
    assert again["dashboard"]["run"] == ran["dashboard"]["run"] and again["dashboard"]["status"] == "finished"
    for node_id in REPORTING:
        assert again["nodes"][node_id]["report"]["text"] == ran["nodes"][node_id]["report"]["text"]
