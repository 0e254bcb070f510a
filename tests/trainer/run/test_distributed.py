"""Several processes (#22): two gloo ranks on the CPU over the tiny DiT.

In-process tests fork two ranks (torch.multiprocessing, fork: no interpreter start-up) that run
trainer.run.loop.train as torchrun's ranks would; one test runs the real `torchrun -m trainer train` command.
What is held: two ranks with batch b train the LoRA one process with batch 2b trains (float tolerance),
rank 0 alone writes, every rank ends with the same weights, optimizer and EMA, a 2-rank run resumes
bitwise on 2 ranks and is refused on 1, and a killed rank ends the run with a resumable checkpoint.
"""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer import safetensors_io
from trainer.archs import get_arch
from trainer.backends.torch_backend import sharding
from trainer.backends.torch_backend.checkpointing import find_blocks
from trainer.run import checkpoint_writer, distributed, state
from trainer.run.loop import build_batch, objective_settings, train

from helpers.distributed import free_port
from helpers.resume import assert_bitwise_resume

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or sys.platform == "win32",
    reason="needs torch.distributed with gloo and fork (Linux, macOS)",
)


# ---------------------------------------------------------------- shares of a global batch


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shares_cover_the_global_batch_once_and_scale_to_its_mean(count, world):
    shares = [distributed.Group(rank, world).rows(count) for rank in range(world)]
    real = [rows for rows, scale in shares if scale > 0]
    assert sorted(row for rows in real for row in rows) == list(range(count))
    # mean over the ranks of (mean over a share of scale·x) = mean over the global batch of x
    x = np.arange(1.0, count + 1.0)
    assert np.isclose(np.mean([np.mean(x[rows] * scale) for rows, scale in shares]), x.mean())
    assert all(rows == [0] for rows, scale in shares if scale == 0)  # an empty share trains row 0 at weight 0


def test_each_rank_builds_its_rows_of_the_one_global_batch(make_data, make_config):
    data, arch = make_data(count=8, shapes=((4, 4),)), get_arch("demo")
    settings = objective_settings(make_config(), arch)
    whole = build_batch(data, [0, 1, 2, 3, 4], np.random.default_rng(3), settings, arch, 0.5)
    parts = [
        build_batch(data, [0, 1, 2, 3, 4], np.random.default_rng(3), settings, arch, 0.5, distributed.Group(rank, 2))
        for rank in range(2)
    ]
    for field in ("latents", "noise", "sigmas", "context"):
        assert np.array_equal(np.concatenate([getattr(p, field) for p in parts]), getattr(whole, field)), field
    # rows 0-1 and 2-4: weights scaled by share·world/count, so DDP's mean of the ranks' means is the batch mean
    assert np.allclose(parts[0].weights, whole.weights[:2] * 2 * 2 / 5)
    assert np.allclose(parts[1].weights, whole.weights[2:] * 3 * 2 / 5)
    assert parts[0].items == parts[1].items == whole.items  # every rank names the whole batch


def test_torchrun_with_mlx_or_mps_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="backend 'mlx' trains in one process"):
        distributed.start("auto", "mlx")
    with pytest.raises(ValueError, match="device 'mps' runs one process"):
        distributed.start("mps", "torch")


# ---------------------------------------------------------------- two forked gloo ranks


def flat_state(result, backend_state: dict) -> dict[str, np.ndarray]:
    out = {f"lora.{path}.{k}": getattr(w, k) for path, w in result.lora.items() for k in ("A", "B")}
    out.update(backend_state)
    out["loss"] = np.asarray(result.history.loss, np.float64)
    return out


def _rank(rank: int, world: int, port: int, out: str, settings: dict, runs: list, tiny: tuple) -> None:
    """One rank: join the gloo group, run each of `runs` ((name, resume, stop_at)), write what it ended with.
    stop_at: the step after which should_stop turns true, or {rank: step} for a stop asked on some ranks only."""
    tiny_model, tiny_data, tiny_config = tiny
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    writes = []
    real_save = checkpoint_writer.save_checkpoint
    checkpoint_writer.save_checkpoint = lambda *a, **k: writes.append(k["cursor"]) or real_save(*a, **k)
    try:
        cfg = tiny_config(**settings)
        ended = {}
        for number, (name, resume, stop_at) in enumerate(runs):
            run_dir = Path(out) / name
            progress: list = []
            stop_at = stop_at.get(rank) if isinstance(stop_at, dict) else stop_at
            stop = functools.partial(_reached, progress, stop_at) if stop_at else None
            model = tiny_model()
            blocks = find_blocks(model, get_arch(cfg.arch).block_lists)
            originals = [weakref.ref(p) for block in blocks for p in block.parameters()]
            alive = []  # the block weights the model came with still alive during the run (gc'd first)

            def on_step(report, progress=progress, originals=originals, alive=alive):
                progress.append(report)
                gc.collect()
                alive.append(sum(ref() is not None for ref in originals))

            result = train(
                cfg,
                model,
                tiny_data(),
                run_dir=run_dir,
                resume=run_dir if resume else None,
                on_step=on_step,
                should_stop=stop,
            )
            tensors_alive = np.asarray([max(alive, default=0), len(originals)], np.int64)
            ended[f"ended.{number}"] = np.asarray([result.step, result.stopped], np.int64)
        tensors = {f"written.{i}": np.asarray([c["epoch"], c["position"]]) for i, c in enumerate(writes)}
        tensors.update(ended)
        # the blocks' weight bytes this rank held at the end, and the whole blocks' (a sharded base stays sharded)
        tensors["held"] = np.asarray(sharding.local_bytes(blocks))
        tensors["held.alive"] = tensors_alive
        tensors["held.on_host"] = np.asarray(sum(_on_host(block) for block in blocks), np.int64)
        tensors.update(flat_state(result, _ema_and_moments(result)))
        safetensors_io.write(Path(out) / f"rank{rank}.safetensors", tensors)
    finally:
        checkpoint_writer.save_checkpoint = real_save
        distributed.stop()


def _on_host(block) -> int:
    """1 where `block` is an FSDP2 unit whose shards live on the host (CPU offload), else 0 (FSDP2's own state)."""
    group = getattr(block, "_get_fsdp_state", lambda: None)()
    group = getattr(group, "_fsdp_param_group", None)
    return int(group is not None and all(p.offload_to_cpu for p in group.fsdp_params))


def _reached(progress: list, steps: int) -> bool:
    return len(progress) >= steps


def _ema_and_moments(result) -> dict[str, np.ndarray]:
    """The newest checkpoint's EMA and optimizer tensors, or none where this rank reads none."""
    if result.checkpoint is None or not (result.checkpoint / "state.safetensors").is_file():
        return {}
    tensors, _ = safetensors_io.read(result.checkpoint / "state.safetensors")
    return {k: v for k, v in tensors.items() if k.startswith(("ema.", "optim."))}


def two_ranks(tmp_path, settings: dict, runs: list, tiny: tuple) -> list[dict[str, np.ndarray]]:
    """Two forked ranks (fork: the arguments are not pickled, and no interpreter starts); their end states."""
    torch.multiprocessing.start_processes(
        _rank, args=(2, free_port(), str(tmp_path), settings, runs, tiny), nprocs=2, start_method="fork"
    )
    return [safetensors_io.read(tmp_path / f"rank{r}.safetensors")[0] for r in range(2)]


# grad_accum 2 (no_sync on the first micro-batch), checkpointing, EMA, caption dropout, two buckets of
# 3 items: a global batch of 4 is cut into 3-item batches, shared 1 + 2 (unequal shares, scaled).
EQUAL = {
    "steps": 4,
    "batch_size": 2,
    "grad_accum": 2,
    "ema": True,
    "ema_decay": 0.9,
    "caption_dropout": 0.3,
    "gradient_checkpointing": True,
    "checkpoint_every": 2,
    "log_every": 1,
    "max_grad_norm": 0.5,
}


@pytest.mark.parametrize(
    ("compiled", "sharded"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["eager", "compiled", "eager-sharded", "compiled-sharded"],
)
def test_two_ranks_train_what_one_process_with_the_doubled_batch_trains(
    tmp_path, make_model, make_data, make_config, monkeypatch, compiled, sharded
):
    """Compiled: blocks under torch.compile ("aot_eager": the same graphs, no C++ build), whose backward gives
    DDP's hooks ordinary leaf gradients; one bucket of 8 there, so each process compiles one shape.
    Sharded: sharding shard, each block of the base an FSDP2 unit over the two ranks (gloo's all-gathers),
    each rank holding half the blocks' bytes; the same LoRA as one process with the doubled batch."""
    from trainer.backends.torch_backend import checkpointing

    monkeypatch.setattr(checkpointing, "COMPILE_BACKEND", "aot_eager")
    settings = {**EQUAL, "compile_blocks": compiled, **({"steps": 2} if compiled else {})}
    settings["sharding"] = "shard" if sharded else "replicate"
    data = functools.partial(make_data, count=8, shapes=((4, 4),)) if compiled else make_data
    ranks = two_ranks(tmp_path, settings, [("two", False, None)], (make_model, data, make_config))
    single = train(make_config(**{**settings, "batch_size": 4}), make_model(), data(), run_dir=tmp_path / "one")
    one = flat_state(single, {})
    for key, value in one.items():
        np.testing.assert_allclose(ranks[0][key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    for held, whole in (r["held"] for r in ranks):
        assert held == (whole // 2 if sharded else whole), (held, whole)  # the tiny blocks' shapes split evenly
    # ... and the whole weights are gone: a list of the originals (teardown's requires_grad record) once kept the
    # whole base on every rank beside its shards (Qwen-Image on two 24 GB caps, 2026-11-29)
    for alive, count in (r["held.alive"] for r in ranks):
        assert alive == (0 if sharded else count), (alive, count)
    # Every rank ends with the same LoRA, EMA and optimizer state (all-reduced gradients, same updates).
    assert set(ranks[0]) - {k for k in ranks[0] if k.startswith("written.")} == set(ranks[1]) - {
        k for k in ranks[1] if k.startswith("written.")
    }
    for key in ranks[0]:
        if not key.startswith(("written.", "ended.", "held")):
            assert np.array_equal(ranks[0][key], ranks[1][key]), key
    assert any(k.startswith("ema.") for k in ranks[0])
    # Rank 0 alone wrote the checkpoints (every 2 steps); rank 1 called no writer.
    steps = list(range(2, settings["steps"] + 1, 2))
    assert sum(k.startswith("written.") for k in ranks[0]) == len(steps)
    assert not any(k.startswith("written.") for k in ranks[1])
    assert [s for s, _ in state.list_checkpoints(tmp_path / "two")] == steps


def test_two_ranks_with_blocks_shards_on_the_host_train_what_one_process_trains(
    tmp_path, make_model, make_data, make_config, monkeypatch
):
    """A sharded base whose plan keeps some blocks' shards on the host (memory_plan.split, chosen here: off CUDA
    the plan knows no free memory): those blocks are FSDP2 units with its CPU offload, gathered from the host for
    each forward and recompute; the LoRA is one process's with the doubled batch, each rank holds half the bytes."""
    from dataclasses import replace

    from trainer.backends.torch_backend import memory_plan

    monkeypatch.setattr(
        memory_plan, "split", lambda model, cfg, plan, ranks, note: replace(plan, shards=ranks).with_stream(2, note)
    )
    settings = {**EQUAL, "sharding": "shard"}
    ranks = two_ranks(tmp_path, settings, [("two", False, None)], (make_model, make_data, make_config))
    single = train(make_config(**{**settings, "batch_size": 4}), make_model(), make_data(), run_dir=tmp_path / "one")
    for key, value in flat_state(single, {}).items():
        np.testing.assert_allclose(ranks[0][key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    for rank in ranks:
        held, whole = rank["held"]
        assert held == whole // 2 and rank["held.alive"][0] == 0
        assert rank["held.on_host"] == 2  # the two chosen blocks' units offload their shards


RESUME = {**EQUAL, "steps": 6, "lora_dropout": 0.2}  # LoRA dropout: each rank's own torch RNG stream


@pytest.mark.parametrize("sharding", ["replicate", "shard"])
def test_two_ranks_resume_bitwise_on_two_and_are_refused_on_one(tmp_path, make_model, make_data, make_config, sharding):
    """The stop is asked on rank 0 only (as a stop file seen by one rank before the other): the ranks' vote
    stops both after the same step, one step after the request, with that step's checkpoint. Sharded the same."""
    tiny, settings = (make_model, make_data, make_config), {**RESUME, "sharding": sharding}
    straight = two_ranks(tmp_path / "a", settings, [("run", False, None)], tiny)
    resumed = two_ranks(tmp_path / "b", settings, [("run", False, {0: 2}), ("run", True, None)], tiny)
    assert [list(r["ended.0"]) for r in resumed] == [[3, 1], [3, 1]]  # both stopped after step 3
    assert [list(r["ended.1"]) for r in resumed] == [[6, 0], [6, 0]]
    # step 3's checkpoint is the stop's (checkpoint_every 2 writes 2, 4, 6), and the resume started from it
    assert [s for s, _ in state.list_checkpoints(tmp_path / "b" / "run")] == [3, 4, 6]
    last = [state.list_checkpoints(tmp_path / run / "run")[-1][1] for run in ("a", "b")]
    assert_bitwise_resume(*last, holds=("rng.rank1.",))
    assert np.array_equal(straight[0]["loss"], resumed[0]["loss"])
    with pytest.raises(
        ValueError, match=r"trained on 2 process\(es\) and is resumed on 1.*torchrun --nproc_per_node 2"
    ):
        train(make_config(**RESUME), make_model(), make_data(), run_dir=tmp_path / "c", resume=tmp_path / "b" / "run")


# ---------------------------------------------------------------- the real command: torchrun


def torchrun(config: Path, *, resume: bool = False, fault: str | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 -m trainer train CONFIG` (torch.distributed.run is torchrun's module)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("KILN_FAULT", None)
    if fault:
        env["KILN_FAULT"] = fault
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "-m",
        "trainer",
        "train",
        str(config),
        *(["--resume"] if resume else []),
    ]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_torchrun_a_killed_rank_ends_the_run_and_it_resumes_where_it_stopped(tmp_path):
    from trainer.demo.run import make_dataset

    make_dataset(tmp_path / "shapes")
    config = tmp_path / "run.toml"
    config.write_text(
        f'arch = "demo"\ndevice = "cpu"\nmixed_precision = "no"\nsteps = 5\nbatch_size = 1\n'
        f"rank = 4\nalpha = 4.0\nresolutions = [64]\ncheckpoint_every = 2\nlog_every = 1\n"
        f"lora_dropout = 0.1\ncaption_dropout = 0.2\nema = true\n"
        f'dataset_dir = "{tmp_path / "shapes"}"\noutput_dir = "{tmp_path / "runs"}"\nrun_name = "r"\n'
    )
    run_dir = tmp_path / "runs" / "r"
    killed = torchrun(config, fault="rank1:step:3")  # rank 1 SIGKILLed after its 3rd step
    assert killed.returncode != 0, killed.stdout + killed.stderr
    assert [s for s, _ in state.list_checkpoints(run_dir)] == [2], killed.stderr[-3000:]
    assert not (run_dir / "r.safetensors").exists()
    resumed = torchrun(config, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "finished at step 5/5" in resumed.stdout and resumed.stdout.count("finished at step") == 1  # rank 0 speaks
    assert (run_dir / "r.safetensors").is_file() and [s for s, _ in state.list_checkpoints(run_dir)] == [2, 4, 5]
    checkpoint = state.load_checkpoint(run_dir)
    assert checkpoint.info["world_size"] == 2 and len(checkpoint.info["history"]["loss"]) == 5
    # The same command never stopped (two forked ranks, as torchrun starts them) ends bitwise equal.
    config.write_text(config.read_text().replace('run_name = "r"', 'run_name = "straight"'))
    torch.multiprocessing.start_processes(
        _command_rank, args=(2, free_port(), str(config)), nprocs=2, start_method="fork"
    )
    straight = state.load_checkpoint(tmp_path / "runs" / "straight")
    assert straight.step == 5 and set(straight.tensors) == set(checkpoint.tensors)
    for key, value in straight.tensors.items():
        assert np.array_equal(value, checkpoint.tensors[key]), key


def _command_rank(rank: int, world: int, port: int, config: str) -> None:
    """`python -m trainer train CONFIG` as rank `rank` of a torchrun job (its environment variables)."""
    from trainer.cli.main import main

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    try:
        assert main(["train", config]) == 0
    finally:
        distributed.stop()


def _vote_rank(rank: int, world: int, port: int, out: str) -> None:
    """Three votes with this rank's peak memory (100·(rank+1) bytes, then 10 more each step); what it read."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        distributed.start("cpu")
        peaks = iter(range(100 * (rank + 1), 1000, 10))
        vote = distributed.StopVote(lambda: next(peaks))
        read = []
        for step in range(3):
            stop = vote(rank == 1 and step == 0)  # rank 1 asks to stop at the first vote
            read.append([int(stop), *vote.peaks])
        stop, _ = vote.agree(False, False)  # a synchronous vote reads them too, and the stop still in flight
        read.append([int(stop), *vote.peaks])
        vote.close()
        np.save(Path(out) / f"vote{rank}.npy", np.asarray([r + [0] * (3 - len(r)) for r in read]))
    finally:
        distributed.stop()


def test_the_stop_vote_carries_every_ranks_peak_memory_a_step_late(tmp_path):
    torch.multiprocessing.start_processes(
        _vote_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="fork"
    )
    for rank in range(2):
        # [stop, peak of rank 0, peak of rank 1]: the first vote answers nothing yet; each later one the previous
        # vote's peaks and stop (rank 1's stop at the first vote, agreed by both at the second)
        assert np.load(tmp_path / f"vote{rank}.npy").tolist() == [
            [0, 0, 0],
            [1, 100, 200],
            [0, 110, 210],
            [0, 130, 230],
        ]
