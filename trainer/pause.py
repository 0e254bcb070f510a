"""Pause: the loop waits between steps while a front end asks it to (the dashboard's Pause, a PAUSE file).

Nothing is freed while paused (the model, the LoRA and the optimizer stay where they are, GPU memory
included), so Resume continues at once; a stop asked for while paused ends the wait, and the loop then
stops as it always does (a resumable checkpoint). The time spent waiting is left out of speed and ETA.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.1            # how often a paused loop asks again
PAUSE_FILE = "PAUSE"    # headless: while <run>/PAUSE exists the run waits (touch it to pause, delete it to resume)


def wait(should_pause: Callable[[], bool] | None, should_stop: Callable[[], bool] | None = None,
         poll_s: float = POLL_S, on_pause: Callable[[bool], None] | None = None) -> float:
    """Block while should_pause() and no stop is wanted; the seconds waited (0 when not paused).
    on_pause(True) is called when a wait begins, on_pause(False) when it ends."""
    if should_pause is None or not should_pause():
        return 0.0
    began = time.perf_counter()
    if on_pause is not None:
        on_pause(True)
    try:
        while should_pause() and not (should_stop is not None and should_stop()):
            time.sleep(poll_s)
    finally:
        if on_pause is not None:
            on_pause(False)
    return time.perf_counter() - began


def file_flag(run_dir: str | Path) -> Callable[[], bool]:
    """should_pause for a headless run: true while <run>/PAUSE exists."""
    flag = Path(run_dir) / PAUSE_FILE
    return flag.exists
