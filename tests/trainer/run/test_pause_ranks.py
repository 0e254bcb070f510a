"""Pause under torchrun (#21 item 6): two forked gloo ranks on the CPU over the tiny DiT.

Each rank reads <run>/PAUSE by itself; the pause is agreed as the stop is (distributed.StopVote), so both
ranks pause after the same step, poll together in short agreed rounds and resume together. What is held:
the paused run ends bitwise equal to an unpaused one, a stop asked on one rank while paused ends both with
a checkpoint of the paused step, and the one-process vote answers at once.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.distributed import free_port

from trainer import safetensors_io
from trainer.run import distributed, pause, state
from trainer.run.loop import train

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or sys.platform == "win32",
    reason="needs torch.distributed with gloo and fork (Linux, macOS)",
)

SETTINGS = {
    "steps": 6,
    "batch_size": 1,
    "lora_dropout": 0.2,
    "caption_dropout": 0.3,
    "log_every": 1,
    "checkpoint_every": 3,
}
WRITE_AT = 2  # rank 0 writes <run>/PAUSE as it reports this step; its vote pauses every rank after the next
POLLS = 4  # agreed rounds spent paused before the file goes (or, in the stop run, rank 1 asks to stop)


class Scripted:
    """One rank's view of a run: its steps, where it paused and resumed, and a PAUSE file that rank 0 writes
    mid-run and removes (or, `stop_on` rank, a stop it asks for) after a few rounds of the pause."""

    def __init__(self, rank: int, run_dir: Path, stop_on: int | None):
        self.rank, self.flag, self.stop_on = rank, run_dir / pause.PAUSE_FILE, stop_on
        self.steps: list[int] = []
        self.events: list[tuple[bool, int]] = []  # (paused, steps done) from on_pause
        self.polls = 0

    def on_step(self, report) -> None:
        self.steps.append(report.step)
        if self.rank == 0 and report.step == WRITE_AT:
            self.flag.touch()

    def on_pause(self, paused: bool) -> None:
        self.events.append((paused, len(self.steps)))

    def should_pause(self) -> bool:
        if self.events and self.events[-1][0]:  # paused: count this rank's rounds
            self.polls += 1
            if self.rank == 0 and self.stop_on is None and self.polls >= POLLS:
                self.flag.unlink(missing_ok=True)
        return self.flag.exists()

    def should_stop(self) -> bool:
        return self.rank == self.stop_on and self.polls >= POLLS


def _rank(rank: int, world: int, port: int, out: str, tiny: tuple) -> None:
    """One rank: a run paused and resumed, the same run never paused, and a run stopped while paused."""
    tiny_model, tiny_data, tiny_config = tiny
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    tensors = {}
    try:
        cfg = tiny_config(**SETTINGS)
        for name, stop_on, pausing in (("paused", None, True), ("straight", None, False), ("stopped", 1, True)):
            run_dir = Path(out) / name
            run_dir.mkdir(parents=True, exist_ok=True)
            script = Scripted(rank, run_dir, stop_on)
            result = train(
                cfg,
                tiny_model(),
                tiny_data(),
                run_dir=run_dir,
                on_step=script.on_step,
                should_pause=script.should_pause if pausing else None,
                should_stop=script.should_stop,
                on_pause=script.on_pause,
            )
            distributed.barrier()  # rank 0's PAUSE of this run is gone before the next starts
            (run_dir / pause.PAUSE_FILE).unlink(missing_ok=True)
            tensors[f"{name}.steps"] = np.asarray(script.steps, np.int64)
            tensors[f"{name}.events"] = np.asarray(script.events, np.int64).reshape(-1, 2)
            tensors[f"{name}.ended"] = np.asarray([result.step, result.stopped], np.int64)
            for path, weights in result.lora.items():
                tensors[f"{name}.lora.{path}.A"], tensors[f"{name}.lora.{path}.B"] = weights.A, weights.B
        safetensors_io.write(Path(out) / f"rank{rank}.safetensors", tensors)
    finally:
        distributed.stop()


def test_a_pause_file_pauses_both_ranks_after_the_same_step_resumes_bitwise_and_a_stop_ends_it(
    tmp_path, make_model, make_data, make_config
):
    torch.multiprocessing.start_processes(
        _rank, args=(2, free_port(), str(tmp_path), (make_model, make_data, make_config)), nprocs=2, start_method="fork"
    )
    ranks = [safetensors_io.read(tmp_path / f"rank{r}.safetensors")[0] for r in range(2)]
    for seen in ranks:
        # Paused once, after step WRITE_AT + 1 (rank 0's flag at step 2, agreed one step late), no step while
        # paused, then on to the end.
        assert seen["paused.events"].tolist() == [[1, WRITE_AT + 1], [0, WRITE_AT + 1]]
        assert seen["paused.steps"].tolist() == list(range(1, 7)) and seen["paused.ended"].tolist() == [6, 0]
        assert seen["straight.events"].size == 0 and seen["straight.steps"].tolist() == list(range(1, 7))
        # A stop asked on rank 1 alone while paused: both ranks leave the pause and stop at the paused step.
        assert seen["stopped.events"].tolist() == [[1, WRITE_AT + 1], [0, WRITE_AT + 1]]
        assert seen["stopped.ended"].tolist() == [WRITE_AT + 1, 1]
    # The paused run's LoRA is the unpaused run's, bit for bit, on both ranks.
    loras = [key for key in ranks[0] if key.startswith("paused.lora.")]
    assert loras
    for seen in ranks:
        for key in loras:
            assert np.array_equal(seen[key], seen[key.replace("paused.", "straight.", 1)]), key
            assert np.array_equal(seen[key], ranks[0][key]), key
    # The stopped run saved the paused step's checkpoint (every rank's RNG in it) and can resume from it.
    assert [s for s, _ in state.list_checkpoints(tmp_path / "stopped")] == [WRITE_AT + 1]
    assert state.load_checkpoint(tmp_path / "stopped").info["world_size"] == 2
    assert not (tmp_path / "paused" / pause.PAUSE_FILE).exists()


def test_one_process_votes_answer_at_once():
    vote = distributed.StopVote()
    assert vote(False, True) is False and vote.paused
    assert vote(True) is True and not vote.paused
    assert vote.agree(False, True) == (False, True)


def test_between_steps_in_one_process_is_the_plain_wait_then_the_stop(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(pause.time, "sleep", sleeps.append)
    answers, events = iter([True, True, False]), []
    waited, stop = pause.between_steps(distributed.StopVote(), lambda: next(answers), lambda: False, events.append)
    assert waited >= 0.0 and not stop and len(sleeps) == 1 and events == [True, False]
    assert pause.between_steps(distributed.StopVote(), None, lambda: True) == (0.0, True)
