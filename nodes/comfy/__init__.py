"""The one door to ComfyUI: every module that imports ComfyUI (comfy, comfy_extras, folder_paths,
server) lives in this package, and `bridge` is its surface. Importing the package itself imports no
ComfyUI, so headless training can set ComfyUI up (loaders.start) before the bridge loads it."""
