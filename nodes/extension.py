"""The extension ComfyUI loads (comfy_entrypoint in the pack's __init__.py): one registration list."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from . import (
    dataset_editor,
    dataset_nodes,
    folders,
    launch_nodes,
    live,
    lora_nodes,
    lora_tool_nodes,
    option_nodes,
    train_nodes,
)

NODES: list[type[io.ComfyNode]] = [
    *dataset_nodes.NODES,
    *train_nodes.NODES,
    *option_nodes.NODES,
    *lora_nodes.NODES,
    *lora_tool_nodes.NODES,
    *launch_nodes.NODES,
]


class KilnExtension(ComfyExtension):
    async def on_load(self) -> None:
        live.add_routes()  # GET /kiln/runs for the live dashboard (web/), Stop and Save now
        folders.add_routes()  # GET /kiln/folders/{datasets,runs} for the folder pickers (web/)
        dataset_editor.add_routes()  # /kiln/datasets/... for the dataset editor (web/kiln_datasets.js)

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)
