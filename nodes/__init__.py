"""Kiln's ComfyUI nodes (V3 API): thin I/O shells over trainer/, one registration list."""
from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

NODES: list[type[io.ComfyNode]] = []  # the node classes arrive with the node pack (issue 4)


class KilnExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)
