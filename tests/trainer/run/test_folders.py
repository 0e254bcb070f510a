"""Run folders named as typed: <name>, <name>-2 only on a clash of identities, a run found again by the
identity written inside it, and folders of the old <name>-<hash> kind still found."""

from __future__ import annotations

import json

import pytest

from trainer.run import folders as run_folders

WHAT = "Kiln Training Options: run_name"
A, B, C = "a" * 64, "b" * 64, "c" * 64


def test_a_run_takes_its_name_as_typed_and_is_found_again(tmp_path):
    folder = run_folders.find_or_claim(tmp_path, "portrait", A, WHAT)
    assert folder == (tmp_path / "portrait").resolve()
    assert run_folders.read_identity(folder) == A
    info = json.loads((folder / run_folders.IDENTITY_FILE).read_text(encoding="utf-8"))
    assert info == {"format": run_folders.IDENTITY_FORMAT, "identity": A, "name": "portrait"}
    (folder / "step-000004").mkdir()  # the run wrote something
    assert run_folders.find_or_claim(tmp_path, "portrait", A, WHAT) == folder


def test_another_identity_gets_the_next_free_suffix_and_each_finds_its_own(tmp_path):
    first = run_folders.find_or_claim(tmp_path, "portrait", A, WHAT)
    (first / "step-000004").mkdir()
    second = run_folders.find_or_claim(tmp_path, "portrait", B, WHAT)
    (second / "samples").mkdir()
    third = run_folders.find_or_claim(tmp_path, "portrait", C, WHAT)
    assert [p.name for p in (first, second, third)] == ["portrait", "portrait-2", "portrait-3"]
    assert run_folders.find_or_claim(tmp_path, "portrait", B, WHAT) == second
    assert run_folders.find_or_claim(tmp_path, "portrait", A, WHAT) == first


def test_a_folder_of_a_run_that_wrote_nothing_is_taken_by_the_next_run(tmp_path):
    """A run that failed before it wrote anything (only its identity file) holds no run: the name stays free."""
    failed = run_folders.find_or_claim(tmp_path, "portrait", A, WHAT)
    assert run_folders.find_or_claim(tmp_path, "portrait", B, WHAT) == failed
    assert run_folders.read_identity(failed) == B
    (tmp_path / "empty").mkdir()
    assert run_folders.find_or_claim(tmp_path, "empty", A, WHAT).name == "empty"


def test_folders_without_an_identity_are_other_runs(tmp_path):
    """A headless run, a file, a user's folder: never written into."""
    (tmp_path / "style" / "step-000010").mkdir(parents=True)
    (tmp_path / "style-2").write_text("a file", encoding="utf-8")
    assert run_folders.find_or_claim(tmp_path, "style", A, WHAT).name == "style-3"
    assert not (tmp_path / "style" / run_folders.IDENTITY_FILE).exists()


def test_a_gap_in_the_suffixes_does_not_hide_a_later_run(tmp_path):
    for identity in (A, B, C):
        (run_folders.find_or_claim(tmp_path, "x", identity, WHAT) / "samples").mkdir()
    (tmp_path / "x-2" / "samples").rmdir()
    (tmp_path / "x-2" / run_folders.IDENTITY_FILE).unlink()
    (tmp_path / "x-2").rmdir()  # a user deleted the middle run
    assert run_folders.find_or_claim(tmp_path, "x", C, WHAT).name == "x-3"
    assert run_folders.find_or_claim(tmp_path, "x", "d" * 64, WHAT).name == "x-2"


def test_a_legacy_name_hash_folder_is_found_before_a_new_one_is_made(tmp_path):
    legacy = tmp_path / f"portrait-{A[:10]}"
    (legacy / "step-000002").mkdir(parents=True)
    assert run_folders.find_or_claim(tmp_path, "portrait", A, WHAT, legacy="portrait") == legacy.resolve()
    # The old default name was the arch; the new one may differ (the dataset's folder name).
    old_default = tmp_path / f"flux2_klein-{B[:10]}"
    old_default.mkdir()
    assert run_folders.find_or_claim(tmp_path, "faces", B, WHAT, legacy="flux2_klein") == old_default.resolve()
    assert run_folders.find_or_claim(tmp_path, "portrait", C, WHAT, legacy="portrait").name == "portrait"
    assert not list(tmp_path.glob(f"*{C[:10]}"))


def test_an_unreadable_or_foreign_identity_file_is_another_run(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / run_folders.IDENTITY_FILE).write_text("{not json", encoding="utf-8")
    (tmp_path / "x" / "samples").mkdir()
    assert run_folders.read_identity(tmp_path / "x") is None
    assert run_folders.find_or_claim(tmp_path, "x", A, WHAT).name == "x-2"


@pytest.mark.parametrize("name", ["../escape", "/tmp/abs", "a/b", ""])
def test_a_name_that_leaves_the_root_is_refused_before_anything_is_written(tmp_path, name):
    with pytest.raises(ValueError, match=f"{WHAT}: {name!r}"):
        run_folders.find_or_claim(tmp_path / "kiln", name, A, WHAT, legacy=name)
    assert not (tmp_path / "kiln").exists()


def test_the_default_name_is_the_first_valid_candidate():
    assert run_folders.default_name(["portrait"], "flux2_klein") == "portrait"
    assert run_folders.default_name(["my (photos)", ""], "flux2_klein") == "flux2_klein"
