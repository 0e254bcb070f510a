"""How a setting is declared: `setting(default, help, group, ...)` puts every fact about one TrainConfig field
in that field's metadata (data, not a comment, so a bytecode-only install has it too), and `tables` reads them
back as the tables the checks, the widgets and the run identity use. Nothing else states a setting's facts."""

from __future__ import annotations

from dataclasses import Field, field
from typing import Any

from ..errors import KilnError

__all__ = ["AUTO", "GROUPS", "NODES", "ConfigError", "Tables", "setting"]

# Settings that may also be "auto": the backend decides at the start of a run, from the device and its free
# memory (trainer/backends/torch_backend/levers.py). They are the fast path, so they are defaults.
AUTO = "auto"
# Each setting's group: what it is about. The option nodes are cut by it (nodes/option_nodes.py), everyday
# settings before advanced ones.
GROUPS = ("model", "training", "adapter", "objective", "ema", "speed", "data", "output", "samples")
# The node that shows a setting in a graph: Train LoRA ("train", at its `slot`), the dataset nodes ("dataset":
# Load Dataset, Encode Captions, reg_dataset), the option nodes ("options"), or none ("none": the graph gives
# it some other way, or only headless `train` reads it).
NODES = ("options", "train", "dataset", "none")


class ConfigError(KilnError):
    """A bad setting: the message names the key, the value and what is allowed."""


def setting(
    default: Any,
    help_text: str,
    group: str,
    *,
    advanced: bool = False,
    step: float | None = None,
    bounds: tuple[float, float] | None = None,
    choices: tuple[str, ...] | None = None,
    identity: bool = True,
    node: str = "options",
    slot: int | None = None,
    auto: bool = False,
    tristate: bool = False,
) -> Any:
    """A TrainConfig field and every fact about it:

    help_text: what it does and when to change it (a node's tooltip); group: what it is about (GROUPS);
    advanced: only experts change it (behind a node's Show advanced); step: for a float, the finest change that
    matters when the default and bounds do not say it (a widget shows that many decimals); bounds: inclusive
    (low, high), for a list each element's; choices: the words it takes; identity=False: not part of a run's
    identity (changing it after a stop resumes the same run folder: how a run is computed or what it writes
    beside, not what it trains); node and slot: which node shows it (NODES) and, on Train LoRA, where;
    auto: it also takes "auto" (its type says `| Literal["auto"]`); tristate: its widget is a combo of
    auto / on / off. A list default is copied for each config."""
    if group not in GROUPS:
        raise ValueError(f"setting group {group!r} is not one of {GROUPS}")
    if node not in NODES or (node == "train") != (slot is not None):
        raise ValueError(f"setting node {node!r} is not one of {NODES}, or a slot is given off Train LoRA")
    if (auto or tristate) and (default != AUTO or not auto):
        raise ValueError('an auto setting defaults to "auto"; a tristate one is auto too')
    metadata = dict(
        help=help_text,
        group=group,
        advanced=advanced,
        step=step,
        bounds=bounds,
        choices=choices,
        identity=identity,
        node=node,
        slot=slot,
        auto=auto,
        tristate=tristate,
    )
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


_AUTO_TYPES = (" | Literal['auto']", ' | Literal["auto"]')  # as `from __future__ import annotations` keeps it


class Tables:
    """The tables derived from a config's declarations, each in field order."""

    def __init__(self, fields: dict[str, Field]):
        meta = {name: f.metadata for name, f in fields.items()}
        self.help = {name: m["help"] for name, m in meta.items()}
        self.group = {name: m["group"] for name, m in meta.items()}
        self.advanced = frozenset(name for name, m in meta.items() if m["advanced"])
        self.steps = {name: m["step"] for name, m in meta.items() if m["step"]}
        self.bounds = {name: m["bounds"] for name, m in meta.items() if m["bounds"] is not None}
        self.choices = {name: m["choices"] for name, m in meta.items() if m["choices"] is not None}
        self.auto = tuple(name for name, m in meta.items() if m["auto"])
        self.tristate = tuple(name for name, m in meta.items() if m["tristate"])
        self.not_identity = tuple(name for name, m in meta.items() if not m["identity"])
        self.node = {name: m["node"] for name, m in meta.items()}
        on_train = sorted((m["slot"], name) for name, m in meta.items() if m["node"] == "train")
        self.train_widgets = tuple(name for _, name in on_train)
        # The type a value has when it is not "auto": what the checks and widgets test a value against.
        self.kind = {name: _without_auto(str(f.type)) for name, f in fields.items()}

    def on_node(self, node: str) -> tuple[str, ...]:
        return tuple(name for name, shown in self.node.items() if shown == node)


def _without_auto(kind: str) -> str:
    for suffix in _AUTO_TYPES:
        kind = kind.removesuffix(suffix)
    return kind
