"""Fixtures of the node pack's tests: ComfyUI's folders in a temporary folder."""

import pytest


@pytest.fixture(scope="module")
def comfy_dirs(tmp_path_factory):
    """input/, output/ and loras/ of a temp folder as ComfyUI's own (module scope); the folder's path."""
    import folder_paths

    root = tmp_path_factory.mktemp("comfy")
    for name in ("input", "output", "loras"):
        (root / name).mkdir()
    folder_paths.set_input_directory(str(root / "input"))
    folder_paths.set_output_directory(str(root / "output"))
    folder_paths.folder_names_and_paths["loras"] = ([str(root / "loras")], folder_paths.supported_pt_extensions)
    return root
