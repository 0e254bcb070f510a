"""Kiln: train LoRAs for diffusion transformers inside ComfyUI graphs.

ComfyUI loads this folder as a custom-node pack through the V3 entry point
below. Nodes are imported lazily so that loading the pack costs nothing until
ComfyUI asks for them. (No V1 node-mapping dict here: ComfyUI would then ignore
comfy_entrypoint.)
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes.extension import KilnExtension

    return KilnExtension()
