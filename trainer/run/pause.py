"""Pause: the loop waits between steps while a front end asks it to (the dashboard's Pause, a PAUSE file).

Nothing is freed while paused (the model, the LoRA and the optimizer stay where they are, GPU memory
included), so Resume continues at once; a stop asked for while paused ends the wait, and the loop then
stops as it always does (a resumable checkpoint). The time spent waiting is left out of speed and ETA.

Under torchrun each rank reads its own flag (every rank sees <run>/PAUSE), so the pause is agreed as the
stop is (distributed.StopVote, one step late): every rank pauses after the same step, then the ranks poll
together in short synchronous votes (each within a poll, never near the host group's timeout) and resume,
or stop, after the same round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from . import distributed

POLL_S = 0.1  # how often a paused loop asks again
PAUSE_FILE = "PAUSE"  # headless: while <run>/PAUSE exists the run waits (touch it to pause, delete it to resume)


def wait(
    should_pause: Callable[[], bool] | None,
    should_stop: Callable[[], bool] | None = None,
    poll_s: float = POLL_S,
    on_pause: Callable[[bool], None] | None = None,
) -> float:
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


def _asked(flag: Callable[[], bool] | None) -> bool:
    return flag is not None and bool(flag())


def between_steps(
    vote: distributed.StopVote,
    should_pause: Callable[[], bool] | None,
    should_stop: Callable[[], bool] | None,
    on_pause: Callable[[bool], None] | None = None,
    poll_s: float = POLL_S,
) -> tuple[float, bool]:
    """(seconds paused, whether to stop now) at a step boundary, as every rank agrees. One process: wait()
    while should_pause(), then the stop flag (the plain run, bit for bit)."""
    if distributed.current().world == 1:
        waited = wait(should_pause, should_stop, poll_s, on_pause)
        return waited, vote(_asked(should_stop))
    stop = vote(_asked(should_stop), _asked(should_pause))
    if stop or not vote.paused:
        return 0.0, stop
    return _wait_together(vote, should_pause, should_stop, poll_s, on_pause)


def _wait_together(
    vote: distributed.StopVote, should_pause, should_stop, poll_s: float, on_pause
) -> tuple[float, bool]:
    """Every rank paused after the same step: rounds of agreed (stop, pause) until no rank asks to pause or
    one asks to stop; every rank gets the same answers, so they leave after the same round."""
    began = time.perf_counter()
    if on_pause is not None:
        on_pause(True)
    try:
        while True:
            stop, paused = vote.agree(_asked(should_stop), _asked(should_pause))
            if stop or not paused:
                return time.perf_counter() - began, stop
            time.sleep(poll_s)
    finally:
        if on_pause is not None:
            on_pause(False)


def file_flag(run_dir: str | Path) -> Callable[[], bool]:
    """should_pause for a headless run: true while <run>/PAUSE exists."""
    flag = Path(run_dir) / PAUSE_FILE
    return flag.exists
