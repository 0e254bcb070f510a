"""Every setting of a run: TrainConfig, each field declared once with its help, bounds, choices, group and
widget facts (fields.py), the checks (checks.py), building one from plain values and presets (build.py),
config files (files.py) and the node-side layers of preset, options and widgets (layers.py).

`from trainer import config` is the door callers use; the sub-modules import each other one way."""
from .build import from_dict, replace, validate  # noqa: F401
from .fields import *  # noqa: F401,F403
from .fields import (  # noqa: F401
    AUTO,
    AUTO_FIELDS,
    BOUNDS,
    CHOICES,
    FIELDS,
    HELP,
    PRESETS,
    ConfigError,
    TrainConfig,
)
