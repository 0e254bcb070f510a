"""Widgets built from the settings' declarations (trainer/config), which the checks validate against, and Kiln's
socket types.

A widget's bounds and choices come from `config.BOUNDS` and `config.CHOICES`,
its default from `TrainConfig`, its tooltip from that field's help text
(`config.HELP`), so the UI can never offer a value the trainer would refuse.
"""

from __future__ import annotations

import decimal
import inspect
import re

from comfy_api.latest import io

from ..trainer import config as cfg_module
from ..trainer import paths

DATASET = io.Custom("KILN_DATASET")
STATE = io.Custom("KILN_STATE")
OPTIONS = io.Custom("KILN_TRAIN_OPTIONS")
VALIDATION = io.Custom("KILN_VALIDATION")

CATEGORY = "Kiln"
_DEFAULTS = cfg_module.TrainConfig()
# ComfyUI's io hides `advanced` inputs behind the node's "Show advanced" (frontends 1.41 and 1.49 honour it);
# an io without the argument shows every input.
HAS_ADVANCED = "advanced" in inspect.signature(io.Boolean.Input.__init__).parameters


# The "auto" settings shipped in 0.1.0 as the widget types saved workflows hold for them (a boolean, a number):
# the widget value that means auto, and the tooltip that says so.
AUTO_WIDGETS = {
    "compile_blocks": (
        True,
        "torch.compile each block (fuses norms, RoPE, gates; the first steps compile). On: "
        "where it pays (CUDA with Triton; a compile that fails there goes on uncompiled, with "
        "a log line); off: never.",
    ),
    "checkpoint_budget": (
        -1.0,
        "With compiled blocks and checkpointing: share of each block's activation memory "
        "kept (0 = recompute the block, 1 = keep all; faster, more memory). -1 = auto: the "
        "largest share whose estimated peak leaves a margin of the GPU's free memory.",
    ),
    # added after 0.1.0, an int like its headless setting: -1 means auto, as for checkpoint_budget
    "stream_blocks": (
        -1,
        "PyTorch: how many of the model's blocks keep their frozen weights in pinned host memory and are copied "
        "to the GPU just before they run, so a card smaller than the model trains it (slower only where the "
        "copies outrun the compute). -1 = auto: on a CUDA GPU, the fewest blocks that make the estimated step fit "
        "(0 where the model fits; the dashboard's Memory section shows the plan); 0 = every block on the GPU.",
    ),
}
NEGATIVE_IS_AUTO = ("checkpoint_budget", "stream_blocks")  # a number widget whose -1 means "auto"

# "auto" settings added after 0.1.0 are combos of three words (no saved workflow holds another type for them):
# the fields declared tristate (trainer/config), each word → the config's value.
TRISTATE = {name: {"auto": cfg_module.AUTO, "on": True, "off": False} for name in cfg_module.TRISTATE_FIELDS}
STEPS_TOOLTIP = "Total optimizer steps (a resumed run continues to this)"


def from_widget(name: str, value):
    """A widget's value as the config takes it: the auto widgets' "auto" values become "auto"."""
    if name in TRISTATE and isinstance(value, str):
        return TRISTATE[name].get(value, value)
    if name == "compile_blocks":
        return cfg_module.AUTO if value is True else value
    if name in NEGATIVE_IS_AUTO and isinstance(value, (int, float)) and value < 0:
        return cfg_module.AUTO
    return value


def decimals(value: float) -> int:
    """Decimals of a number's shortest decimal form: 1e-4 → 4, 0.999 → 3, 32.0 → 0."""
    return max(0, -decimal.Decimal(repr(float(value))).normalize().as_tuple().exponent)


def float_step(name: str, value: float, low: float | None, high: float | None) -> float:
    """A float widget's step. ComfyUI's frontends (1.41, 1.49) show a FLOAT with as many decimals as its step
    has, move it by one step per arrow click and round a typed value to that step, so the step is as fine as
    the default, the bounds and the setting's declared step are: each shows exactly, and no value the trainer
    takes between them is rounded away (adam_eps 1e-12..1e-3: 12 decimals)."""
    numbers = [value, *(bound for bound in (low, high) if bound is not None)]
    digits = max(2, *map(decimals, numbers), decimals(cfg_module.STEPS.get(name, 1.0)))
    return float(f"1e-{digits}")


def widget(
    name: str, *, default=None, tooltip_text: str | None = None, optional: bool = False, display_name: str | None = None
):
    """The widget for TrainConfig field `name`: bounds, choices, default and tooltip from its declaration."""
    kind = cfg_module.KIND[name]  # an auto setting's type without "auto": what its widget holds
    value = getattr(_DEFAULTS, name) if default is None else default
    if name in AUTO_WIDGETS and value == cfg_module.AUTO:
        value, tooltip_text = AUTO_WIDGETS[name][0], tooltip_text or AUTO_WIDGETS[name][1]
    common = dict(tooltip=tooltip_text or cfg_module.HELP[name], optional=optional, display_name=display_name)
    if HAS_ADVANCED and name in cfg_module.ADVANCED:
        common["advanced"] = True
    if name in TRISTATE:
        words = {config_value: word for word, config_value in TRISTATE[name].items()}
        return io.Combo.Input(name, options=list(TRISTATE[name]), default=words[value], **common)
    if name in cfg_module.CHOICES:
        return io.Combo.Input(name, options=list(cfg_module.CHOICES[name]), default=value, **common)
    if kind == "bool":
        return io.Boolean.Input(name, default=value, **common)
    low, high = cfg_module.BOUNDS.get(name, (None, None))
    if name in NEGATIVE_IS_AUTO:
        low = AUTO_WIDGETS[name][0]
    if kind == "int":
        # A seed that re-rolls after each queue would start a new run instead of resuming this one.
        fixed = dict(control_after_generate=io.ControlAfterGenerate.fixed) if name == "seed" else {}
        return io.Int.Input(
            name,
            default=value,
            min=int(low) if low is not None else None,
            max=int(high) if high is not None else None,
            **fixed,
            **common,
        )
    if kind == "float":
        # No `round`: the frontends round to the step's decimals whatever it says (round=False included).
        return io.Float.Input(name, default=value, min=low, max=high, step=float_step(name, value, low, high), **common)
    if kind in ("list[int]", "list[str]"):
        return io.String.Input(name, default=", ".join(str(v) for v in value), **common)
    return io.String.Input(name, default=value, **common)


def preset_input():
    """The preset combo of the train nodes: the config's presets, or none; the tooltip gives each one's reason."""
    reasons = "\n".join(f"{name}: {line}" for name, line in cfg_module.PRESET_LINES.items())
    return io.Combo.Input(
        "preset",
        options=["none", *cfg_module.PRESETS],
        default="none",
        tooltip="Fills the settings that neither this node nor a connected option node sets (docs/command-line.md: "
        f"Presets; `python -m trainer presets` lists what each sets)\n{reasons}",
    )


def parse_list(text: str, kind=str) -> list:
    """ "512, 768,1024" → [512, 768, 1024]; blank → []."""
    items = [t.strip() for t in re.split(r"[,\n]", text or "") if t.strip()]
    try:
        return [kind(t) for t in items]
    except ValueError as err:
        raise ValueError(f"could not read {text!r} as a comma-separated list of {kind.__name__}: {err}") from None


def checked(check, value) -> bool | str:
    """A node's validate_inputs: True, or the message of the ValueError `check(value)` raises, which ComfyUI shows
    on the node when it refuses the prompt, before any model loads. A value wired from another node is None at
    that time: it is checked when the node runs."""
    if value is None:
        return True
    try:
        check(value)
    except ValueError as error:
        return str(error)
    return True


def run_name_check(run_name=None) -> bool | str:
    """validate_inputs of every node with a run_name widget (Training Options, Saving & Logging)."""
    return checked(lambda name: name and paths.check_name(name, "Kiln Training Options: run_name"), run_name)
