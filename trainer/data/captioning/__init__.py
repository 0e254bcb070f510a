"""Caption Images' engines: jobs.py (which images, resumable writes, styles), models.py (the captioners in
models/LLM)."""

from ...moved import forward

__getattr__ = forward(__name__, "data.captioning")  # the old trainer/data/captioning.py's names, one release
