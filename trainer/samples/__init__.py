"""Validation samples of a headless run (plan.py) and the sample grid (grid.py)."""

from ..moved import forward

__getattr__ = forward(__name__, "samples")  # the old trainer/samples.py's names, one release
