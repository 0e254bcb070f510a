"""The node tests import their helpers by module name (comfy_env from tests/; tiny_comfy, comfy_server and
test_nodes from here): both folders go on sys.path once, before any node test module is collected."""
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent, HERE):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


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
