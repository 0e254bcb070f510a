"""bench/gpu_folder.py's choices of what a GPU machine without a package index is carried (no download here)."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_folder  # noqa: E402


def test_the_machine_record_names_its_cuda_and_its_projects():
    record = ROOT / "bench" / "gpu_machine.txt"
    assert gpu_folder.machine_cuda(record) == "130"  # torch 2.11.0+cu130: bitsandbytes' libbitsandbytes_cuda130.so
    assert {"torch", "peft", "triton"} <= gpu_folder.machine_has(record)


def test_a_record_without_a_cuda_build_is_refused(tmp_path):
    record = tmp_path / "machine.txt"
    record.write_text("torch==2.11.0\n")
    with pytest.raises(SystemExit, match="names no torch CUDA build"):
        gpu_folder.machine_cuda(record)


def test_bitsandbytes_keeps_the_machines_cuda_library_alone(tmp_path):
    wheel = tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    names = [
        f"bitsandbytes/libbitsandbytes_{kind}.so" for kind in ("cuda128", "cuda130", "cuda132", "rocm72", "xpu2025")
    ]
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in [*names, "bitsandbytes/__init__.py", "bitsandbytes-0.50.2.dist-info/METADATA"]:
            archive.writestr(name, "x")
    gpu_folder.unpack(wheel, tmp_path / "site", "130")
    kept = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("*") if p.is_file()}
    assert kept == {
        "bitsandbytes/libbitsandbytes_cuda130.so",
        "bitsandbytes/__init__.py",
        "bitsandbytes-0.50.2.dist-info/METADATA",
    }
