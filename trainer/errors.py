"""Kiln's exception base and the "did you mean" hint its messages share (a leaf: imports nothing of Kiln).

ComfyUI loads a custom-node pack under a module name that is the pack's file-system path, and names an
exception by its module and class, so a user saw `/home/me/ComfyUI/custom_nodes/kiln.trainer.config.ConfigError`.
Every Kiln exception class derives from KilnError, which names its subclasses `kiln.<Class>`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class KilnError(ValueError):
    """A bad input a user can fix; the message names the file, node or setting, and the fix."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__module__ = "kiln"  # what ComfyUI's error dialog and a traceback print before the class name


KilnError.__module__ = "kiln"


def did_you_mean(text: str, candidates: Iterable[str], most: int = 3) -> str:
    """ "; did you mean 'a' or 'b'?" for the candidates closest to `text`, else ""."""
    matches = difflib.get_close_matches(text, list(candidates), n=most, cutoff=0.6)
    if not matches:
        return ""
    quoted = [repr(m) for m in matches]
    return f"; did you mean {' or '.join(quoted) if len(quoted) < 3 else ', '.join(quoted[:-1]) + ' or ' + quoted[-1]}?"
