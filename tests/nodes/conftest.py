"""Fixtures of the node pack's tests: ComfyUI's folders in a temporary folder, kernels for bitwise GPU runs."""

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


@pytest.fixture
def same_kernels():
    """Training options under which two runs on the GPU (KILN_COMFY_GPU=1) may be compared bit for bit: torch's
    deterministic algorithms, strictly (only then do flash attention's and cuDNN's backward take their
    deterministic paths: otherwise LoRA weights were up to ~3e-4 apart after 8 steps of two equal runs on an
    H200), and flash attention. Set CUBLAS_WORKSPACE_CONFIG=:4096:8 for the process too. On the CPU runs are
    bitwise as they are: {}."""
    from helpers import comfy_env

    if not comfy_env.gpu():
        yield {}
        return
    import torch

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield {"attention": "flash"}
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
