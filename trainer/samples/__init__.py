"""Validation samples of a headless run (plan.py) and the sample grid (grid.py)."""
