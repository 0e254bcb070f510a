"""The live dashboard end to end: a real ComfyUI (COMFYUI_PATH) with the pack, its frontend in headless
Chromium driven by playwright-core (tests/web/e2e_dashboard.mjs), training the tiny Flux2 workflow.

Needs COMFYUI_PATH, node, Chromium (`apt-get install chromium`, or CHROMIUM=/path) and playwright-core
(`npm install` at the repository root; ./scripts/test installs both in CI); skips with the reason
otherwise, and fails in CI. The browser loads the
workflow (Train LoRA with validation samples every 2 steps), queues it as the Queue button does, and
checks on the Train LoRA node and in the Kiln sidebar tab: the loss curve, the figures, the bucket
distribution and a sample thumbnail; then Save now (a LoRA appears in models/loras/kiln/), Stop (a
resumable checkpoint, the run says stopped, the nodes after it skipped), queueing again (the run resumes from
that step) and Stop & save (the run says its LoRA goes on). No
console errors may come from Kiln's files. The screenshot is kept as a CI artifact,
runs/test-reports/dashboard-<ComfyUI version>.png; KILN_DASHBOARD_SCREENSHOT=docs/dashboard.png copies it
there too (for the README).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

from helpers import comfy_env  # noqa: E402

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
COMFY = comfy_env.require_comfy()  # skips the module without COMFYUI_PATH

from helpers.comfy_server import drive, driver_report, require_browser, running, tiny_base  # noqa: E402

require_browser("the dashboard e2e test")  # skips the module without node/Chromium/playwright (fails in CI)

TOTAL_STEPS = 1000  # far more than the test waits for: it stops the run
MIN_POINTS = int(os.environ.get("KILN_E2E_MIN_POINTS", "4"))


def dashboard_workflow() -> dict:
    """tiny_flux2_api.json with many steps and validation samples every 2 steps (no Save LoRA node)."""
    prompt = json.loads((HERE / "workflows" / "tiny_flux2_api.json").read_text(encoding="utf-8"))
    del prompt["9"]
    prompt["8"]["inputs"].update(steps=TOTAL_STEPS, validation=["12", 0])
    prompt["7"]["inputs"].update(
        log_every=1, checkpoint_every=0, run_name="dash", lr_schedule="cosine_with_warmup", warmup_steps=8
    )
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
            "steps": 2,
            "cfg": 1.0,
            "sampler_name": "euler",
            "scheduler": "simple",
            "width": 64,
            "height": 64,
            "every": 2,
        },
    }
    return prompt


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running(COMFY, tiny_base(tmp_path_factory.mktemp("comfy_dash"))) as comfy:
        yield comfy


def kiln_errors(report: dict) -> list[str]:
    """Console errors, page errors and failed requests that come from Kiln's files or routes."""
    found = [
        f"console: {e['text']} ({e['url']})"
        for e in report["console"]
        if e["type"] == "error" and "kiln" in (e["text"] + e["url"]).lower()
    ]
    found += [f"page error: {e['text']}" for e in report["pageErrors"] if "kiln" in (e["text"] + e["stack"]).lower()]
    found += [f"request failed: {r['url']} {r['error']}" for r in report["failedRequests"] if "kiln" in r["url"]]
    return found


def test_dashboard_shows_a_run_and_stops_it(server, tmp_path):
    workflow = tmp_path / "workflow.json"
    workflow.write_text(json.dumps(dashboard_workflow()), encoding="utf-8")
    shots = tmp_path / "browser"
    started = time.monotonic()
    done = drive(
        "e2e_dashboard.mjs",
        server,
        shots,
        "--workflow",
        str(workflow),
        "--min-points",
        str(MIN_POINTS),
        "--timeout-s",
        "420",
    )
    report = driver_report(done)
    assert report["ok"], f"{report.get('error')}\n{done.stderr[-3000:]}\nserver:\n{server.log_tail(80)}"
    assert kiln_errors(report) == [], kiln_errors(report)

    # The dashboard widget is not a value: not in the saved workflow's widgets_values, not in the prompt.
    serialized = report["serialized"]
    assert "kiln_dashboard" in serialized["widgets"] and "kiln_dashboard" not in serialized["promptInputs"]
    assert len(serialized["widgetsValues"]) == len(serialized["widgets"]) - 1, serialized

    # While it trained: the curve, the figures, the buckets and a sample, on the node and in the sidebar.
    node, panel = report["running"]["node"], report["running"]["panel"]
    assert node["run"] and panel["run"] == node["run"] and node["status"] == "running"
    for view in (node, panel):
        assert view["points"] >= MIN_POINTS and view["smoothPath"].startswith("M"), view
        assert re.fullmatch(r"step \d+ / 1,000", view["steps"]), view["steps"]
        for key in ("loss", "smooth", "lr", "rate", "eta"):
            assert view["figures"][key] != "—", (key, view["figures"])
        assert "64x64" in view["buckets"] and "64x48" in view["buckets"], view["buckets"]  # 80x64 → 64x48 at 64 px
        assert view["plan"].startswith("memory plan: frozen base in memory"), view["plan"]  # a CPU run: none streams
        assert view["sample"]["width"] > 0 and "/view?" in view["sample"]["src"], view["sample"]
        assert "type=temp" in view["sample"]["src"]

    # With the sample grid there, Stop / Save now / Pause stay in the node's header, in view and uncovered, also
    # with the dashboard's body scrolled to its end; the grid is a thumbnail; ComfyUI drew no preview of its own.
    for stage, header in report["header"].items():
        assert header["status"] == "running" and header["bodyScrolls"] and 0 < header["gridHeight"] <= 80, header
        for name in ("Stop", "Save now", "Pause"):
            assert header["buttons"][name] == {"inside": True, "onTop": True, "enabled": True}, (stage, name, header)
    assert report["comfyPreviews"] == 0

    # Save now wrote a LoRA of the current weights into models/loras/kiln/, loadable as any Kiln LoRA.
    saved_name = re.search(r"saved (kiln/\S+\.safetensors)", report["saved"]["note"]).group(1)
    saved = server.base / "models" / "loras" / saved_name
    from trainer.lora import files as lora_format

    lora, metadata = lora_format.load_lora(saved)
    assert lora and metadata["kiln.arch"] == "flux2_klein"

    # Stop: the run says stopped, at a step short of the total, with a resumable checkpoint there.
    runs = server.get("/kiln/runs")["runs"]
    assert str(server.base) not in json.dumps(runs)  # names and ids, no paths
    first = report["stopped"]["run"]  # as the server had it then
    assert first["id"] == report["stopped"]["node"]["run"]
    assert first["status"] == "stopped" and 0 < first["step"] < TOTAL_STEPS
    assert "the nodes after Train LoRA were skipped" in first["message"]  # Stop: the run is not done
    assert report["stopped"]["panel"]["status"] == "stopped"
    checkpoint = server.base / "output" / "kiln" / first["name"] / f"step-{first['step']:06d}"
    assert (checkpoint / "run.json").is_file(), sorted(p.name for p in checkpoint.parent.iterdir())

    # Queueing again re-ran Train LoRA (its fingerprint moved on) and resumed at the stopped step: the same
    # run on the dashboard (one entry, the history joined, the newest status), not a second one.
    second = server.get(f"/kiln/runs/{report['resumed']['run']}")
    assert str(server.base) not in json.dumps(second)
    assert second["id"] == first["id"] and [r["id"] for r in runs if r["name"] == first["name"]] == [first["id"]]
    assert second["name"] == first["name"] and second["start_step"] == first["step"]
    assert second["status"] == "stopped" and second["step"] > first["step"]
    assert "its LoRA goes on" in second["message"]  # the node's Stop & save button
    assert second["history"]["step"][: first["step"]] == list(range(1, first["step"] + 1))

    screenshot = shots / "dashboard.png"
    assert screenshot.stat().st_size > 10_000
    artifacts = REPO / "runs" / "test-reports"
    artifacts.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(screenshot, artifacts / f"dashboard-{comfy_env.version()}.png")
    if os.environ.get("KILN_DASHBOARD_SCREENSHOT"):
        shutil.copyfile(screenshot, os.environ["KILN_DASHBOARD_SCREENSHOT"])
    print(f"\ndashboard e2e: {time.monotonic() - started:.0f} s, screenshot {screenshot}")
