"""Kiln's ComfyUI nodes (V3 API): thin I/O shells over trainer/; the registration list and the
extension ComfyUI loads are in extension.py.

This package file imports nothing, so headless training can import the door (nodes/comfy/) and set
ComfyUI up before any node module loads it. Imports are relative (`..trainer`): ComfyUI loads this
pack as a package named after its folder, and a top-level `trainer` could clash with another pack's.
"""
