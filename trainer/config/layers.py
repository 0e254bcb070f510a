"""A config resolved from layers of settings, and where each setting came from (Train LoRA's report).

Defaults < preset < each layer in the order given, a later layer winning; in a graph: option nodes < the
train node's widgets < the dataset < the model. The preset fills only what no layer sets, so a value set on a
connected option node wins over it, default or not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .build import from_dict
from .fields import TrainConfig
from .presets import PRESETS

_DEFAULTS = TrainConfig().to_dict()


@dataclass(frozen=True)
class Resolved:
    config: TrainConfig
    sources: dict[str, str] = field(default_factory=dict)  # setting → the layer its value came from
    preset: str | None = None
    layers: tuple[str, ...] = ()  # the layers' names, first (weakest) first

    def then(self, config: TrainConfig, source: str) -> Resolved:
        """This resolution after `config` replaced some of its values (an init LoRA's rank): those from `source`."""
        before, after = self.config.to_dict(), config.to_dict()
        moved = {name: source for name, value in after.items() if value != before[name]}
        layers = (*self.layers, source) if moved else self.layers
        return Resolved(config, {**self.sources, **moved}, self.preset, layers)

    def lines(self) -> list[str]:
        """One line per setting that differs from its default or overrides the preset: `name = value (source)`."""
        preset = PRESETS.get(self.preset or "", {})
        found = []
        for name, value in self.config.to_dict().items():
            source = self.sources.get(name, "default")
            overrides = name in preset and source != f"preset {self.preset}" and preset[name] != value
            if value != _DEFAULTS[name] or overrides:
                note = f"; preset {self.preset}: {shown(preset[name])}" if overrides else ""
                found.append(f"{name} = {shown(value)} ({source}{note})")
        return found

    def report(self) -> str:
        """The settings block of a node's text: the layers in order, then lines()."""
        order = " < ".join(["defaults", *[f"preset {self.preset}"] * bool(self.preset), *self.layers])
        lines = self.lines() or ["all at their defaults"]
        return "\n".join([f"settings ({order}; later wins):", *(f"  {line}" for line in lines)])


def resolve(layers: Sequence[tuple[str, Mapping[str, Any]]], preset: str | None = None) -> Resolved:
    """Defaults, then the preset, then each (source, values) layer in order; validated (config.from_dict)."""
    sources = {name: f"preset {preset}" for name in PRESETS.get(preset or "", {})}
    merged: dict[str, Any] = {}
    for source, values in layers:
        for name, value in values.items():
            merged[name], sources[name] = value, source
    return Resolved(from_dict(merged, preset=preset), sources, preset, tuple(source for source, _ in layers))


def shown(value: Any) -> str:
    """A setting's value as a line shows it: text bare ("" when empty), numbers and lists as Python writes them."""
    return (value or '""') if isinstance(value, str) else repr(value)
