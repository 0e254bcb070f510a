"""The dataset editor's routes (web/kiln_datasets.js), over trainer/data/folder/editing.py and uploads.py:

  GET  /kiln/datasets                  {"root": "input", "datasets": [{"name", "detail"}]}
  POST /kiln/datasets                  {"name", "type", "trigger_word", "resolutions"} → a new folder + dataset.json
  GET  /kiln/datasets/{name}           the gallery: dataset.json, images with captions and problems
  POST /kiln/datasets/{name}/upload    multipart images (any number of parts) → {"added", "refused"}
  POST /kiln/datasets/{name}/caption   {"path", "caption"}
  POST /kiln/datasets/{name}/bulk      {"op": "prefix"|"suffix"|"replace", "paths", "text" | "find"+"replace"}
  POST /kiln/datasets/{name}/trash     {"paths"} → moved to {name}/.trash/
  GET  /kiln/datasets/{name}/verdicts  the quality pass: a verdict per usable image (check-dataset's line)
  GET  /kiln/captioners                what Kiln Caption Images offers (engines, models/LLM/ models, Load CLIP's
                                       text encoders and types, styles), for the editor's 'Caption selected'

Only inside ComfyUI's input folder (names and '/'-relative paths, never a file-system path in or out);
every POST from another site is refused (`cross_site`), on top of ComfyUI's own origin check. The
handlers take the door's call object (params, headers, json(), files()) and return (status, body),
so tests drive them without a server.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from urllib.parse import urlsplit

from ..trainer.data.folder import editing, uploads
from ..trainer.data.folder.editing import EditError

ROOT_LABEL = "input"


def cross_site(headers) -> str | None:
    """Why a state-changing request must be refused, or None: a browser request from another site
    (Sec-Fetch-Site other than same-origin/none), or an Origin whose host:port is not the Host. Stricter
    than ComfyUI's own check (which only compares the two on a loopback host): these routes write files."""
    site = headers.get("Sec-Fetch-Site")
    if site is not None and site not in ("same-origin", "none"):
        return f"a {site} request may not change datasets; open the editor from ComfyUI's own page"
    origin = headers.get("Origin")
    if origin is not None:
        host = (headers.get("Host") or "").lower()
        if origin == "null" or not host or urlsplit(origin).netloc.lower() != host:
            return f"a request from {origin} may not change datasets on {host or 'this server'}"
    return None


class Editor:
    """The route handlers over one allowed root (a function, so ComfyUI's --input-directory is read late)."""

    def __init__(self, root, max_upload_bytes: int = uploads.MAX_UPLOAD_BYTES, captioners=None):
        self.root, self.max_upload_bytes = root, max_upload_bytes
        self.captioner_choices = captioners  # () -> dict: Caption Images' choices (needs ComfyUI)

    def table(self) -> list[tuple[str, str, object]]:
        return [
            ("GET", "/kiln/datasets", self.list),
            ("POST", "/kiln/datasets", self.create),
            ("GET", "/kiln/datasets/{name}", self.show),
            ("GET", "/kiln/datasets/{name}/verdicts", self.verdicts),
            ("GET", "/kiln/captioners", self.captioners),
            ("POST", "/kiln/datasets/{name}/upload", self.upload),
            ("POST", "/kiln/datasets/{name}/{action}", self.edit),
        ]

    async def list(self, call) -> tuple[int, dict]:
        return await _answer(lambda: {"root": ROOT_LABEL, "datasets": editing.list_folders(self.root())})

    async def create(self, call) -> tuple[int, dict]:
        async def run():
            body = await _body(call)
            meta = await asyncio.to_thread(
                editing.create,
                self.root(),
                body.get("name"),
                type=body.get("type", ""),
                trigger_word=body.get("trigger_word", ""),
                resolutions=body.get("resolutions"),
            )
            return 201, {"dataset": meta}

        return await _guarded(call, run)

    async def show(self, call) -> tuple[int, dict]:
        return await _answer(lambda: editing.gallery(self.root(), call.params["name"]))

    async def verdicts(self, call) -> tuple[int, dict]:
        # Decodes every image not in the quality cache yet: in a worker thread, never on aiohttp's loop.
        return await _answer(lambda: editing.verdicts(self.root(), call.params["name"]))

    async def captioners(self, call) -> tuple[int, dict]:
        if self.captioner_choices is None:
            return 404, {"error": "captioning is only offered inside ComfyUI (Kiln Caption Images' engines)"}
        return await _answer(self.captioner_choices)

    async def upload(self, call) -> tuple[int, dict]:
        async def run():
            folder = editing.dataset_folder(self.root(), call.params["name"])
            added, refused = [], []
            async for filename, chunks in call.files():
                try:
                    added.append(await uploads.receive(folder, filename, chunks, self.max_upload_bytes))
                except EditError as err:
                    async for _ in chunks:  # drain the refused part so the next one can be read
                        pass
                    refused.append({"file": filename, "status": err.status, "error": str(err)})
            if not added and not refused:
                raise EditError(400, "no files in the upload; send images as multipart form parts")
            status = 200 if added else refused[0]["status"]
            return status, {"added": added, "refused": refused}

        return await _guarded(call, run)

    async def edit(self, call) -> tuple[int, dict]:
        async def run():
            action, name, body = call.params["action"], call.params["name"], await _body(call)
            if action == "caption":
                result = await asyncio.to_thread(
                    editing.set_caption, self.root(), name, body.get("path"), body.get("caption")
                )
            elif action == "bulk":
                extra = {k: body.get(k) for k in ("text", "find", "replace")}
                result = await asyncio.to_thread(
                    editing.bulk, self.root(), name, body.get("op"), body.get("paths"), **extra
                )
            elif action == "trash":
                result = await asyncio.to_thread(editing.trash, self.root(), name, body.get("paths"))
            else:
                raise EditError(404, f"no dataset action {action!r}; use caption, bulk, trash or upload")
            return 200, result

        return await _guarded(call, run)


async def _body(call) -> dict:
    try:
        body = await call.json()
    except (ValueError, UnicodeDecodeError) as err:
        raise EditError(400, f"the request body is not JSON ({err}); send a JSON object") from err
    if not isinstance(body, dict):
        raise EditError(400, "the request body must be a JSON object")
    return body


async def _answer(work) -> tuple[int, dict]:
    try:
        return 200, await asyncio.to_thread(work)
    except EditError as err:
        return err.status, {"error": str(err)}


async def _guarded(call, run) -> tuple[int, dict]:
    """A POST: refused from another site, else run() → (status, body); EditError → its status."""
    if (why := cross_site(call.headers)) is not None:
        return 403, {"error": why}
    try:
        return await run()
    except EditError as err:
        return err.status, {"error": str(err)}
    except json.JSONDecodeError as err:
        return 400, {"error": f"the request body is not JSON ({err})"}


def add_routes() -> None:
    """Put the /kiln/datasets routes on ComfyUI's server (once); nothing when no server runs."""
    from .caption_nodes import caption_choices
    from .comfy import bridge

    bridge.add_json_routes(
        "datasets", Editor(lambda: Path(bridge.folders()["input"]), captioners=caption_choices).table()
    )
