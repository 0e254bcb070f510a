"""Kiln's ComfyUI nodes (V3 API): thin I/O shells over trainer/, one registration list.

Imports are relative (`..trainer`): ComfyUI loads this pack as a package named
after its folder, and a top-level `trainer` could clash with another pack's.
"""
from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from . import dataset_nodes, live, lora_nodes, train_nodes

NODES: list[type[io.ComfyNode]] = [*dataset_nodes.NODES, *train_nodes.NODES, *lora_nodes.NODES]


class KilnExtension(ComfyExtension):
    async def on_load(self) -> None:
        live.add_routes()  # GET /kiln/runs for the live dashboard (web/), Stop and Save now

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)
