"""Folders the tests read, named once: the repository, tests/ and its fixtures (a test file may move; these do not)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
PHOTOS = TESTS / "fixtures" / "photos"  # real photos for the quality pass (their README names the licences)
GOLDENS = TESTS / "goldens"  # ComfyUI's outputs the MLX ports are held to (scripts/make_goldens.py)
