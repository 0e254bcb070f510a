"""Every FLOAT widget of every Kiln node in ComfyUI's own frontend (COMFYUI_PATH; headless Chromium through
tests/web/float_widgets.mjs): it shows its default exactly, keeps a default typed back into its prompt (as
shown, and as a person writes it: 1e-8), and one arrow click each way moves it by exactly one step and back.

How the frontends (1.41.20 for ComfyUI 0.17, 1.49.6 for 0.33) treat a FLOAT input, which the expectations
below restate: the canvas draws `value.toFixed(p)` with p = max(0, -floor(log10(step))); an arrow adds or
takes one `step` and clamps to min/max; a typed text is evaluated as a number; then every new value is
rounded to 10^-p and to p decimals (the node's `round` does not lift that: p still comes from `step`).
In the Vue node mode (Nodes 2.0) both also hide inputs declared `advanced` until the node's "Show advanced
inputs"; the classic canvas shows them all. Checked on Training Options. Screenshots:
runs/test-reports/float-widgets-<ComfyUI version>/<node>.png, KilnTrainingOptions-vue(-advanced).png.
"""

from __future__ import annotations

import json
import math
import shutil
from decimal import Decimal
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

from helpers import comfy_env  # noqa: E402

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
COMFY = comfy_env.require_comfy()  # skips the module without COMFYUI_PATH (fails in CI)

from helpers.comfy_server import (  # noqa: E402
    drive,
    driver_report,
    make_workflows,
    require_browser,
    running,
    tiny_base,
)

mw = make_workflows()

require_browser("the float widget test")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running(COMFY, tiny_base(tmp_path_factory.mktemp("comfy_floats"))) as comfy:
        yield comfy


def float_inputs(info: dict) -> dict[str, dict]:
    """A node definition's FLOAT widget inputs: name → options (default, min, max, step)."""
    found = {}
    for group in ("required", "optional"):
        for name, spec in info["input"].get(group, {}).items():
            if spec[0] == "FLOAT" and not (spec[1] if len(spec) > 1 else {}).get("forceInput"):
                found[name] = spec[1]
    return found


def advanced_inputs(info: dict) -> set[str]:
    return {
        name
        for group in ("required", "optional")
        for name, spec in info["input"].get(group, {}).items()
        if len(spec) > 1 and isinstance(spec[1], dict) and spec[1].get("advanced")
    }


def mw_widget_names(info: dict) -> list[str]:
    """The node's widget inputs (its widgets_values slots without the control widgets)."""
    return [slot for slot in mw.widget_slots(info) if not slot.endswith(".control")]


def written(value: float) -> str:
    """A number as a person types it: 0.0001, 1e-8 (the frontend reads both)."""
    text = repr(value)
    return text.replace("e-0", "e-") if "e-" in text else text.removesuffix(".0")


def decimals_of(step: float) -> int:
    return max(0, -math.floor(math.log10(step)))


def moved(value: float, by: float, spec: dict) -> float:
    """value + by on the widget's decimal grid, clamped to its bounds: what an arrow click must give."""
    places = decimals_of(spec["step"])
    exact = (Decimal(repr(value)) + Decimal(repr(by))).quantize(Decimal(1).scaleb(-places))
    return min(max(float(exact), spec["min"]), spec["max"])


def problems_of(node: str, name: str, spec: dict, seen: dict) -> list[str]:
    default, step = spec["default"], spec["step"]
    shown = seen["initial"]["shown"]
    expected = {
        "shown": f"{default:.{decimals_of(step)}f}",
        "up": moved(default, step, spec),
        "down": moved(default, -step, spec),
        "typedShown": default,
        "typedDefault": default,
    }
    # Each pair of clicks starts from the default; at a bound the outward click does nothing.
    expected["upBack"] = moved(expected["up"], -step, spec)
    expected["downBack"] = moved(expected["down"], step, spec)
    found = {
        "shown": shown,
        "typedShown": seen["typedShown"]["value"],
        "typedDefault": seen["typedDefault"]["value"],
        **{key: seen[key] for key in ("up", "upBack", "down", "downBack")},
    }
    problems = [
        f"{node}.{name}: {key} {found[key]!r}, expected {want!r}"
        for key, want in expected.items()
        if found[key] != want
    ]
    if seen["default"] != default or float(shown) != default:
        problems.append(f"{node}.{name}: the default {default!r} shows as {shown!r} (value {seen['default']!r})")
    for key in ("typedShown", "typedDefault"):  # the prompt was given a value that differs: the typing counted
        if seen[f"{key}From"] == default:
            problems.append(f"{node}.{name}: the value was still the default before typing ({key})")
    return problems


def test_every_kiln_float_widget_shows_keeps_and_steps_its_value(server, tmp_path):
    object_info = server.get("/object_info", timeout=60)
    specs = {
        node: inputs
        for node, info in sorted(object_info.items())
        if info.get("python_module") == "custom_nodes.kiln" and (inputs := float_inputs(info))
    }
    # The nodes the issue names are among them, with the widgets it found broken.
    assert {"adam_eps", "weight_decay", "adam_beta2", "ema_decay"} <= set(specs["KilnTrainingOptions"])
    assert {"KilnTrainLoRA", "KilnOptimizerOptions", "KilnEMAHoldoutOptions", "KilnLoadDataset"} <= set(specs)
    wanted = {
        node: [{"name": name, "written": written(spec["default"])} for name, spec in inputs.items()]
        for node, inputs in specs.items()
    }
    nodes_file = tmp_path / "nodes.json"
    nodes_file.write_text(json.dumps(wanted), encoding="utf-8")
    shots = tmp_path / "browser"
    done = drive(
        "float_widgets.mjs", server, shots, "--nodes", str(nodes_file), "--vue", "KilnTrainingOptions", timeout=1500
    )
    report = driver_report(done)
    artifacts = REPO / "runs" / "test-reports" / f"float-widgets-{comfy_env.version()}"
    artifacts.mkdir(parents=True, exist_ok=True)
    for shot in shots.glob("*.png"):
        shutil.copyfile(shot, artifacts / shot.name)
    assert report["ok"], f"{report.get('error')}\n{done.stderr[-3000:]}"
    problems = [
        problem
        for node, inputs in specs.items()
        for name, spec in inputs.items()
        for problem in problems_of(node, name, spec, report["nodes"][node][name])
    ]
    assert problems == [], "\n".join(problems)
    checked = sum(len(inputs) for inputs in specs.values())
    assert checked == sum(len(seen) for seen in report["nodes"].values()) and checked > 40
    # V3 `advanced` inputs: the Vue node mode (Nodes 2.0) of both frontends hides them until the node's "Show
    # advanced inputs"; the classic canvas shows them all (it reads widget.advanced, left unset by both).
    before, after = (set(report["vue"][key].split()) for key in ("before", "after"))
    hidden = advanced_inputs(object_info["KilnTrainingOptions"])
    assert {"adam_eps", "cuda_graphs", "logit_std"} <= hidden and not {"ema", "weight_decay", "run_name"} & hidden
    everyday = set(mw_widget_names(object_info["KilnTrainingOptions"])) - hidden
    assert everyday <= before and not hidden & before, (sorted(hidden & before), sorted(everyday - before))
    assert hidden | everyday <= after, sorted((hidden | everyday) - after)
    kiln_errors = [e for e in report["console"] if "kiln" in (e["text"] + e["url"]).lower()]
    assert kiln_errors == [] and [e for e in report["pageErrors"] if "kiln" in e.lower()] == []
