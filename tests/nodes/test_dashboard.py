"""nodes/dashboard.py without ComfyUI: the run registry, the answers of /kiln/runs, and the routes on aiohttp.

The module imports nothing from the pack or ComfyUI, so it is loaded from its file (importing the
`nodes` package would import ComfyUI's comfy_api).
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2] / "nodes" / "dashboard.py"
spec = importlib.util.spec_from_file_location("kiln_dashboard_under_test", SOURCE)
dashboard = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = dashboard  # dataclasses look their module up while the file runs
spec.loader.exec_module(dashboard)


@dataclass
class Report:  # the fields of trainer.run.loop.Report the registry reads
    step: int
    total_steps: int = 10
    lr: float = 1e-3
    it_per_s: float = 2.0
    eta_s: float = 4.0
    peak_memory_bytes: int = 0
    loss: float | None = 0.5
    loss_smooth: float | None = 0.5


def started(registry, **details):
    details = {"node": "8", "prompt_id": "p1", "arch": "flux2_klein", "buckets": {"64x64": 2, "80x64": 2}} | details
    return registry.start("tiny-0a1b2c3d4e", 10, **details)


def test_a_run_records_its_steps_and_answers_with_names_only():
    registry = dashboard.Registry()
    run = started(registry)
    payload = registry.record(run, Report(1, loss=0.9))
    registry.record(run, Report(2, loss=None, loss_smooth=None))  # a step without a loss reading
    registry.record(run, Report(3, loss=float("nan")))
    registry.add_sample(run, 3, {"filename": f"{run.id}-step000003.jpg", "subfolder": "kiln", "type": "temp"})
    registry.add_saved(run, 3, "kiln/tiny-0a1b2c3d4e-step000003.safetensors")

    assert payload["run_id"] == run.id and payload["node"] == "8" and payload["status"] == "running"
    assert {
        "step",
        "total",
        "lr",
        "loss",
        "loss_smooth",
        "it_per_s",
        "eta_s",
        "peak_memory_bytes",
        "run",
        "started",
    } <= set(payload)  # the fields the event always had
    status, detail = registry.answer("GET", run.id)
    assert status == 200 and detail["step"] == 3 and detail["total"] == 10
    assert detail["history"] == {
        "step": [1, 3],
        "loss": [0.9, None],
        "lr_step": [1, 2, 3],
        "lr": [1e-3] * 3,
        "holdout_step": [],
        "holdout": [],
    }
    assert detail["figures"]["loss"] is None and detail["figures"]["it_per_s"] == 2.0
    assert detail["buckets"] == {"64x64": 2, "80x64": 2}
    assert detail["samples"][0]["image"]["type"] == "temp" and detail["saved"][0]["step"] == 3
    text = json.dumps(detail, allow_nan=False)  # NaN became null: valid JSON
    assert '"/' not in text  # no absolute file-system paths

    status, listing = registry.answer("GET")
    assert status == 200 and [r["id"] for r in listing["runs"]] == [run.id]
    assert "history" not in listing["runs"][0]


def test_stop_and_save_are_requests_the_training_thread_takes():
    registry = dashboard.Registry()
    run = started(registry)
    assert not registry.stop_wanted(run) and not registry.take_save(run)
    assert registry.answer("POST", run.id, "save")[0] == 202
    revs = [registry.answer("GET", run.id)[1]["rev"]]
    assert registry.take_save(run) and not registry.take_save(run)  # once per request
    revs.append(registry.answer("GET", run.id)[1]["rev"])
    revs.append(registry.add_saved(run, 2, "kiln/x-step000002.safetensors")["rev"])
    assert revs[0] < revs[1] < revs[2]  # every change a newer revision: a page drops an older summary
    status, body = registry.answer("POST", run.id, "stop")
    assert status == 202 and body["run"]["stop_requested"] and registry.stop_wanted(run)

    assert registry.stops("8") == 0
    registry.finish(run, dashboard.STOPPED, "stopped at step 4 from the dashboard")
    assert registry.stops("8") == 1 and registry.stops("9") == 0  # Train LoRA's fingerprint moves on
    status, body = registry.answer("POST", run.id, "stop")
    assert status == 409 and "queue the workflow again" in body["error"]


def test_stop_and_save_stops_and_lets_the_outputs_flow_the_stop_pressed_last_decides():
    registry = dashboard.Registry()
    run = started(registry)
    assert not registry.stop_saves(run) and not registry.answer("GET", run.id)[1]["stop_saves"]
    status, body = registry.answer("POST", run.id, "stop_save")
    assert status == 202 and body["run"]["stop_requested"] and body["run"]["stop_saves"]
    assert registry.stop_wanted(run) and registry.stop_saves(run)
    assert registry.answer("POST", run.id, "stop")[0] == 202  # Stop after Stop & save: blocked again
    assert registry.stop_wanted(run) and not registry.stop_saves(run)
    registry.answer("POST", run.id, "stop_save")
    registry.finish(run, dashboard.STOPPED, "stopped at step 4 from the dashboard")
    assert registry.stops("8") == 1  # re-queueing resumes it, as after Stop


def test_unknown_runs_and_actions_are_refused():
    registry = dashboard.Registry()
    run = started(registry)
    assert registry.answer("GET", "nope")[0] == 404
    assert registry.answer("POST", "nope", "stop")[0] == 404
    assert registry.answer("POST", run.id, "delete")[0] == 405
    assert registry.answer("GET", run.id, "stop")[0] == 405


def test_old_finished_runs_are_forgotten_running_ones_never():
    registry = dashboard.Registry(keep=3)
    running = [started(registry) for _ in range(4)]
    for run in running[:2]:
        registry.finish(run, dashboard.FINISHED)
    newer = [started(registry) for _ in range(2)]
    ids = set(registry.runs)
    assert running[0].id not in ids and running[1].id not in ids
    assert {r.id for r in running[2:] + newer} <= ids


def test_a_resumed_run_starts_with_its_history():
    registry = dashboard.Registry()
    run = started(registry, start_step=3)
    registry.preload(run, [1.0, float("inf"), 0.5], [1e-3, 1e-3, 1e-3])
    registry.record(run, Report(4, loss=0.4))
    detail = registry.answer("GET", run.id)[1]
    assert detail["start_step"] == 3
    assert detail["history"]["step"] == [1, 2, 3, 4] and detail["history"]["loss"] == [1.0, None, 0.5, 0.4]


def test_a_stopped_run_queued_again_is_the_same_entry_with_its_history_joined():
    """The run folder is the run: its next execution continues its entry (one id in the list, the newest
    status, the history from step 1, flags of the stopped execution cleared, the revision going on), while
    another folder, or the same folder running in another execution, gets an entry of its own."""
    registry = dashboard.Registry()
    first = started(registry, folder="/out/kiln/portrait")
    for step in (1, 2, 3, 4):
        registry.record(first, Report(step, total_steps=8, loss=1.0 / step))
    registry.add_sample(first, 2, {"filename": "a-step000002-p0.jpg", "subfolder": "kiln", "type": "temp"})
    registry.add_sample(first, 4, {"filename": "a-step000004-p0.jpg", "subfolder": "kiln", "type": "temp"})
    registry.answer("POST", first.id, "stop")
    rev = registry.finish(first, dashboard.STOPPED, "stopped at step 4")["rev"]
    other = started(registry, folder="/out/kiln/portrait-2")

    again = started(registry, folder="/out/kiln/portrait", start_step=3, prompt_id="p2")  # its checkpoint: step 3
    registry.preload(again, [1.0, 0.5, 1 / 3], [1e-3] * 3)
    registry.record(again, Report(4, total_steps=8, loss=0.2))
    assert again is first and other.id != first.id
    summary = registry.answer("GET", first.id)[1]
    assert summary["status"] == "running" and summary["message"] == "" and not summary["stop_requested"]
    assert summary["rev"] > rev and summary["start_step"] == 3 and summary["step"] == 4
    assert summary["prompt_id"] == "p2" and summary["prompt_ids"] == ["p1", "p2"]
    assert summary["history"]["step"] == [1, 2, 3, 4] and summary["history"]["loss"] == [1.0, 0.5, 1 / 3, 0.2]
    assert [s["step"] for s in summary["samples"]] == [2]  # step 4 is trained again: its sample goes
    registry.finish(again, dashboard.FINISHED)
    assert sorted(r["id"] for r in registry.answer("GET")[1]["runs"]) == sorted([first.id, other.id])
    assert started(registry, folder="/out/kiln/portrait").id == first.id
    assert started(registry, folder="/out/kiln/portrait").id != first.id  # that one runs: a second entry
    assert started(registry).id != started(registry).id  # no folder given: never joined


def test_long_histories_are_thinned_evenly_keeping_both_ends():
    assert dashboard.thin(5, 10) == [0, 1, 2, 3, 4]
    kept = dashboard.thin(100_000, 1500)
    assert kept[0] == 0 and kept[-1] == 99_999 and len(kept) <= 1500
    gaps = {b - a for a, b in itertools.pairwise(kept)}
    assert max(gaps) - min(gaps) <= 1
    registry = dashboard.Registry()
    run = started(registry)
    for step in range(1, 3001):
        registry.record(run, Report(step, total_steps=3000, loss=math.sin(step)))
    history = run.detail(max_points=100)["history"]
    assert len(history["step"]) == 100 and history["step"][-1] == 3000


def on_aiohttp(registry, scenario):
    """scenario(client) against the dashboard's routes on a real aiohttp server; its result."""
    web = pytest.importorskip("aiohttp.web")
    test_utils = pytest.importorskip("aiohttp.test_utils")

    async def serve():
        routes = web.RouteTableDef()
        dashboard.add_routes(routes, registry)
        app = web.Application()
        app.add_routes(routes)
        async with test_utils.TestClient(test_utils.TestServer(app)) as client:
            return await scenario(client)

    return asyncio.run(serve())


def test_routes_on_aiohttp():
    registry = dashboard.Registry()
    run = started(registry)
    registry.record(run, Report(1))

    async def scenario(client):
        listing = await (await client.get("/kiln/runs")).json()
        detail = await client.get(f"/kiln/runs/{run.id}")
        stop_save = await client.post(f"/kiln/runs/{run.id}/stop_save")
        stop = await client.post(f"/kiln/runs/{run.id}/stop")
        missing = await client.get("/kiln/runs/nope")
        return listing, detail.status, await detail.json(), stop_save.status, stop.status, missing.status

    listing, detail_status, detail, stop_save_status, stop_status, missing_status = on_aiohttp(registry, scenario)
    assert listing["runs"][0]["id"] == run.id
    assert detail_status == 200 and detail["history"]["step"] == [1]
    assert stop_save_status == 202 and stop_status == 202 and registry.stop_wanted(run)
    assert not registry.stop_saves(run)  # the stop pressed last
    assert missing_status == 404


def test_pause_and_resume_are_flags_the_training_thread_reads():
    registry = dashboard.Registry()
    run = started(registry)
    assert not registry.pause_wanted(run) and not registry.answer("GET", run.id)[1]["pause_requested"]
    status, body = registry.answer("POST", run.id, "pause")
    assert status == 202 and body["run"]["pause_requested"] and registry.pause_wanted(run)
    assert registry.answer("POST", run.id, "stop")[0] == 202  # Stop works while paused
    assert registry.pause_wanted(run) and registry.stop_wanted(run)
    status, body = registry.answer("POST", run.id, "resume")
    assert status == 202 and not body["run"]["pause_requested"] and not registry.pause_wanted(run)
    registry.answer("POST", run.id, "pause")
    registry.finish(run, dashboard.STOPPED)
    assert not run.summary()["pause_requested"]  # an ended run is not paused
    assert registry.answer("POST", run.id, "resume")[0] == 409


def test_a_torchrun_run_pauses_and_resumes_but_refuses_save_now_and_its_paused_state_is_relayed():
    registry = dashboard.Registry()
    run = started(registry, can_save=False)
    status, body = registry.answer("POST", run.id, "save")
    assert status == 409 and "torchrun child process" in body["error"] and "checkpoint_loras" in body["error"]
    assert not registry.take_save(run)
    status, body = registry.answer("POST", run.id, "pause")
    assert status == 202 and registry.pause_wanted(run) and not body["run"]["paused"] and not body["run"]["can_save"]
    assert registry.set_paused(run, True)["paused"] and registry.answer("GET", run.id)[1]["paused"]
    assert registry.answer("POST", run.id, "resume")[0] == 202 and not registry.pause_wanted(run)
    assert not registry.set_paused(run, False)["paused"]
    registry.set_paused(run, True)
    assert not registry.finish(run, dashboard.STOPPED)["paused"]  # an ended run is not paused


def test_held_out_losses_and_the_grid_are_in_the_answers():
    registry = dashboard.Registry()
    run = started(registry, start_step=2)
    registry.preload(run, [1.0, 0.9], [1e-3, 1e-3], [[2, 0.95]])
    plain = registry.record(run, Report(3))
    assert plain["holdout_loss"] is None
    payload = registry.record(run, Report(4, loss=None))
    payload = registry.record(run, HeldOut(5, holdout_loss=0.8))
    assert payload["holdout_loss"] == 0.8
    event = registry.set_grid(run, 5, {"filename": "x-grid-step000005.jpg", "subfolder": "kiln", "type": "temp"})
    assert event["step"] == 5 and event["image"]["filename"] == "x-grid-step000005.jpg"
    detail = registry.answer("GET", run.id)[1]
    assert detail["history"]["holdout_step"] == [2, 5] and detail["history"]["holdout"] == [0.95, 0.8]
    assert detail["figures"]["holdout_loss"] == 0.8 and detail["grid"]["step"] == 5
    registry.record(run, HeldOut(6, holdout_loss=float("nan")))
    assert registry.answer("GET", run.id)[1]["history"]["holdout"] == [0.95, 0.8]  # no point for NaN


@dataclass
class HeldOut(Report):
    holdout_loss: float | None = None


def test_pause_route_on_aiohttp():
    registry = dashboard.Registry()
    run = started(registry)

    async def scenario(client):
        paused = await client.post(f"/kiln/runs/{run.id}/pause")
        was = registry.pause_wanted(run)
        resumed = await client.post(f"/kiln/runs/{run.id}/resume")
        return paused.status, was, resumed.status, (await resumed.json())["run"]["pause_requested"]

    assert on_aiohttp(registry, scenario) == (202, True, 202, False)


@dataclass
class RanksReport(Report):  # a torchrun child's step (nodes/launch_nodes.report_of)
    peak_memory_per_rank: list = None


def test_a_several_gpu_step_carries_each_gpus_peak_to_the_event_and_the_run():
    registry = dashboard.Registry()
    run = started(registry)
    assert registry.record(run, Report(1))["peak_memory_per_gpu"] == []  # one process: none
    payload = registry.record(run, RanksReport(2, peak_memory_bytes=5, peak_memory_per_rank=[5, 7]))
    assert payload["peak_memory_per_gpu"] == [5, 7]
    status, detail = registry.answer("GET", run.id)
    assert status == 200 and detail["figures"]["peak_memory_per_gpu"] == [5, 7]
