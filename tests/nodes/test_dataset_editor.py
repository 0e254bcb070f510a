"""The dataset editor's routes (nodes/dataset_editor.py over trainer/data/folder/editing.py and uploads.py), driven
through their handlers with a stand-in for the door's call object: no ComfyUI, no server. The real HTTP
wiring and the browser are tested in tests/nodes/test_dataset_editor_e2e.py."""

from __future__ import annotations

import asyncio
import io
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import kiln_pack.nodes.dataset_editor as de
from helpers import paths

SAME = {"Host": "127.0.0.1:8188", "Origin": "http://127.0.0.1:8188", "Sec-Fetch-Site": "same-origin"}


class Call:
    def __init__(self, params=None, body=None, files=(), headers=SAME):
        self.params, self.body, self._files, self.headers = dict(params or {}), body, list(files), dict(headers)

    async def json(self):
        if isinstance(self.body, (bytes, str)):
            return json.loads(self.body)
        return self.body

    async def files(self):
        for name, data in self._files:

            async def chunks(data=data):
                for start in range(0, len(data), 1000):
                    yield data[start : start + 1000]

            yield name, chunks()


def png(width=96, height=80, seed=0, fmt="PNG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def bomb(width=50_000, height=50_000) -> bytes:
    """A small PNG whose header claims width × height pixels (IHDR patched, its CRC fixed)."""
    data = bytearray(png(8, 8))
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(data)


@pytest.fixture
def root(tmp_path):
    (tmp_path / "input").mkdir()
    return tmp_path / "input"


@pytest.fixture
def editor(root):
    return de.Editor(lambda: root, max_upload_bytes=200_000)


def run(handler, call):
    return asyncio.run(handler(call))


def made(editor, name="faces", **fields):
    status, body = run(
        editor.create,
        Call(body={"name": name, "type": "character", "trigger_word": "ohwx", "resolutions": [512, 768], **fields}),
    )
    assert status == 201, body
    return body


def upload(editor, name, *files, headers=SAME):
    return run(editor.upload, Call({"name": name}, files=files, headers=headers))


def test_create_writes_a_dataset_json_that_load_dataset_reads(editor, root):
    from trainer.data.folder.meta import read_meta

    made(editor)
    meta, problems = read_meta(root / "faces")
    assert problems == [] and (meta.type, meta.trigger_word, meta.resolutions) == ("character", "ohwx", [512, 768])
    assert run(editor.list, Call())[1] == {"root": "input", "datasets": [{"name": "faces", "detail": "no images yet"}]}
    status, body = run(editor.create, Call(body={"name": "faces"}))
    assert status == 409 and "already exists" in body["error"]
    status, body = run(editor.create, Call(body={"name": "x", "type": "portrait"}))
    assert status == 400 and "type" in body["error"] and not (root / "x").exists()
    status, body = run(editor.create, Call(body={"name": "y", "resolutions": [10]}))
    assert status == 400 and "resolutions" in body["error"]


@pytest.mark.parametrize("name", ["..", "../outside", "/etc", "C:\\x", "a/b", ".hidden", "", "con\x00"])
def test_dataset_names_that_lead_out_or_hide_are_refused(editor, root, name):
    status, body = run(editor.create, Call(body={"name": name}))
    assert status == 400, body
    assert sorted(p.name for p in root.parent.iterdir()) == ["input"] and list(root.iterdir()) == []
    assert run(editor.show, Call({"name": name}))[0] in (400, 404)


def test_upload_keeps_images_named_by_their_content(editor, root):
    made(editor)
    status, body = upload(
        editor, "faces", ("a.png", png(seed=1)), ("../../b.png", png(seed=2)), ("c.png", png(seed=3, fmt="JPEG"))
    )
    assert status == 200 and body["refused"] == []
    assert [a["path"] for a in body["added"]] == ["a.png", "b.png", "c.jpg"]  # a JPEG named .png → .jpg
    assert sorted(os.listdir(root / "faces")) == ["a.png", "b.png", "c.jpg", "dataset.json"]
    status, body = upload(editor, "faces", ("a.png", png(seed=4)))
    assert body["added"][0]["path"] == "a (2).png"  # never overwrites


@pytest.mark.parametrize(
    "name,data,status,words",
    [
        ("bomb.png", bomb(), 413, "too large"),
        ("notes.png", b"hello, not an image" * 10, 415, "not an image"),
        ("anim.png", b"GIF89a" + bytes(200), 415, "GIF"),
        ("big.png", os.urandom(250_000), 413, "larger than"),
        ("cut.png", png()[:-300], 422, "truncated"),
    ],
)
def test_bad_uploads_are_refused_and_leave_nothing(editor, root, name, data, status, words):
    made(editor)
    got, body = upload(editor, "faces", (name, data))
    assert got == status and body["added"] == [] and words in body["refused"][0]["error"], body
    assert sorted(os.listdir(root / "faces")) == ["dataset.json"]  # no temp file left


def test_a_refused_file_does_not_stop_the_others(editor, root):
    made(editor)
    status, body = upload(editor, "faces", ("x.txt", b"plain text"), ("ok.png", png()))
    assert status == 200 and [a["path"] for a in body["added"]] == ["ok.png"] and len(body["refused"]) == 1


def test_cross_site_posts_are_refused(editor, root):
    for headers in (
        {"Host": "127.0.0.1:8188", "Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"},
        {"Host": "127.0.0.1:8188", "Origin": "http://127.0.0.1:9999"},  # another port: same-site
        {"Host": "127.0.0.1:8188", "Sec-Fetch-Site": "same-site"},
        {"Host": "127.0.0.1:8188", "Origin": "null"},
    ):
        assert run(editor.create, Call(body={"name": "evil"}, headers=headers))[0] == 403
        assert upload(editor, "faces", ("a.png", png()), headers=headers)[0] == 403
        assert (
            run(editor.edit, Call({"name": "faces", "action": "trash"}, {"paths": ["a.png"]}, headers=headers))[0]
            == 403
        )
    assert list(root.iterdir()) == []
    assert run(editor.create, Call(body={"name": "ok"}, headers={"Host": "localhost:8188"}))[0] == 201  # curl


def gallery(editor, name="faces"):
    status, body = run(editor.show, Call({"name": name}))
    assert status == 200, body
    return {image["path"]: image for image in body["images"]}, body


def edit(editor, action, body, name="faces"):
    return run(editor.edit, Call({"name": name, "action": action}, body))


def test_gallery_shows_captions_and_each_files_problems(editor, root):
    made(editor)
    upload(editor, "faces", ("a.png", png()), ("tiny.png", png(32, 32)))
    (root / "faces" / "a.txt").write_text("a woman", encoding="utf-8")
    (root / "faces" / "ghost.txt").write_text("no image", encoding="utf-8")
    images, body = gallery(editor)
    assert images["a.png"]["caption"] == "a woman" and images["a.png"]["usable"]
    assert not images["tiny.png"]["usable"]
    assert [p["code"] for p in images["tiny.png"]["problems"]] == ["too_small"]
    assert "below_resolution" in [p["code"] for p in images["a.png"]["problems"]]  # 96×80 under 512²
    assert [p["file"] for p in body["problems"]] == ["ghost.txt"]
    assert body["meta"]["trigger_word"] == "ohwx"


def test_edit_a_caption_and_bulk_edits(editor, root):
    made(editor)
    upload(editor, "faces", ("a.png", png(seed=1)), ("b.png", png(seed=2)), ("c.png", png(seed=3)))
    status, body = edit(editor, "caption", {"path": "a.png", "caption": "  a woman smiling \n"})
    assert status == 200 and (root / "faces" / "a.txt").read_text(encoding="utf-8") == "a woman smiling\n"
    (root / "faces" / "B.TXT").write_text("a man", encoding="utf-8")  # case-different caption file
    status, body = edit(editor, "bulk", {"op": "prefix", "text": "ohwx", "paths": ["a.png", "b.png", "c.png"]})
    assert status == 200 and body["changed"] == {
        "a.png": "ohwx, a woman smiling",
        "b.png": "ohwx, a man",
        "c.png": "ohwx",
    }
    assert (root / "faces" / "B.TXT").read_text(encoding="utf-8") == "ohwx, a man\n"
    assert edit(editor, "bulk", {"op": "prefix", "text": "ohwx", "paths": ["a.png"]})[1]["changed"] == {}  # not twice
    edit(editor, "bulk", {"op": "suffix", "text": "photo", "paths": ["a.png"]})
    edit(editor, "bulk", {"op": "replace", "find": "woman", "replace": "person", "paths": ["a.png"]})
    assert gallery(editor)[0]["a.png"]["caption"] == "ohwx, a person smiling, photo"
    for bad in (
        {"op": "shout", "paths": ["a.png"]},
        {"op": "prefix", "text": "", "paths": ["a.png"]},
        {"op": "replace", "find": "", "replace": "x", "paths": ["a.png"]},
        {"op": "prefix", "text": "x", "paths": []},
        {"op": "prefix", "text": "x", "paths": ["../a.png"]},
    ):
        assert edit(editor, "bulk", bad)[0] == 400, bad
    assert edit(editor, "caption", {"path": "a.png", "caption": "bad\x00byte"})[0] == 400
    assert edit(editor, "caption", {"path": "zzz.png", "caption": "x"})[0] == 404
    assert edit(editor, "rename", {})[0] == 404


def test_paths_that_lead_out_are_refused(editor, root, tmp_path):
    made(editor)
    upload(editor, "faces", ("a.png", png()))
    secret = tmp_path / "secret.png"
    secret.write_bytes(png())
    (tmp_path / "secret.txt").write_text("keep", encoding="utf-8")
    (root / "faces" / "link.png").symlink_to(secret)
    (root / "elsewhere").symlink_to(tmp_path, target_is_directory=True)
    for path in ("../../secret.png", str(secret), "/etc/passwd", "link.png", ".trash/a.png", "sub\\..\\a.png"):
        status, body = edit(editor, "caption", {"path": path, "caption": "pwned"})
        assert status in (400, 404), (path, body)
        assert edit(editor, "trash", {"paths": [path]})[0] in (400, 404)
    assert (tmp_path / "secret.txt").read_text(encoding="utf-8") == "keep" and secret.is_file()
    assert run(editor.show, Call({"name": "elsewhere"}))[0] == 400  # a linked-in folder
    assert upload(editor, "elsewhere", ("a.png", png()))[0] == 400
    assert "elsewhere" not in [d["name"] for d in run(editor.list, Call())[1]["datasets"]]


def test_trash_moves_an_image_and_its_caption_out_of_training(editor, root):
    made(editor)
    upload(editor, "faces", ("a.png", png(seed=1)), ("b.png", png(seed=2)))
    edit(editor, "caption", {"path": "a.png", "caption": "first"})
    status, body = edit(editor, "trash", {"paths": ["a.png"]})
    assert status == 200 and body["moved_to"] == [".trash/a.png", ".trash/a.txt"]
    images, listing = gallery(editor)
    assert list(images) == ["b.png"] and listing["trash"] == 2
    assert (root / "faces" / ".trash" / "a.txt").read_text(encoding="utf-8") == "first\n"
    upload(editor, "faces", ("a.png", png(seed=1)))
    assert edit(editor, "trash", {"paths": ["a.png"]})[1]["moved_to"] == [".trash/a (2).png"]  # never overwrites


def test_a_body_that_is_not_json_is_refused(editor):
    made(editor)
    assert run(editor.edit, Call({"name": "faces", "action": "caption"}, b"{not json"))[0] == 400
    assert run(editor.create, Call(body=[1, 2]))[0] == 400


def test_the_routes_read_only_names(editor, root):
    made(editor)
    upload(editor, "faces", ("a.png", png()))
    text = json.dumps(gallery(editor)[1]) + json.dumps(run(editor.list, Call())[1])
    assert str(root) not in text and str(Path(root).parent) not in text


def test_verdicts_name_the_near_duplicate_pair_blur_and_buckets(editor, root):
    """GET .../verdicts: check-dataset's line per usable image, from a worker thread; the pair names each other."""
    from PIL import ImageFilter

    photos = paths.PHOTOS
    made(editor, resolutions=[128])
    for name in ("astronaut.jpg", "coffee.jpg"):
        upload(editor, "faces", (name, (photos / name).read_bytes()))
    with Image.open(photos / "coffee.jpg") as cup:
        small, blurred = io.BytesIO(), io.BytesIO()
        cup.resize((192, 128)).save(small, "JPEG", quality=60)
    with Image.open(photos / "rocket.jpg") as rocket:
        rocket.filter(ImageFilter.GaussianBlur(3)).save(blurred, "PNG")
    upload(editor, "faces", ("cup_small.jpg", small.getvalue()), ("rocket_blurred.png", blurred.getvalue()))
    for name in ("astronaut", "coffee", "cup_small", "rocket_blurred"):
        (root / "faces" / f"{name}.txt").write_text(f"ohwx, {name}", encoding="utf-8")
    status, body = run(editor.verdicts, Call({"name": "faces"}))
    assert status == 200, body
    found = {v["path"]: v for v in body["verdicts"]}
    assert found["astronaut.jpg"]["ok"], found
    assert found["astronaut.jpg"]["line"] == "astronaut.jpg 256x256 [128: 128x128] ok"
    assert found["cup_small.jpg"]["problems"] == ["near_duplicate"] and "coffee.jpg" in found["cup_small.jpg"]["line"]
    assert "copy of coffee.jpg" in found["cup_small.jpg"]["messages"][0]
    assert found["coffee.jpg"]["ok"] and "near-duplicate of cup_small.jpg" in found["coffee.jpg"]["line"]
    assert found["rocket_blurred.png"]["problems"] == ["blurry"]
    assert (root / "faces" / ".kiln_cache" / "quality.json").is_file()  # a second look reads the cache
    assert run(editor.verdicts, Call({"name": "nope"}))[0] == 404


def test_captioners_are_offered_only_with_comfyui(editor, root):
    assert run(editor.captioners, Call())[0] == 404
    offered = de.Editor(lambda: root, captioners=lambda: {"engines": ["transformers"], "models": []})
    assert run(offered.captioners, Call()) == (200, {"engines": ["transformers"], "models": []})
