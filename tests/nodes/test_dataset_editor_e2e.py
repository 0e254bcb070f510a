"""The dataset editor against a real ComfyUI (COMFYUI_PATH) with the pack: the /kiln/datasets routes over
HTTP (ComfyUI's aiohttp server and middleware, Kiln's own cross-site refusal on top), and in ComfyUI's own
frontend (headless Chromium, tests/web/dataset_editor.mjs): open the editor wide from its sidebar tab, create a
dataset, upload three images (each uncaptioned image's problem listed once on its card), drop a too-small image
and a text file on the drop zone, type a caption ("unsaved" until the field is left, then on disk), save one with
Enter (Shift+Enter a new line), add a prefix to all captions, see the small image flagged and the text file
refused; leave a caption the server refuses unsaved and switch dataset (asked: Cancel stays, OK switches), press
Esc with an unsaved caption (asked); find a label on every control; enlarge a thumbnail; upload three real
photos (one a resized copy of another, one blurred), caption them with "Caption selected" (ComfyUI's queue
running Kiln Caption Images on a tiny random Florence-2 in models/LLM/), see the captions and the quality
verdicts (the near-duplicate pair naming each other, the blurred one) on their cards and the "only images with
problems" filter; then train on the new folder from the graph (Load Dataset → Train LoRA on the tiny Flux2).
Skips without node, Chromium or playwright-core (fails in CI).
"""

from __future__ import annotations

import io
import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

from helpers import comfy_env

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
COMFY = comfy_env.require_comfy()  # skips the module without COMFYUI_PATH (fails in CI)

from helpers.comfy_server import (
    drive,
    driver_report,
    make_workflows,
    require_browser,
    running,
    tiny_base,
)

NAME = "edited_set"


def png(width: int, height: int, seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_florence):
    base = tiny_base(tmp_path_factory.mktemp("comfy_editor"))
    (base / "models" / "LLM").mkdir(parents=True)
    (base / "models" / "LLM" / "Florence-2-tiny").symlink_to(tiny_florence, target_is_directory=True)
    with running(COMFY, base) as comfy:
        comfy.input = base / "input"
        yield comfy


def request(server, path, body=None, headers=None, method=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        server.url + path, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as err:
        text = err.read()
        return err.code, (json.loads(text) if text.startswith(b"{") else {"raw": text[:200]})


def fill_new_widgets(server, prompt: dict) -> None:
    """Widgets added to a node after the saved test workflow was written take their defaults."""
    mw, info = make_workflows(), server.get("/object_info", timeout=60)
    for node in prompt.values():
        spec = info[node["class_type"]]
        for name in mw.ordered_inputs(spec):
            kind, options, optional = mw.input_spec(spec, name)
            if name not in node["inputs"] and not optional and mw.is_widget(kind, options):
                node["inputs"][name] = mw.default_value(kind, options)


def test_the_routes_answer_on_comfyuis_server_and_refuse_other_sites(server):
    status, body = request(server, "/kiln/datasets")
    assert status == 200 and body["root"] == "input" and "kiln_tiny_dataset" in [d["name"] for d in body["datasets"]]
    status, body = request(server, "/api/kiln/datasets/kiln_tiny_dataset")  # also under /api
    assert status == 200 and len(body["images"]) == 4 and body["images"][0]["caption"].startswith("{trigger}")
    origin = {"Origin": server.url}
    # ComfyUI's own middleware lets a same-site (another port of the host) POST through; Kiln's check does not.
    status, body = request(server, "/kiln/datasets", {"name": "evil"}, {**origin, "Sec-Fetch-Site": "same-site"})
    assert status == 403 and "may not change datasets" in body["error"]
    status, _ = request(
        server, "/kiln/datasets", {"name": "evil"}, {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
    )
    assert status == 403 and not (server.input / "evil").exists()
    for name in ("..%2F..%2Fmodels", "%2E%2E", ".kiln_cache"):
        assert request(server, f"/kiln/datasets/{name}")[0] in (400, 404)
    status, body = request(
        server, "/kiln/datasets/kiln_tiny_dataset/caption", {"path": "../../user/x.png", "caption": "x"}, origin
    )
    assert status == 400 and "lead out of the folder" in body["error"]
    # What Caption Images offers, as the editor's "Caption selected" row lists it.
    status, body = request(server, "/kiln/captioners")
    assert status == 200 and body["engines"] == ["comfyui_clip", "transformers"], body
    assert body["models"] == ["Florence-2-tiny"] and "qwen_image" in body["clip_types"] and "short" in body["styles"]
    status, body = request(server, "/kiln/datasets/kiln_tiny_dataset/verdicts")
    assert status == 200 and len(body["verdicts"]) == 4 and all("line" in v for v in body["verdicts"])


def photos(tmp_path: Path) -> list[Path]:
    """coffee.jpg, a resized re-encoded copy of it, and a blurred rocket (tests/fixtures/photos/)."""
    from PIL import Image, ImageFilter

    source = REPO / "tests" / "fixtures" / "photos"
    out = [tmp_path / "coffee.jpg", tmp_path / "coffee_small.jpg", tmp_path / "rocket_blurred.png"]
    out[0].write_bytes((source / "coffee.jpg").read_bytes())
    with Image.open(source / "coffee.jpg") as cup:
        cup.resize((192, 128), Image.Resampling.LANCZOS).save(out[1], quality=60)
    with Image.open(source / "rocket.jpg") as rocket:
        rocket.filter(ImageFilter.GaussianBlur(3)).save(out[2])
    return out


@pytest.fixture(scope="module")
def editor_report(server, tmp_path_factory):
    """The browser driver's report on its walk through the editor (the folder it made stays for the tests)."""
    require_browser("the dataset editor test")
    tmp_path = tmp_path_factory.mktemp("editor")
    files = {}
    for name, data in {
        "a.png": png(96, 80, 1),
        "b.png": png(80, 96, 2),
        "c.png": png(64, 64, 3),
        "tiny.png": png(32, 32, 4),
        "notes.png": b"these are notes, not an image\n",
    }.items():
        files[name] = tmp_path / name
        files[name].write_bytes(data)
    shots = tmp_path / "browser"
    done = drive(
        "dataset_editor.mjs",
        server,
        shots,
        "--name",
        NAME,
        *[arg for n in ("a.png", "b.png", "c.png") for arg in ("--image", str(files[n]))],
        "--drop",
        str(files["tiny.png"]),
        "--drop",
        str(files["notes.png"]),
        "--caption",
        "a.png=a red square",
        "--enter",
        "c.png=green|square",
        "--prefix",
        "ohwx",
        *[arg for photo in photos(tmp_path) for arg in ("--photo", str(photo))],
        "--caption-model",
        "Florence-2-tiny",
        "--other",
        "kiln_tiny_dataset",
        timeout=600,
    )
    artifacts = REPO / "runs" / "test-reports"
    artifacts.mkdir(parents=True, exist_ok=True)
    for shot in shots.glob("*.png"):  # kept for a person to look at: runs/test-reports/dataset-editor-0.33.0-*.png
        kept = shot.stem.replace("dataset_editor", f"dataset-editor-{comfy_env.version()}")
        shutil.copyfile(shot, artifacts / f"{kept}.png")
    report = driver_report(done)
    assert report["ok"], (report.get("error"), report.get("statuses"), report.get("dialogs"))
    return report


def test_the_editor_opens_wide_from_the_sidebar(editor_report):
    widths = editor_report["widths"]
    assert "kiln_tiny_dataset (4 images, 4 captions)" in editor_report["launcher"]
    assert f"{NAME} (4 images, 4 captions)" in editor_report["launcherAfter"]  # reread when the editor closed
    # The sidebar tab keeps its default width; the editor takes most of the 1500 px window, and again when reopened.
    assert widths["sidebar"] < 500 and widths["editor"] > 2 * widths["sidebar"], widths
    assert widths["editor"] >= 0.9 * widths["viewport"] and widths["again"] == widths["editor"], widths


def test_a_caption_saves_on_leaving_the_field_or_enter_and_shows_unsaved_before(editor_report, server):
    blur, enter = editor_report["blurSave"], editor_report["enterSave"]
    assert blur["typed"]["state"] == "dirty" and blur["typed"]["marker"].startswith("● unsaved"), blur
    assert blur["typed"]["saveShown"] and blur["serverBefore"] == ""  # typed, not on disk yet
    assert blur["saved"] == {"state": "clean", "marker": "", "value": "a red square", "saveShown": False}
    assert blur["serverAfter"] == "a red square"
    # Shift+Enter made a new line (still unsaved); Enter saved it and kept the field focused.
    assert enter["typed"]["state"] == "dirty" and enter["typed"]["value"] == "green\nsquare", enter
    assert enter["saved"]["state"] == "clean" and enter["serverAfter"] == "green\nsquare"
    assert enter["focused"] == "c.png"
    assert (server.input / NAME / "c.txt").read_text(encoding="utf-8") == "ohwx, green\nsquare\n"  # then the prefix


def test_dropping_an_unsaved_caption_asks_first(editor_report, server):
    ask = editor_report["switchAsk"]
    # Over 20,000 characters: the server refuses, the card says so and keeps the text.
    assert ask["refused"]["state"] == "error" and "keep it under 20000" in ask["refused"]["marker"], ask["refused"]
    asked = editor_report["dialogs"][ask["dialogsBefore"] :]
    assert asked[0]["type"] == "confirm" and asked[0]["answer"] == "dismiss"
    assert asked[0]["message"].startswith("The caption of a.png is not saved. Discard it and open kiln_tiny_dataset?")
    assert ask["dismissed"] == {"pick": NAME, "dialogs": ask["dialogsBefore"] + 1, "card": "error", "length": 20005}
    assert asked[1]["answer"] == "accept" and ask["accepted"] == {
        "pick": "kiln_tiny_dataset",
        "dialogs": ask["dialogsBefore"] + 2,
        "cards": 4,
    }
    # Back with nothing unsaved: no question, and the refused text was dropped (the disk has the saved caption).
    assert ask["back"] == {
        "dialogs": ask["dialogsBefore"] + 2,
        "caption": "ohwx, a red square",
        "server": "ohwx, a red square",
    }
    close = editor_report["closeAsk"]
    assert close["open"] and close["dialogs"] == ask["dialogsBefore"] + 3 and close["closedDialogs"] == close["dialogs"]
    assert editor_report["dialogs"][close["dialogs"] - 1]["message"].startswith(
        "The caption of a.png is not saved. Discard it and close the editor?"
    )


def test_every_control_has_a_label(editor_report):
    assert editor_report["unlabelled"] == []
    assert editor_report["captionLabels"] == {
        "caption-engine": "engine",
        "caption-model": "captioner (models/LLM)",
        "caption-clip": "text encoder",
        "caption-clip-type": "CLIP type",
        "caption-style": "style",
        "caption-trigger": "trigger word",
        "caption-max-tokens": "max tokens",
        "caption-overwrite": "overwrite existing captions",
        "caption-run": "Caption selected",
    }


def test_a_thumbnail_enlarges(editor_report):
    zoom = editor_report["zoom"]
    assert zoom["natural"] == 96 and zoom["name"].startswith("a.png 96×80 — 1 of 7"), zoom
    assert zoom["shown"][0] > 2 * zoom["thumbnail"][0] and zoom["shown"][1] > 2 * zoom["thumbnail"][1], zoom
    assert zoom["next"].startswith("b.png 80×96 — 2 of 7") and zoom["editorOpen"]


def test_each_problem_is_said_once_per_card(editor_report):
    for report in (editor_report["uncaptioned"], editor_report["cards"]):
        for card in report:
            assert len(card["codes"]) == len(set(card["codes"])), card
            assert not any(code in (card["verdict"] or "") for code in card["codes"]), card
    # Uploaded without captions: the scan's warning, once (the quality pass repeats it under the same code).
    uncaptioned = {card["path"]: card for card in editor_report["uncaptioned"]}
    assert [uncaptioned[n]["codes"] for n in ("a.png", "b.png", "c.png")] == [["caption_missing"]] * 3
    assert uncaptioned["a.png"]["verdictCodes"] == "caption_missing"  # in the verdict, but said there no more
    assert uncaptioned["a.png"]["verdict"] == "96x80 [64: 64x48 crop 0x5]"


def test_create_upload_caption_prefix_flag_then_train(server, editor_report):
    report = editor_report
    statuses = report["statuses"]
    assert not any(s.get("error") for s in statuses.values()), statuses
    assert statuses["upload"]["text"] == "added a.png, b.png, c.png"
    assert statuses["drop"]["text"].startswith("added tiny.png; refused notes.png: not an image file")
    assert statuses["bulk"]["text"] == "4 caption(s) changed, 0 unchanged"
    assert statuses["photos"]["text"] == "added coffee.jpg, coffee_small.jpg, rocket_blurred.png"
    # Caption selected: queued on ComfyUI's queue, ran Caption Images on the three photos only, gallery reloaded.
    assert statuses["captioned"] == {"text": "3 captions written", "error": False}

    cards = {card["path"]: card for card in report["cards"]}
    photo_names = ["coffee.jpg", "coffee_small.jpg", "rocket_blurred.png"]
    assert list(cards) == ["a.png", "b.png", "c.png", *photo_names, "tiny.png"]
    assert cards["a.png"]["caption"] == "ohwx, a red square" and cards["b.png"]["caption"] == "ohwx"
    for name in photo_names:  # the tiny random Florence-2 writes lower-case letters, behind the trigger word
        assert cards[name]["caption"].startswith("ohwx, ") and len(cards[name]["caption"]) > 8, cards[name]
        assert (server.input / NAME / name).with_suffix(".txt").read_text(encoding="utf-8") == cards[name][
            "caption"
        ] + "\n"
    # Flagged on its own card: skipped as too small; the prefix gave it a caption that is then not used.
    assert cards["tiny.png"]["severity"] == "skipped" and cards["tiny.png"]["codes"] == ["too_small", "caption_unused"]
    assert "under 64 px" in cards["tiny.png"]["problems"][0]
    # The quality verdicts: the copy names its original and the original its copy; the blurred photo is flagged.
    # (both photos are also soft next to the random-noise images: under a fifth of this dataset's median sharpness)
    assert cards["coffee_small.jpg"]["verdictCodes"].split()[0] == "near_duplicate"
    assert cards["coffee_small.jpg"]["codes"][0] == "near_duplicate"  # the quality pass's problem, in the list
    assert "the sharper coffee.jpg stays" in cards["coffee_small.jpg"]["problems"][0]
    assert cards["coffee.jpg"]["verdict"].endswith(
        " — near-duplicate of coffee_small.jpg; this one is the sharpest, the one to keep"
    )
    assert "near_duplicate" not in cards["coffee.jpg"]["verdictCodes"]
    assert cards["rocket_blurred.png"]["verdictCodes"] == "blurry"
    assert cards["a.png"]["verdict"] == "96x80 [64: 64x48 crop 0x5] ok" and cards["tiny.png"]["verdict"] is None
    assert report["problemsOnly"] == ["coffee.jpg", "coffee_small.jpg", "rocket_blurred.png", "tiny.png"]
    assert all(card["thumbnail"] > 0 for card in cards.values())  # /view served each image
    assert "7 images, 1 skipped" in report["summary"] and f"{NAME} (7 images, 7 captions)" in report["listed"]
    assert report["formHidden"] and "null" not in report["text"] and "undefined" not in report["text"]
    kiln_errors = [e for e in report["console"] if "kiln" in (e["text"] + e["url"]).lower()]
    refused = [e for e in kiln_errors if e["url"].endswith(f"/kiln/datasets/{NAME}/caption") and "400" in e["text"]]
    assert len(refused) == 1 and len(kiln_errors) == 1  # the browser logs the over-long caption's refusal only
    assert [e for e in report["pageErrors"] if "kiln" in e.lower()] == []

    # What the editor wrote is what Load Dataset reads.
    folder = server.input / NAME
    meta = json.loads((folder / "dataset.json").read_text(encoding="utf-8"))
    assert (meta["type"], meta["trigger_word"], meta["resolutions"]) == ("character", "ohwx", [64])
    assert (folder / "a.txt").read_text(encoding="utf-8") == "ohwx, a red square\n"
    assert sorted(p.name for p in folder.iterdir() if p.name != ".kiln_cache") == [
        "a.png",
        "a.txt",
        "b.png",
        "b.txt",
        "c.png",
        "c.txt",
        "coffee.jpg",
        "coffee.txt",
        "coffee_small.jpg",
        "coffee_small.txt",
        "dataset.json",
        "rocket_blurred.png",
        "rocket_blurred.txt",
        "tiny.png",
        "tiny.txt",
    ]

    prompt = json.loads((HERE / "workflows" / "tiny_flux2_api.json").read_text(encoding="utf-8"))
    del prompt["9"]  # no Save LoRA: training is the point
    prompt["4"]["inputs"].update(folder=NAME)
    prompt["8"]["inputs"].update(steps=2)
    prompt["7"]["inputs"].update(run_name="edited")
    fill_new_widgets(server, prompt)
    entry = server.run(prompt, timeout=300)
    assert entry["status"]["status_str"] == "success"
