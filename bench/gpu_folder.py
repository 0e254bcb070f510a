"""Build the folder a GPU machine without a package index needs to run Kiln's GPU benches and node tests.

    python bench/gpu_folder.py [--tree ../shared/comfyui/v0.33] [--python 3.12] [--video]   → runs/gpu/

Then, on the GPU machine, from a copy of this checkout that carries runs/gpu/:

    bash bench/gpu_env.sh python bench/gpu_train.py --rows zimage:1024:1:on:default --out $OUT/r.json

runs/gpu/ holds one xz archive (ComfyUI's tree and the wheels the machine lacks, unpacked as a site folder),
`machine.txt`'s complement and `commit.txt`: the commit of the code being carried (+ `-dirty` when it differs),
which bench/gpu_env.sh exports as KILN_COMMIT so every record names the code it timed. The archive is
rebuilt only when the tree, the requirements or this script change; the commit is stamped on every call.

What goes in: the tree's Python files and data (no .git), and each requirement of the tree (and of Kiln's
`gpu` needs below) with its dependencies, as wheels for the machine's Python and platform from this
machine's package index, minus every project the GPU machine already has (bench/gpu_machine.txt: its
`pip freeze`, recorded with the command that made it). comfy-kitchen loses its HIP (AMD) library,
bitsandbytes every library but the machine's CUDA one; PyAV, a 35 MB video decoder the benches never call, is
replaced by an import stub unless --video.
The device tool carries at most 64 MiB per call: the script fails when the archive is larger.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MB = 60  # the device tool carries 64 MiB per call; the checkout's own files need the rest
# Not needed on a GPU machine that runs benches and node tests: the frontend and its templates (the tests
# serve a stand-in), the embedded docs, torch's own packages (the machine's CUDA build stays), and the
# tree's "non essential" extras (upscalers, OpenGL nodes).
LEAVE_OUT = {
    "comfyui-frontend-package",
    "comfyui-workflow-templates",
    "comfyui-embedded-docs",
    "torch",
    "torchvision",
    "torchaudio",
    "kornia",
    "spandrel",
    "pyopengl",
    "comfy-angle",
    "pydantic-settings",
}
KILN_NEEDS = [
    "diffusers==0.42.1",
    "importlib_metadata",
    "torchao==0.18.0",
    "bitsandbytes==0.50.2",
]  # bench/peer.py; torchao: adamw8bit_torchao, bitsandbytes: adamw8bit (a full run's 8-bit states); peft is on the machine
# av's modules ComfyUI imports at load time (comfy_api.latest); the stub answers any name with a placeholder.
AV_STUB_MODULES = (
    "av",
    "av.container",
    "av.subtitles",
    "av.subtitles.stream",
    "av.video",
    "av.video.reformatter",
    "av.audio",
    "av.audio.resampler",
    "av.error",
)


def project(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(tree: Path) -> list[str]:
    """The tree's requirements.txt lines (comments and blank lines dropped) and Kiln's own GPU needs."""
    lines = [line.split("#")[0].strip() for line in (tree / "requirements.txt").read_text().splitlines()]
    return [line for line in lines if line] + KILN_NEEDS


def name_of(requirement: str) -> str:
    return project(re.split(r"[<>=~!\[; ]", requirement, maxsplit=1)[0])


def machine_has(path: Path) -> set[str]:
    """Projects the GPU machine has (a `pip freeze` or `pip list` text)."""
    names = set()
    for line in path.read_text().splitlines():
        if line and not line.startswith(("#", "-", "Package")):
            names.add(project(re.split(r"[= @]", line.strip(), maxsplit=1)[0]))
    return names


def download(wanted: list[str], python: str, dest: Path, have: set[str]) -> list[Path]:
    """Wheels of `wanted` and of their dependencies that the GPU machine lacks, for its Python on x86-64 Linux.
    One project at a time without pip's resolver: it would fetch torch and CUDA (gigabytes) that the machine has."""
    abi = "cp" + python.replace(".", "")
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python,
        "--implementation",
        "cp",
        "--abi",
        abi,
        "--abi",
        "abi3",
        "--abi",
        "none",
        "-d",
        str(dest),
    ]
    for platform in (
        "manylinux_2_28_x86_64",
        "manylinux_2_24_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
        "any",
    ):
        command += ["--platform", platform]
    queue, seen = list(wanted), set()
    while queue:
        requirement = queue.pop(0)
        if name_of(requirement) in seen | have | LEAVE_OUT:
            continue
        seen.add(name_of(requirement))
        before = set(dest.glob("*.whl"))
        subprocess.run(command + [requirement], check=True, stderr=subprocess.DEVNULL)
        for wheel in set(dest.glob("*.whl")) - before:
            queue += dependencies(wheel, python)
    return sorted(dest.glob("*.whl"))


def dependencies(wheel: Path, python: str) -> list[str]:
    """A wheel's Requires-Dist for the machine's Python on Linux, extras left out."""
    from packaging.markers import Marker
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(meta).decode().splitlines()
    env = {
        "python_version": python,
        "python_full_version": python + ".0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }
    found = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.split(":", 1)[1].strip())
            if requirement.marker is None or Marker(str(requirement.marker)).evaluate(env):
                found.append(str(requirement).split(";")[0].strip())
    return found


def machine_cuda(path: Path) -> str:
    """The GPU machine's CUDA as bitsandbytes names its libraries ("130" for torch 2.11.0+cu130)."""
    found = re.search(r"\+cu(\d+)", path.read_text())
    if not found:
        raise SystemExit(f"{path} names no torch CUDA build (+cuNNN): record the machine's pip list with its header")
    return found.group(1)


def unpack(wheel: Path, site: Path, cuda: str) -> None:
    """A wheel unpacked as pip would install it into site-packages (it is a zip of that layout)."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            if wheel.name.startswith("comfy_kitchen") and "/backends/hip/" in member.filename:
                continue  # the AMD library: 59 MB the NVIDIA machine never loads (the backend is optional)
            library = re.fullmatch(r"bitsandbytes/libbitsandbytes_(\w+)\.so", member.filename)
            if library and library.group(1) != f"cuda{cuda}":
                continue  # one library per CUDA, ROCm and XPU build (125 MB); the machine loads its CUDA's alone
            archive.extract(member, site)


def write_av_stub(site: Path) -> None:
    """`import av` and the from-imports ComfyUI makes at load time succeed; using any of it raises."""
    body = (
        '"""A stand-in for PyAV on a GPU bench machine (bench/gpu_folder.py): imports succeed, use raises."""\n\n\n'
        "class _Names(type):  # class attributes too (ComfyUI 0.33 reads ColorTrc.ARIB_STD_B67 at import)\n"
        "    def __getattr__(cls, name):\n"
        '        if name.startswith("__"):\n'
        "            raise AttributeError(name)\n"
        "        return cls\n\n\n"
        "class _Missing(metaclass=_Names):\n"
        "    def __init__(self, *args, **kwargs):\n"
        '        raise RuntimeError("PyAV is stubbed on this machine: build runs/gpu with --video")\n\n\n'
        "def __getattr__(name):\n"
        '    if name.startswith("__"):\n'
        "        raise AttributeError(name)\n"
        "    return _Missing\n"
    )
    for module in AV_STUB_MODULES:
        folder = site.joinpath(*module.split("."))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text(body)


def fingerprint(tree: Path, wanted: list[str], args: argparse.Namespace) -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(repr((sorted(wanted), args.python, args.video)).encode())
    for path in sorted(tree.rglob("*")):
        if path.is_file() and ".git" not in path.parts:
            digest.update(str(path.relative_to(tree)).encode() + path.stat().st_size.to_bytes(8, "little"))
    return digest.hexdigest()[:16]


def commit() -> str:
    """HEAD of this checkout, + '-dirty' when the carried code differs from it."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(
        git + ["status", "--porcelain", "--", "trainer", "nodes", "bench", "headless.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return head + ("-dirty" if dirty else "")


def build(tree: Path, out: Path, args: argparse.Namespace) -> None:
    have = machine_has(Path(args.machine))
    wanted = [r for r in requirements(tree) if name_of(r) not in LEAVE_OUT and name_of(r) not in have]
    if not args.video:
        wanted = [r for r in wanted if name_of(r) != "av"]
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        site = scratch / "site"
        wheels = download(wanted, args.python, scratch / "wheels", have)
        kept = [w for w in wheels if project(w.name.split("-")[0]) not in have | LEAVE_OUT]
        for wheel in kept:
            unpack(wheel, site, machine_cuda(Path(args.machine)))
        if not args.video:
            write_av_stub(site)
        shutil.copytree(tree, scratch / "comfyui", ignore=shutil.ignore_patterns(".git", "__pycache__"))
        (scratch / "WHEELS.txt").write_text("".join(f"{w.name}\n" for w in kept))
        archive = out / "kiln-gpu.tar.xz"
        with tarfile.open(archive.with_suffix(".tmp"), "w:xz", preset=6) as tar:
            for part in ("site", "comfyui", "WHEELS.txt"):
                tar.add(scratch / part, arcname=part)
        archive.with_suffix(".tmp").replace(archive)
    print(f"{archive}: {archive.stat().st_size / 2**20:.1f} MiB; wheels: {', '.join(w.name for w in kept)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=str(ROOT.parent / "shared" / "comfyui" / "v0.33"), help="a ComfyUI tree")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python (major.minor)")
    parser.add_argument(
        "--machine",
        default=str(ROOT / "bench" / "gpu_machine.txt"),
        help="the GPU machine's `pip freeze` (what it already has)",
    )
    parser.add_argument("--video", action="store_true", help="carry the real PyAV (35 MB) instead of a stub")
    parser.add_argument("--out", default=str(ROOT / "runs" / "gpu"))
    args = parser.parse_args(argv)
    tree, out = Path(args.tree).resolve(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = fingerprint(tree, requirements(tree), args)
    if (out / "fingerprint.txt").is_file() and (out / "fingerprint.txt").read_text() == stamp:
        print(f"{out / 'kiln-gpu.tar.xz'}: up to date")
    else:
        build(tree, out, args)
        (out / "fingerprint.txt").write_text(stamp)
    (out / "commit.txt").write_text(commit() + "\n")
    (out / "comfyui.txt").write_text(tree.name + "\n")
    size = (out / "kiln-gpu.tar.xz").stat().st_size / 2**20
    if size > LIMIT_MB:
        raise SystemExit(f"{out / 'kiln-gpu.tar.xz'} is {size:.0f} MiB, over the {LIMIT_MB} MiB a device call carries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
