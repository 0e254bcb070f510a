"""Every setting of a run: TrainConfig, each field declared once with every fact about it (declaration.py: the
`setting` machinery; its sections in training.py, optimiser.py, data.py and output.py; TrainConfig and the tables derived from
the declarations in fields.py), presets (presets.py), a sample prompt's keys (prompts.py), the checks (checks.py),
building one from plain values (build.py), config files (files.py) and the node-side layers of preset, options and
widgets (layers.py).

`from trainer import config` is the door callers use; the sub-modules import each other one way. Each module's
`__all__` says what this door exports."""

from . import build, data, declaration, fields, optimiser, output, presets, prompts, training
from .build import *
from .data import *
from .declaration import *
from .fields import *
from .optimiser import *
from .output import *
from .presets import *
from .prompts import *
from .training import *

__all__ = (
    build.__all__
    + declaration.__all__
    + training.__all__
    + optimiser.__all__
    + data.__all__
    + output.__all__
    + fields.__all__
    + presets.__all__
    + prompts.__all__
)
