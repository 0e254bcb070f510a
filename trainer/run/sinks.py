"""Where a run's figures go besides the console and the dashboard: TensorBoard and Weights & Biases.

Both are optional packages, imported only when the config asks for them
(`log_tensorboard`, `wandb_project`); asked for but not installed is an error
that names the pip package. The loop opens the sinks on the main rank only and
calls `log_scalars` for each step as its figures are read, `log_images` at
validation, `close` at the end. Event files go under `<run>/tensorboard/`,
W&B's files under `<run>/wandb/` (offline unless wandb_mode = "online"). A
resumed run writes to the same place with the same steps: TensorBoard drops
the events past the resumed step (purge_step), W&B resumes the run id
kept in the run folder.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, Protocol

import numpy as np

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"


class Sink(Protocol):
    def log_scalars(self, step: int, values: dict[str, float]) -> None: ...
    def log_images(self, step: int, name: str, images: list[np.ndarray]) -> None: ...  # each [H,W,3] in 0..1
    def log_config(self, config: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def _missing(package: str, setting: str) -> ImportError:
    return ImportError(
        f"{setting} is set but the {package!r} package is not installed: `pip install {package}` "
        f"in the Python that runs Kiln, or turn {setting} off"
    )


class TensorBoardSink:
    """torch.utils.tensorboard's SummaryWriter into <run>/tensorboard/."""

    def __init__(self, run_dir: Path, start: int):
        try:
            import tensorboard  # noqa: F401  (SummaryWriter needs it)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise _missing("tensorboard", "log_tensorboard") from err
        # purge_step: a run resumed at `start` steps done hides what an earlier try logged past them.
        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=start + 1 if start else None)

    def log_scalars(self, step, values):
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def log_images(self, step, name, images):
        for index, image in enumerate(images):
            self.writer.add_image(
                f"{name}/{index}", np.clip(np.asarray(image, np.float32), 0, 1), step, dataformats="HWC"
            )

    def log_config(self, config):
        import json

        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def close(self):
        self.writer.close()


class WandbSink:
    """A wandb run under <run>/wandb/, offline by default (`wandb sync <run>/wandb/offline-run-*` uploads it)."""

    def __init__(self, run_dir: Path, project: str, mode: str):
        try:
            import wandb
        except ImportError as err:
            raise _missing("wandb", "wandb_project") from err
        self.wandb = wandb
        (run_dir / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project, dir=str(run_dir), mode=mode, id=run_id(run_dir), resume="allow", name=run_dir.name
        )

    def log_scalars(self, step, values):
        self.run.log(dict(values), step=step)

    def log_images(self, step, name, images):
        pixels = [np.clip(255 * np.asarray(image, np.float32), 0, 255).astype(np.uint8) for image in images]
        self.run.log({name: [self.wandb.Image(p) for p in pixels]}, step=step)

    def log_config(self, config):
        self.run.config.update(config, allow_val_change=True)

    def close(self):
        self.run.finish()


def run_id(run_dir: Path) -> str:
    """A W&B run id that a run folder keeps (so a resumed run continues it): its name and a path hash."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", run_dir.name)[:40]
    return f"{name}-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]}"


class Sinks:
    """Every sink the config asks for, called as one."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def log_scalars(self, step: int, values: dict[str, float | None]) -> None:
        finite = {k: float(v) for k, v in values.items() if v is not None and np.isfinite(v)}
        for sink in self.sinks:
            sink.log_scalars(step, finite)

    def log_images(self, step: int, name: str, images) -> None:
        if images:
            for sink in self.sinks:
                sink.log_images(step, name, list(images))

    def log_config(self, config: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log_config(config)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_sinks(cfg, run_dir: str | Path, start: int, main: bool = True) -> Sinks:
    """The sinks `cfg` asks for (none on ranks other than the main one), with the config logged once."""
    run_dir = Path(run_dir)
    sinks: list[Sink] = []
    if main and cfg.log_tensorboard:
        sinks.append(TensorBoardSink(run_dir, start))
    if main and cfg.wandb_project:
        sinks.append(WandbSink(run_dir, cfg.wandb_project, cfg.wandb_mode))
    out = Sinks(sinks)
    out.log_config(cfg.to_dict())
    return out
