"""A real ComfyUI server in a subprocess, for the server and browser tests (tests/nodes/test_server.py, *_e2e.py).

`ComfyServer` starts ComfyUI's own main.py on a free port with a temporary base directory
(`--base-directory`: models/, custom_nodes/, input/, output/, user/ under it), waits until it answers,
talks to it over HTTP (stdlib only) and stops it. Everything it prints goes to one log file.

Run as a script, this file is the launcher the server is started through:

    python comfy_server.py COMFYUI_PATH main.py-arguments...

It applies tests/helpers/comfy_env.py's CPU-torch workarounds (PyPI's torchvision and torchaudio wheels do not load
against the CPU torch; ComfyUI imports both at start) and then runs main.py as `python main.py` would, from
ComfyUI's folder. (comfy_env.prepare() itself cannot be used here: it imports comfy.cli_args before
main.py enables argument parsing, and ComfyUI would then ignore --port and the rest.)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def make_dataset(folder: Path, count: int = 4) -> None:
    """A tiny captioned dataset in two buckets for a server's input/ folder (numpy and PIL imported here,
    not at module level: the file also runs as the server's launcher)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for i in range(count):
        width, height = (64, 64) if i % 2 else (80, 64)  # two buckets
        Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"{{trigger}}, a photo number {i}", encoding="utf-8")


def make_edit_dataset(folder: Path, reference: Path) -> None:
    """A tiny edit dataset (targets, control/ images of the same names, instruction captions) and one
    reference image for LoadImage, in a server's input/ folder."""
    import numpy as np
    from PIL import Image

    make_dataset(folder, count=2)
    (folder / "control").mkdir()
    for i in range(2):
        target = np.asarray(Image.open(folder / f"img{i}.png"))
        Image.fromarray(255 - target).save(folder / "control" / f"img{i}.png")
        (folder / f"img{i}.txt").write_text("invert the colours", encoding="utf-8")
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(reference)


def make_clip_dataset(folder: Path, count: int = 2) -> None:
    """A tiny captioned clip dataset (64x64 mp4s of 12 frames at 24 fps, written with PyAV) for a server's input/."""
    from helpers.clips import write_clip

    folder.mkdir(parents=True)
    for i in range(count):
        write_clip(folder / f"clip{i}.mp4", frames=12, fps=24, size=(64, 64))
        (folder / f"clip{i}.txt").write_text(f"{{trigger}}, a moving bar number {i}", encoding="utf-8")


# Tiny model files in a test server's models/ (scripts/make_workflows.py's TINY names the Flux2 ones).
TINY_FILES = {
    "flux2_unet": "kiln_tiny_flux2_klein.safetensors",
    "flux2_vae": "kiln_tiny_flux2_vae.safetensors",
    "flux_vae": "kiln_tiny_flux_vae.safetensors",
    "zimage_adapter": "kiln_tiny_zimage_adapter.safetensors",
    "dataset": "kiln_tiny_dataset",
    "edit_dataset": "kiln_tiny_edits",
    "reference": "kiln_tiny_reference.png",
    "wan21_unet": "kiln_tiny_wan21_t2v.safetensors",
    "wan22_unet": "kiln_tiny_wan22_ti2v_5b.safetensors",
    "wan21_i2v_unet": "kiln_tiny_wan21_i2v.safetensors",  # WAN21_I2V: in_dim 36 and img_emb (CLIP vision)
    "wan21_vae": "kiln_tiny_wan21_vae.safetensors",  # also Qwen-Image's VAE (the same architecture)
    "clip_dataset": "kiln_tiny_clips",
}


def tiny_base(base: Path) -> Path:
    """A --base-directory for a test server: the pack and the test-only nodes (tests/nodes/server_nodes)
    linked into custom_nodes/, a tiny Flux2 Klein file (UNETLoader detects it from its shapes), tiny Flux2
    and Flux (Z-Image's) VAE files, tiny Wan 2.1 T2V, Wan 2.1 I2V and Wan 2.2 TI2V 5B files and a Wan 2.1 VAE file
    (detected likewise), a tiny Z-Image training adapter in loras/, captioned image, edit and clip datasets in
    input/, and a returning user's settings (no first-run tutorial over the canvas)."""
    from helpers import tiny_comfy as tc
    from helpers import tiny_encoders, tiny_wan

    for sub in (
        "custom_nodes",
        "models/diffusion_models",
        "models/vae",
        "models/loras",
        "input",
        "output",
        "user/default",
    ):
        (base / sub).mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes" / "kiln").symlink_to(HERE.parents[1], target_is_directory=True)
    test_nodes = HERE.parent / "nodes" / "server_nodes"
    (base / "custom_nodes" / "kiln_test_nodes").symlink_to(test_nodes, target_is_directory=True)
    tc.write_flux2_file(base / "models" / "diffusion_models" / TINY_FILES["flux2_unet"])
    tc.write_vae_file(base / "models" / "vae" / TINY_FILES["flux2_vae"], flux2=True)
    tc.write_vae_file(base / "models" / "vae" / TINY_FILES["flux_vae"], flux2=False)
    tc.write_zimage_adapter_file(base / "models" / "loras" / TINY_FILES["zimage_adapter"])
    tiny_wan.write_wan_file(base / "models" / "diffusion_models" / TINY_FILES["wan21_unet"])
    tiny_wan.write_wan_file(base / "models" / "diffusion_models" / TINY_FILES["wan22_unet"], in_dim=48, out_dim=48)
    tiny_wan.write_wan_file(
        base / "models" / "diffusion_models" / TINY_FILES["wan21_i2v_unet"], model_type="i2v", in_dim=36
    )
    tiny_encoders.write_wan21_vae_file(base / "models" / "vae" / TINY_FILES["wan21_vae"])
    make_clip_dataset(base / "input" / TINY_FILES["clip_dataset"])
    make_dataset(base / "input" / TINY_FILES["dataset"])
    make_edit_dataset(base / "input" / TINY_FILES["edit_dataset"], base / "input" / TINY_FILES["reference"])
    (base / "user" / "default" / "comfy.settings.json").write_text(json.dumps({"Comfy.TutorialCompleted": True}))
    return base


@contextlib.contextmanager
def running(comfy: str, base: Path):
    """A started ComfyServer on `base` (its start-up time in .startup_s), stopped after the block."""
    server, started = ComfyServer(comfy, base), time.monotonic()
    server.start()
    server.startup_s = time.monotonic() - started
    try:
        yield server
    finally:
        server.stop()


# What the browser tests drive ComfyUI's frontend with (tests/web/*.mjs): node, Chromium, playwright-core.
NODE = shutil.which("node") or ""
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser") or ""


def drive(
    driver: str, server: ComfyServer, out: Path, *args: str, timeout: float = 1800
) -> subprocess.CompletedProcess:
    """A browser driver of tests/web/ (node, playwright-core, headless Chromium) run against a live test server:
    --url, --out and --chromium, then the driver's own arguments. driver_report() reads what it found."""
    command = [NODE, str(HERE.parent / "web" / driver), "--url", server.url, "--out", str(out), "--chromium", CHROMIUM]
    return subprocess.run(
        [*command, *args], cwd=HERE.parents[1], capture_output=True, text=True, timeout=timeout, check=False
    )


def driver_report(done: subprocess.CompletedProcess) -> dict:
    """A driver's report: the JSON of its last line on stdout, after it exited cleanly."""
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"driver failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(lines[-1])


def require_browser(what: str) -> None:
    """Skip the calling test (or module) without node, Chromium or playwright-core, naming how to get each;
    fail instead in CI (comfy_env.required()), where ./scripts/test installs them."""
    from helpers import comfy_env
    import pytest

    playwright = HERE.parents[1] / "node_modules" / "playwright-core" / "package.json"
    missing = [
        name
        for name, present in (
            ("node", NODE),
            ("chromium (apt-get install chromium, or set CHROMIUM)", CHROMIUM),
            ("playwright-core (npm install)", playwright.is_file()),
        )
        if not present
    ]
    if missing and comfy_env.required():
        pytest.fail(f"{what} needs {', '.join(missing)} and CI must run it", pytrace=False)
    if missing:
        pytest.skip(f"{what} needs {', '.join(missing)}", allow_module_level=True)


def make_workflows():
    """scripts/make_workflows.py as a module (node definitions → widget slots, validation), loaded once."""
    import importlib.util

    if "kiln_make_workflows" in sys.modules:
        return sys.modules["kiln_make_workflows"]
    source = HERE.parents[1] / "scripts" / "make_workflows.py"
    spec = importlib.util.spec_from_file_location("kiln_make_workflows", source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    pass


class ComfyServer:
    def __init__(self, comfy: str, base: Path, *, extra_args: tuple[str, ...] = ()):
        self.comfy = str(Path(comfy).resolve())
        self.base = Path(base)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.base / "comfyui.log"
        self.extra_args = extra_args
        self.process: subprocess.Popen | None = None
        self._log_file = None

    # ---------------------------------------------------------------- lifecycle

    def start(self, timeout: float = 150.0) -> ComfyServer:
        from helpers import comfy_env  # tests/ is on sys.path in a test process (conftest)

        device = [] if comfy_env.gpu() else ["--cpu"]  # KILN_COMFY_GPU=1: on the GPU, as a user's ComfyUI serves
        args = [
            sys.executable,
            str(HERE / "comfy_server.py"),
            self.comfy,
            *device,
            "--listen",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--disable-auto-launch",
            "--base-directory",
            str(self.base),
            "--database-url",
            "sqlite:///:memory:",
            "--disable-api-nodes",
            *self.extra_args,
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("COMFYUI_PATH", None)
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115  (open while the server runs; closed in stop())
        self.process = subprocess.Popen(
            args,
            cwd=self.comfy,
            env=env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"ComfyUI exited with {self.process.returncode} while starting:\n{self.log_tail()}")
            try:
                self.get("/system_stats", timeout=2)
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(0.5)
        self.stop()
        raise ServerError(f"ComfyUI did not answer on {self.url} within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the server's own process group (it was started in a new session), SIGKILL if it lingers."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=15)
            except ProcessLookupError:
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    # ---------------------------------------------------------------- HTTP

    def _request(self, path: str, payload=None, timeout: float = 30):
        data = json.dumps(payload).encode() if payload is not None else None
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"} if data else {}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def get(self, path: str, timeout: float = 30):
        status, body = self._request(path, timeout=timeout)
        if status != 200:
            raise ServerError(f"GET {path}: HTTP {status}: {body[:500]!r}")
        return json.loads(body)

    def post(self, path: str, payload) -> tuple[int, dict]:
        status, body = self._request(path, payload)
        return status, (json.loads(body) if body else {})

    def queue(self, prompt: dict) -> str:
        """POST /prompt; the prompt id, or ServerError with ComfyUI's validation errors."""
        status, answer = self.post("/prompt", {"prompt": prompt, "client_id": "kiln-test"})
        if status != 200:
            raise ServerError(f"prompt refused (HTTP {status}): {json.dumps(answer, indent=1)[:3000]}")
        return answer["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 120.0) -> dict:
        """The /history entry of a prompt once it has finished (successfully or not)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                return entry
            if self.process is None or self.process.poll() is not None:
                raise ServerError(f"ComfyUI died while running {prompt_id}:\n{self.log_tail()}")
            time.sleep(0.25)
        raise ServerError(f"prompt {prompt_id} did not finish within {timeout:.0f} s:\n{self.log_tail()}")

    def run(self, prompt: dict, timeout: float = 120.0) -> dict:
        """Queue a prompt and wait for it; ServerError (with the node's error and the log) unless it succeeded."""
        entry = self.wait(self.queue(prompt), timeout)
        if entry["status"].get("status_str") != "success":
            errors = [m[1] for m in entry["status"].get("messages", []) if m[0] == "execution_error"]
            raise ServerError(f"prompt failed: {json.dumps(errors, indent=1)[:4000]}\n{self.log_tail()}")
        return entry

    # ---------------------------------------------------------------- log

    def log(self) -> str:
        if self._log_file is not None:
            self._log_file.flush()
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])


def _launch(argv: list[str]) -> None:
    comfy, main_args = str(Path(argv[0]).resolve()), argv[1:]
    sys.path.insert(0, str(HERE.parent))  # tests/, for helpers.comfy_env
    from helpers import comfy_env

    if not comfy_env.gpu():  # for PyPI's CPU wheels; on a GPU ComfyUI must be first to import torch (its allocator)
        comfy_env.cpu_torch_workarounds()
    import runpy

    # As `python main.py` from ComfyUI's folder: its folder first on sys.path, not this test folder.
    sys.path[:] = [comfy] + [p for p in sys.path if p not in ("", str(HERE), str(HERE.parent))]
    os.chdir(comfy)
    main = os.path.join(comfy, "main.py")
    sys.argv = [main, *main_args]
    runpy.run_path(main, run_name="__main__")


if __name__ == "__main__":
    _launch(sys.argv[1:])
