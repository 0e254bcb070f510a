"""The launched child of tests/nodes/test_launch_nodes.py: torchrun runs this file instead of `-m trainer train CONFIG`,
and it runs that same command (trainer.cli.main.main) with one change: ComfyUI cannot detect tiny text-encoder
files, so headless.py's loaders give the tiny VAE and text encoder, while the diffusion model really is read
from its file by ComfyUI's loader (as tests/test_headless.py does in one process). Each rank writes
what it was asked to load to <run>/loaded-rank<N>.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), os.environ["COMFYUI_PATH"]]  # the repository, tests/ (helpers)


def loaders(cfg, encoders: bool = True):
    import comfy.sd
    from helpers import tiny_comfy as tc

    run_dir = Path(cfg.output_dir) / cfg.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"loaded-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"encoders": encoders}))
    model = comfy.sd.load_diffusion_model(cfg.model_path)
    return (model, tc.tiny_vae(flux2=True), tc.tiny_klein_clip()) if encoders else (model, None, None)


def main() -> int:
    from helpers import comfy_env

    comfy_env.prepare(os.environ["COMFYUI_PATH"])  # as in the tests' own process: CPU torch beside PyPI's torchvision
    from trainer.cli.main import _headless
    from trainer.cli.main import main as cli

    headless = _headless()
    real = headless.train_command
    headless.train_command = lambda run, resume: real(run, resume, loaders=loaders)
    return cli(["train", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
