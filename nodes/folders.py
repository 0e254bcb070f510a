"""What Load Dataset's and Load Run's folder pickers offer (web/kiln_folders.js): the datasets under
ComfyUI's input/ and the runs under output/kiln/ that hold a complete checkpoint.

  GET /kiln/folders/datasets   {"root": "input", "folders": [{"name", "detail"}]}
  GET /kiln/folders/runs       {"root": "output/kiln", "folders": [{"name", "detail"}]}

Read-only and names only (never a file-system path), like the dashboard's routes. The widgets stay
text fields: a picked name is typed into them, and an absolute path still works.
"""
from __future__ import annotations

from pathlib import Path

from ..trainer import state
from ..trainer.data.scan import list_datasets

from .comfy import bridge


def _datasets() -> list[dict]:
    return [{"name": f.name, "detail": f.describe()} for f in list_datasets(bridge.folders()["input"])]


def _runs() -> list[dict]:
    return [{"name": name, "detail": f"step {step}"}
            for name, step in state.list_runs(Path(bridge.folders()["output"]) / "kiln")]


KINDS = {"datasets": ("input", _datasets), "runs": ("output/kiln", _runs)}


def answer(kind: str) -> tuple[int, dict]:
    """(HTTP status, JSON body) for GET /kiln/folders/{kind}."""
    if kind not in KINDS:
        return 404, {"error": f"no Kiln folder list {kind!r}; ask for one of: {', '.join(KINDS)}"}
    root, listing = KINDS[kind]
    return 200, {"root": root, "folders": listing()}


def _register(routes) -> None:
    from aiohttp import web

    @routes.get("/kiln/folders/{kind}")
    async def folders(request):
        status, body = answer(request.match_info["kind"])
        return web.json_response(body, status=status)


def add_routes() -> None:
    """Put /kiln/folders/{kind} on ComfyUI's server (once); nothing when no server runs."""
    bridge.add_routes("folders", _register)
