"""The dataset editor against a real ComfyUI (COMFYUI_PATH) with the pack: the /kiln/datasets routes over
HTTP (ComfyUI's aiohttp server and middleware, Kiln's own cross-site refusal on top), and in ComfyUI's own
frontend (headless Chromium, tests/web/dataset_editor.mjs): create a dataset, upload three images, drop a
too-small image and a text file on the drop zone, edit a caption, add a prefix to all captions, see the
small image flagged and the text file refused; upload three real photos (one a resized copy of another, one
blurred), caption them with "Caption selected" (ComfyUI's queue running Kiln Caption Images on a tiny random
Florence-2 in models/LLM/), see the captions and the quality verdicts (the near-duplicate pair naming each
other, the blurred one) on their cards and the "only images with problems" filter; then train on the new folder
from the graph (Load Dataset → Train LoRA on the tiny Flux2). Skips without node, Chromium or playwright-core
(fails in CI).
"""
from __future__ import annotations

import io
import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

import comfy_env

COMFY = comfy_env.require_comfy()   # skips the module without COMFYUI_PATH (fails in CI)

from comfy_server import CHROMIUM, NODE, make_workflows, require_browser, running, tiny_base

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
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
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
    status, body = request(server, "/api/kiln/datasets/kiln_tiny_dataset")          # also under /api
    assert status == 200 and len(body["images"]) == 4 and body["images"][0]["caption"].startswith("{trigger}")
    origin = {"Origin": server.url}
    # ComfyUI's own middleware lets a same-site (another port of the host) POST through; Kiln's check does not.
    status, body = request(server, "/kiln/datasets", {"name": "evil"}, {**origin, "Sec-Fetch-Site": "same-site"})
    assert status == 403 and "may not change datasets" in body["error"]
    status, _ = request(server, "/kiln/datasets", {"name": "evil"}, {"Origin": "http://evil.example",
                                                                     "Sec-Fetch-Site": "cross-site"})
    assert status == 403 and not (server.input / "evil").exists()
    for name in ("..%2F..%2Fmodels", "%2E%2E", ".kiln_cache"):
        assert request(server, f"/kiln/datasets/{name}")[0] in (400, 404)
    status, body = request(server, "/kiln/datasets/kiln_tiny_dataset/caption", {"path": "../../user/x.png",
                                                                                "caption": "x"}, origin)
    assert status == 400 and "lead out of the folder" in body["error"]
    # What Caption Images offers, as the editor's "Caption selected" row lists it.
    status, body = request(server, "/kiln/captioners")
    assert status == 200 and body["engines"] == ["comfyui_clip", "transformers"], body
    assert body["models"] == ["Florence-2-tiny"] and "qwen_image" in body["clip_types"] and "short" in body["styles"]
    status, body = request(server, "/kiln/datasets/kiln_tiny_dataset/verdicts")
    assert status == 200 and len(body["verdicts"]) == 4 and all("line" in v for v in body["verdicts"])


def photos(tmp_path: Path) -> list[Path]:
    """coffee.jpg, a resized re-encoded copy of it, and a blurred rocket (tests/data/photos/)."""
    from PIL import Image, ImageFilter

    source = REPO / "tests" / "data" / "photos"
    out = [tmp_path / "coffee.jpg", tmp_path / "coffee_small.jpg", tmp_path / "rocket_blurred.png"]
    out[0].write_bytes((source / "coffee.jpg").read_bytes())
    with Image.open(source / "coffee.jpg") as cup:
        cup.resize((192, 128), Image.Resampling.LANCZOS).save(out[1], quality=60)
    with Image.open(source / "rocket.jpg") as rocket:
        rocket.filter(ImageFilter.GaussianBlur(3)).save(out[2])
    return out


def test_create_upload_caption_prefix_flag_then_train(server, tmp_path):
    require_browser("the dataset editor test")
    files = {}
    for name, data in {"a.png": png(96, 80, 1), "b.png": png(80, 96, 2), "c.png": png(64, 64, 3),
                       "tiny.png": png(32, 32, 4), "notes.png": b"these are notes, not an image\n"}.items():
        files[name] = tmp_path / name
        files[name].write_bytes(data)
    done = subprocess.run([NODE, str(REPO / "tests" / "web" / "dataset_editor.mjs"), "--url", server.url,
                           "--out", str(tmp_path / "browser"), "--chromium", CHROMIUM, "--name", NAME,
                           *[arg for n in ("a.png", "b.png", "c.png") for arg in ("--image", str(files[n]))],
                           "--drop", str(files["tiny.png"]), "--drop", str(files["notes.png"]),
                           "--caption", "a.png=a red square", "--prefix", "ohwx",
                           *[arg for photo in photos(tmp_path) for arg in ("--photo", str(photo))],
                           "--caption-model", "Florence-2-tiny"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    report = json.loads(lines[-1])
    assert report["ok"], (report.get("error"), report.get("statuses"))
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
    for name in photo_names:     # the tiny random Florence-2 writes lower-case letters, behind the trigger word
        assert cards[name]["caption"].startswith("ohwx, ") and len(cards[name]["caption"]) > 8, cards[name]
        assert (server.input / NAME / name).with_suffix(".txt").read_text(encoding="utf-8") == cards[name]["caption"] + "\n"
    # Flagged on its own card: skipped as too small; the prefix gave it a caption that is then not used.
    assert cards["tiny.png"]["severity"] == "skipped" and cards["tiny.png"]["codes"] == ["too_small", "caption_unused"]
    assert "under 64 px" in cards["tiny.png"]["problems"][0]
    # The quality verdicts: the copy names its original and the original its copy; the blurred photo is flagged.
    # (both photos are also soft next to the random-noise images: under a fifth of this dataset's median sharpness)
    assert cards["coffee_small.jpg"]["verdictCodes"].split()[0] == "near_duplicate"
    assert "the sharper coffee.jpg stays" in cards["coffee_small.jpg"]["verdict"]
    assert cards["coffee.jpg"]["verdict"].endswith(" — near-duplicate of coffee_small.jpg; this one is the "
                                                   "sharpest, the one to keep")
    assert "near_duplicate" not in cards["coffee.jpg"]["verdictCodes"]
    assert cards["rocket_blurred.png"]["verdictCodes"] == "blurry"
    assert cards["a.png"]["verdict"] == "96x80 [64: 64x48 crop 0x5] ok" and cards["tiny.png"]["verdict"] is None
    assert report["problemsOnly"] == ["coffee.jpg", "coffee_small.jpg", "rocket_blurred.png", "tiny.png"]
    assert all(card["thumbnail"] > 0 for card in cards.values())                   # /view served each image
    assert "7 images, 1 skipped" in report["summary"] and f"{NAME} (7 images, 7 captions)" in report["listed"]
    assert report["formHidden"] and "null" not in report["text"] and "undefined" not in report["text"]
    kiln_errors = [e for e in report["console"] if "kiln" in (e["text"] + e["url"]).lower()]
    assert kiln_errors == [] and [e for e in report["pageErrors"] if "kiln" in e.lower()] == []

    # What the editor wrote is what Load Dataset reads.
    folder = server.input / NAME
    meta = json.loads((folder / "dataset.json").read_text(encoding="utf-8"))
    assert (meta["type"], meta["trigger_word"], meta["resolutions"]) == ("character", "ohwx", [64])
    assert (folder / "a.txt").read_text(encoding="utf-8") == "ohwx, a red square\n"
    assert sorted(p.name for p in folder.iterdir() if p.name != ".kiln_cache") == [
        "a.png", "a.txt", "b.png", "b.txt", "c.png", "c.txt", "coffee.jpg", "coffee.txt", "coffee_small.jpg",
        "coffee_small.txt", "dataset.json", "rocket_blurred.png", "rocket_blurred.txt", "tiny.png", "tiny.txt"]

    prompt = json.loads((HERE / "workflows" / "tiny_flux2_api.json").read_text(encoding="utf-8"))
    del prompt["9"]                                                               # no Save LoRA: training is the point
    prompt["4"]["inputs"].update(folder=NAME)
    prompt["8"]["inputs"].update(steps=2)
    prompt["7"]["inputs"].update(run_name="edited")
    fill_new_widgets(server, prompt)
    entry = server.run(prompt, timeout=300)
    assert entry["status"]["status_str"] == "success"
