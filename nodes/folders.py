"""What Load Dataset's and Load Run's folder pickers offer (web/kiln_folders.js): the datasets under
ComfyUI's input/ and the runs under output/kiln/ that hold a complete checkpoint.

  GET /kiln/folders/datasets   {"root": "input", "folders": [{"name", "detail"}]}
  GET /kiln/folders/runs       {"root": "output/kiln", "folders": [{"name", "detail"}]}

A run is one folder (a stopped run resumes into it), so each is listed once, with its newest checkpoint.

Read-only and names only (never a file-system path), like the dashboard's routes. The widgets stay
text fields: a picked name is typed into them, and an absolute path still works.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..trainer.data.folder.scan import list_datasets
from ..trainer.run import state
from .comfy import bridge


def _datasets() -> list[dict]:
    return [{"name": f.name, "detail": f.describe()} for f in list_datasets(bridge.folders()["input"])]


def run_detail(run_dir: Path, step: int) -> str:
    """A run's newest state for its picker entry: 'step 4 of 8', 'finished, step 8' ('step 4' if unknown)."""
    try:
        total = json.loads((state.step_dir(run_dir, step) / "run.json").read_text(encoding="utf-8"))["config"]["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"step {step}"
    if not isinstance(total, int):
        return f"step {step}"
    return f"finished, step {step}" if step >= total else f"step {step} of {total}"


def _runs() -> list[dict]:
    root = Path(bridge.folders()["output"]) / "kiln"
    return [{"name": name, "detail": run_detail(root / name, step)} for name, step in state.list_runs(root)]


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
