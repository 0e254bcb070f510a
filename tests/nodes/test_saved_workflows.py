"""Saved workflows keep working (COMFYUI_PATH): a UI workflow's `widgets_values` are positional, so a
node that gains an input anywhere but at the end shifts every later value in the graphs users saved.

Fixtures in tests/nodes/saved_workflows/, never regenerated:
  *.json              the example workflows as shipped in 0.1.0 (UI format), i.e. graphs users saved;
  widget_order.json   every Kiln node's widgets_values slots as shipped in 0.1.0 (scripts/make_workflows.py
                      `widget_slots`: widget inputs in order, `<name>.control` after a seed's control widget).

Against a real ComfyUI server with the pack:
  1. each Kiln node's slots start with the shipped ones (new inputs only at the end);
  2. each saved workflow, read by position against the served definitions, gives every widget of a Kiln
     node a value that node accepts (type, bounds, choices);
  3. in ComfyUI's own frontend (headless Chromium), loading each saved workflow puts on every Kiln widget,
     by name, the value it was saved with. Both ComfyUI versions' frontends restore widget values by
     position (V3 input ids are not used for it), which is what 1 protects.

And the example workflows as templates in the frontend's template browser: their titles, pictures and
groups, and the zoom each opens at (screenshots in runs/test-reports/templates-<ComfyUI version>/).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SAVED = HERE / "saved_workflows"

from helpers import comfy_env  # noqa: E402

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
COMFY = comfy_env.require_comfy()  # skips the module without COMFYUI_PATH (fails in CI)

from helpers.comfy_server import (  # noqa: E402
    CHROMIUM,
    NODE,
    make_workflows,
    require_browser,
    running,
    tiny_base,
)

mw = make_workflows()
import kiln_pack.nodes.train_nodes as tn
import kiln_pack.trainer.config as config
import kiln_pack.trainer.config.layers as config_layers

SHIPPED = json.loads((SAVED / "widget_order.json").read_text(encoding="utf-8"))
WORKFLOWS = sorted(p for p in SAVED.glob("*.json") if p.name != "widget_order.json")
AFTER_SHIPPING = {
    "flux2_klein_edit_lora",
    "qwen_image_edit_lora",
    "wan21_t2v_lora",
    "wan22_ti2v_5b_lora",
    "wan21_i2v_lora",
}  # examples added since the shipped ones: no saved copy to keep
EXAMPLES = REPO / "example_workflows"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running(COMFY, tiny_base(tmp_path_factory.mktemp("comfy_saved"))) as comfy:
        yield comfy


@pytest.fixture(scope="module")
def object_info(server):
    return server.get("/object_info", timeout=60)


def kiln_nodes(path: Path) -> list[dict]:
    graph = json.loads(path.read_text(encoding="utf-8"))
    return [node for node in graph["nodes"] if node["type"].startswith("Kiln")]


def saved_values(node: dict) -> dict:
    """name → value of a saved node, read with the shipped slots (the order it was saved in)."""
    slots = SHIPPED[node["type"]]
    assert len(node["widgets_values"]) == len(slots), node["type"]
    return dict(zip(slots, node["widgets_values"], strict=True))


def test_fixtures_cover_every_shipped_node_and_workflow():
    # the examples were renamed to their titles since (the template browser shows the file name)
    assert {p.stem for p in WORKFLOWS} | AFTER_SHIPPING == set(mw.TEMPLATE_TITLES)
    assert {f"{title}.json" for title in mw.TEMPLATE_TITLES.values()} == {p.name for p in EXAMPLES.glob("*.json")}
    assert len(SHIPPED) == 11 and len(SHIPPED["KilnTrainingOptions"]) == 35
    assert {node["type"] for path in WORKFLOWS for node in kiln_nodes(path)} >= {
        "KilnLoadDataset",
        "KilnTrainLoRA",
        "KilnTrainingOptions",
        "KilnSaveLoRA",
        "KilnLoadRun",
    }


def test_kiln_widgets_only_grow_at_the_end(object_info):
    for node_type, shipped in SHIPPED.items():
        now = mw.widget_slots(object_info[node_type])
        assert now[: len(shipped)] == shipped, (
            f"{node_type}: the widget order changed; saved workflows would load shifted values. Keep the shipped "
            f"order and add new inputs after it.\nshipped: {shipped}\nnow:     {now}"
        )


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_saved_values_are_accepted_by_the_current_nodes(object_info, path):
    problems = []
    for node in kiln_nodes(path):
        info = object_info[node["type"]]
        for name, value in saved_values(node).items():
            if name.endswith(".control"):
                continue
            kind, options, _ = mw.input_spec(info, name)
            problems += [f"{node['type']}.{name}: {p}" for p in mw._check_widget(name, kind, options, value, False)]
    assert problems == []


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_saved_workflows_train_the_config_they_trained_before(path):
    """The preset rule is explicit now (every value of a connected Training Options wins over the preset; 0.1.0
    let the preset win over an Options value left at its default). The shipped workflows hold their preset's
    values in Options, so each Train LoRA resolves to the config the old rule gave it."""
    graph = json.loads(path.read_text(encoding="utf-8"))
    nodes = {node["id"]: node for node in kiln_nodes(path)}
    defaults = config.TrainConfig().to_dict()
    trains = [node for node in nodes.values() if node["type"] == "KilnTrainLoRA"]
    assert trains
    for train in trains:
        values = saved_values(train)
        widgets = {name: values[name] for name in tn.TRAIN_WIDGETS}
        sources = [link[1] for link in graph["links"] if link[3] == train["id"] and link[5] == "KILN_TRAIN_OPTIONS"]
        assert len(sources) == 1 and nodes[sources[0]]["type"] == "KilnTrainingOptions", sources
        options = tn.option_values({name: value for name, value in saved_values(nodes[sources[0]]).items()})
        now = config_layers.resolve([("options", options), ("Train LoRA", widgets)], preset=values["preset"]).config
        before = config.from_dict(
            {**{k: v for k, v in options.items() if v != defaults[k]}, **widgets}, preset=values["preset"]
        )
        assert values["preset"] != "none" and now == before, path.name


def test_the_frontend_loads_saved_workflows_with_the_same_values(server, tmp_path):
    require_browser("loading saved workflows in the frontend")
    report = run_browser(server, tmp_path, *map(str, WORKFLOWS))
    for path in WORKFLOWS:
        loaded = {str(node["id"]): node["widgets"] for node in report["files"][path.name]}  # 1.49: string ids
        for node in kiln_nodes(path):
            widgets = loaded[str(node["id"])]
            names = [name for name, _ in widgets]
            for slot, value in saved_values(node).items():
                # A seed's control widget is the widget after it (its name differs between frontends).
                name, control = slot.removesuffix(".control"), slot.endswith(".control")
                shown = widgets[names.index(name) + control][1]
                assert shown == value, (path.name, node["type"], slot, shown, value)
    kiln_errors = [e for e in report["console"] if "kiln" in (e["text"] + e["url"]).lower()]
    assert kiln_errors == [] and [e for e in report["pageErrors"] if "kiln" in e.lower()] == []


# ---------------------------------------------------------------- the examples in the template browser


def run_browser(server, out: Path, *args: str) -> dict:
    done = subprocess.run(
        [
            NODE,
            str(REPO / "tests" / "web" / "load_workflows.mjs"),
            "--url",
            server.url,
            "--out",
            str(out),
            "--chromium",
            CHROMIUM,
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    report = json.loads(lines[-1])
    assert report["ok"], report.get("error")
    return report


def overlaps(a: list[float], b: list[float]) -> bool:
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]


def inside(a: list[float], b: list[float]) -> bool:
    return b[0] <= a[0] and b[1] <= a[1] and a[0] + a[2] <= b[0] + b[2] and a[1] + a[3] <= b[1] + b[3]


def test_the_template_browser_shows_each_example_with_its_title_picture_and_groups(server, tmp_path):
    """Workflow → Browse Templates → kiln, as a user: each example's card has its title (the file name, the
    only title a custom-node template can have) and its picture (HTTP 200, a JPEG the card decodes, not the
    placeholder); opened from its card, each has its coloured groups, no node over another or outside its
    group, and opens at a zoom where text is drawn (≥ 0.75 on a 1400×900 window)."""
    require_browser("the template browser")
    report = run_browser(server, tmp_path, "--templates", "kiln")["templates"]
    shots = REPO / "runs" / "test-reports" / f"templates-{comfy_env.version()}"
    shutil.rmtree(shots, ignore_errors=True)
    shutil.copytree(tmp_path, shots, ignore=shutil.ignore_patterns("chromium-profile"))
    titles = sorted(mw.TEMPLATE_TITLES.values())
    assert report["names"] == titles
    for title in titles:
        card, picture = report["cards"][title], report["pictures"][f"{title}.jpg"]
        assert card["found"] and card["title"] == title and "_" not in title
        # 1.41 prints the file name again as the description, '-' and '_' as spaces; 1.49 prints none
        assert card["description"] in (None, title.replace("-", " "))
        assert picture["status"] == 200 and picture["type"] == "image/jpeg" and 5_000 < picture["bytes"] < 100_000
        assert (card["picture"]["width"], card["picture"]["height"]) == (512, 512), card  # ours, decoded

        workflow = json.loads((EXAMPLES / f"{title}.json").read_text(encoding="utf-8"))
        opened = report["opened"][title]
        assert opened["tab"] in (title, f"{title}.json")
        assert [(g["title"], g["color"]) for g in opened["groups"]] == [
            (g["title"], g["color"]) for g in workflow["groups"]
        ]
        assert {g["title"].split(" ")[1].rstrip(":") for g in workflow["groups"] if g["title"][0].isdigit()} >= {
            "Models",
            "Dataset",
            "Train",
            "Save",
        }
        assert opened["canvas"] == [1400, 900] and opened["scale"] >= 0.75, (title, opened["scale"])
    grown = {
        title: [
            (n["title"], n["plannedHeight"], n["height"])
            for n in opened["nodes"]
            if n["type"] == "KilnTrainLoRA" and not n["collapsed"] and n["height"] > n["plannedHeight"] + 100
        ]
        for title, opened in report["opened"].items()
    }
    # The layout leaves Train LoRA one line for its idle dashboard (issue 42: "idle is one line"); a dashboard
    # that reserved its old ~540 px would grow the node out of its group and over what is below it.
    assert not any(grown.values()), grown
    for title, opened in report["opened"].items():
        nodes, groups = opened["nodes"], opened["groups"]
        clashes = [
            (a["title"], b["title"])
            for i, a in enumerate(nodes)
            for b in nodes[i + 1 :]
            if overlaps(a["rect"], b["rect"])
        ]
        assert clashes == [], title
        loose = [
            n["title"]
            for n in nodes
            if n["type"] != "MarkdownNote" and not any(inside(n["rect"], g["rect"]) for g in groups)
        ]
        assert loose == [], title
