"""Caption Images' engines: jobs.py (which images, resumable writes, styles), models.py (the captioners in
models/LLM)."""
