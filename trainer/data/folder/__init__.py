"""The dataset folder a user edits: scan.py (walk.py, check.py, caption_files.py, items.py), images.py (problems
and fixes), report.py, meta.py (dataset.json), quality.py, editing.py, uploads.py, review.py."""
