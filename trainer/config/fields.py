"""TrainConfig: every setting of a run, typed, documented and validated at the edge.

Each field is declared once, with every fact about it, by `setting` (declaration.py) in its section: what trains
(training.py), what a run reads (data.py), what it writes and watches (output.py). The tables below are derived
from those declarations; the checks (checks.py) and the ComfyUI widgets (nodes/widgets.py) read them, so a widget
can never offer a value the checks reject, and a run's identity (`identity_values`) follows each field's own
`identity`. Presets are in presets.py, a sample prompt's keys in prompts.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .data import DataFields, PreservationFields
from .declaration import Tables
from .optimiser import OptimiserFields
from .output import HoldoutFields, OutputFields, SampleFields
from .training import (
    AdapterKindFields,
    EmaFields,
    LoraFields,
    ModelFields,
    ObjectiveFields,
    SpeedFields,
)

__all__ = [
    "ADVANCED",
    "AUTO_FIELDS",
    "BOUNDS",
    "CHOICES",
    "DATASET_FIELDS",
    "FIELDS",
    "GROUP",
    "HELP",
    "KIND",
    "NODE",
    "NOT_IDENTITY",
    "NOT_IN_GRAPH",
    "SAMPLE_FIELDS",
    "STEPS",
    "TRAIN_WIDGETS",
    "TRISTATE_FIELDS",
    "TrainConfig",
    "identity_values",
]


# A dataclass takes its bases' fields last base first, so the sections are listed from the last field's to
# the first's: the field order (a config's to_dict, a saved LoRA's kiln.config) is ModelFields' first, then
# LoraFields', ..., HoldoutFields' last. A new section goes FIRST in this list.
@dataclass
class TrainConfig(
    HoldoutFields,
    SampleFields,
    AdapterKindFields,
    OutputFields,
    PreservationFields,
    DataFields,
    EmaFields,
    ObjectiveFields,
    SpeedFields,
    OptimiserFields,
    LoraFields,
    ModelFields,
):
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_TABLES = Tables(FIELDS)
HELP: dict[str, str] = _TABLES.help
GROUP: dict[str, str] = _TABLES.group
ADVANCED = _TABLES.advanced
STEPS: dict[str, float] = _TABLES.steps
# Inclusive (low, high) for numbers; for lists, the bounds of each element.
BOUNDS: dict[str, tuple[float, float]] = _TABLES.bounds
CHOICES: dict[str, tuple[str, ...]] = _TABLES.choices
KIND: dict[str, str] = _TABLES.kind
AUTO_FIELDS = _TABLES.auto
TRISTATE_FIELDS = _TABLES.tristate
NOT_IDENTITY = _TABLES.not_identity
# The sample settings (kept for one release: identity=False and node="none" say what this said).
SAMPLE_FIELDS = tuple(name for name in FIELDS if name.startswith("sample_"))
NODE: dict[str, str] = _TABLES.node
TRAIN_WIDGETS = _TABLES.train_widgets
DATASET_FIELDS = _TABLES.on_node("dataset")
NOT_IN_GRAPH = _TABLES.on_node("none")


def identity_values(values: dict[str, Any]) -> dict[str, Any]:
    """A config's values that make a run's identity (its folder hash): every field not declared identity=False."""
    return {key: value for key, value in values.items() if key not in NOT_IDENTITY}
