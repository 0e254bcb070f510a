"""A full fine-tune over two gloo ranks (issue 46 item 5): sharding shard puts every block and the root under
FSDP2, so weights, gradients, optimizer state and EMA are sharded; the run equals one process with the doubled
batch, each rank holds half of them, a checkpoint is one process's layout, resume is exact on two ranks and
refused on one with the command. sharding replicate (DDP over the whole model) trains the same."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.distributed import free_port
from helpers.resume import assert_bitwise_resume

from trainer import safetensors_io
from trainer.backends.torch_backend import full
from trainer.backends.torch_backend.backend import TorchBackend
from trainer.run import distributed, state
from trainer.run.loop import train

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or sys.platform == "win32",
    reason="needs torch.distributed with gloo and fork (Linux, macOS)",
)

FULL = {
    "adapter": "full",
    "steps": 4,
    "batch_size": 2,
    "grad_accum": 2,
    "ema": True,
    "ema_decay": 0.9,
    "caption_dropout": 0.3,
    "gradient_checkpointing": True,
    "checkpoint_every": 2,
    "learning_rate": 1e-3,
    "max_grad_norm": 0.5,
}


def _bytes(tensors) -> tuple[int, int]:
    """(this rank's bytes of `tensors`, their whole bytes): a DTensor counts its shard."""
    held = sum(full.local(t).numel() * t.element_size() for t in tensors)
    return held, sum(t.numel() * t.element_size() for t in tensors)


def _held(backend) -> dict[str, np.ndarray]:
    """What this rank held at the end of the run: weights, optimizer moments, EMA shadow (local, whole bytes)."""
    moments = [v for entries in backend.optimizer.state.values() for v in entries.values() if torch.is_tensor(v)]
    moments = [v for v in moments if v.ndim]  # not the step counts
    return {
        "held.weights": np.asarray(_bytes(list(backend.params.values()))),
        "held.optim": np.asarray(_bytes(moments)),
        "held.ema": np.asarray(_bytes(list(backend.ema.state().values()))),
    }


def _rank(rank: int, world: int, port: int, out: str, settings: dict, runs: list, tiny: tuple) -> None:
    """One rank: join the gloo group, run each of `runs` ((name, resume, stop_at {rank: step})), write what it
    ended with: the model (rank 0: the file's tensors), the loss, what it held."""
    tiny_model, tiny_data, tiny_config = tiny
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    held: dict = {}
    real_teardown = TorchBackend.teardown
    TorchBackend.teardown = lambda self: (held.update(_held(self)) if self.optimizer else None, real_teardown(self))
    try:
        tensors = {}
        for number, (name, resume, stop_at) in enumerate(runs):
            progress: list = []
            stop = functools.partial(lambda p, n: n is not None and len(p) >= n, progress, (stop_at or {}).get(rank))
            run_dir = Path(out) / name
            result = train(
                tiny_config(**settings),
                tiny_model(),
                tiny_data(),
                run_dir=run_dir,
                resume=run_dir if resume else None,
                on_step=progress.append,
                should_stop=stop,
            )
            tensors[f"ended.{number}"] = np.asarray([result.step, result.stopped], np.int64)
        tensors.update({f"model.{k}": v for k, v in result.model.items()})
        tensors["loss"] = np.asarray(result.history.loss, np.float64)
        tensors.update(held)
        safetensors_io.write(Path(out) / f"rank{rank}.safetensors", tensors)
    finally:
        TorchBackend.teardown = real_teardown
        distributed.stop()


def two_ranks(tmp_path, settings: dict, runs: list, tiny: tuple) -> list[dict[str, np.ndarray]]:
    torch.multiprocessing.start_processes(
        _rank, args=(2, free_port(), str(tmp_path), settings, runs, tiny), nprocs=2, start_method="fork"
    )
    return [safetensors_io.read(tmp_path / f"rank{r}.safetensors")[0] for r in range(2)]


def _checkpoint(run_dir: Path) -> dict[str, np.ndarray]:
    return safetensors_io.read(state.list_checkpoints(run_dir)[-1][1] / "state.safetensors")[0]


@pytest.mark.parametrize("sharding", ["shard", "replicate"])
def test_two_ranks_train_the_model_one_process_with_the_doubled_batch_trains(
    tmp_path, make_model, make_data, make_config, sharding
):
    settings = {**FULL, "sharding": sharding}
    ranks = two_ranks(tmp_path, settings, [("two", False, None)], (make_model, make_data, make_config))
    single = train(make_config(**{**settings, "batch_size": 4}), make_model(), make_data(), run_dir=tmp_path / "one")
    np.testing.assert_allclose(ranks[0]["loss"], np.asarray(single.history.loss), rtol=1e-5, atol=1e-6)
    assert {f"model.{k}" for k in single.model} == {k for k in ranks[0] if k.startswith("model.")}
    for name, value in single.model.items():  # the EMA weights, gathered whole on rank 0 as the file holds them
        np.testing.assert_allclose(ranks[0][f"model.{name}"], value, rtol=1e-5, atol=1e-6, err_msg=name)
    # the checkpoint: one process's layout (weights, EMA, moments whole), the same values
    two, one = _checkpoint(tmp_path / "two"), _checkpoint(tmp_path / "one")
    trained = [k for k in one if k.startswith(("full.", "ema.", "optim."))]
    assert trained and {k: one[k].shape for k in trained} == {k: two[k].shape for k in trained}
    for key in trained:  # AdamW moves a weight by up to lr a step whatever its gradient's size: 1% of lr apart at most
        np.testing.assert_allclose(two[key], one[key], rtol=1e-5, atol=1e-5, err_msg=key)
    for rank in ranks:
        for what in ("weights", "optim", "ema"):
            held, whole = rank[f"held.{what}"]
            # shard: about half (a weight of odd rows splits unevenly); replicate: everything on each rank
            assert (0.4 * whole <= held <= 0.6 * whole) if sharding == "shard" else held == whole, (what, held, whole)
    if sharding == "shard":  # the model file is rank 0's to write: the others gather nothing onto the host
        assert not any(k.startswith("model.") for k in ranks[1])


def test_a_sharded_full_run_resumes_exactly_on_two_and_is_refused_on_one(tmp_path, make_model, make_data, make_config):
    settings = {**FULL, "steps": 6, "sharding": "shard"}
    tiny = (make_model, make_data, make_config)
    straight = two_ranks(tmp_path / "a", settings, [("run", False, None)], tiny)
    resumed = two_ranks(tmp_path / "b", settings, [("run", False, {0: 2}), ("run", True, None)], tiny)
    assert [list(r["ended.0"]) for r in resumed] == [[3, 1], [3, 1]]  # the vote stopped both after step 3
    assert [list(r["ended.1"]) for r in resumed] == [[6, 0], [6, 0]]
    last = [state.list_checkpoints(tmp_path / run / "run")[-1][1] for run in ("a", "b")]
    assert_bitwise_resume(*last, holds=("full.", "ema.", "optim.", "rng.rank1."))
    assert np.array_equal(straight[0]["loss"], resumed[0]["loss"])
    for key in (k for k in straight[0] if k.startswith("model.")):
        assert np.array_equal(straight[0][key], resumed[0][key]), key
    with pytest.raises(
        ValueError, match=r"trained on 2 process\(es\) and is resumed on 1.*torchrun --nproc_per_node 2"
    ):
        train(make_config(**settings), make_model(), make_data(), run_dir=tmp_path / "c", resume=tmp_path / "b" / "run")


def _rounding_rank(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    torch.set_num_threads(1)  # a forked child of a parent whose thread pool ran can hang in its first parallel op
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8192, bias=False)).to(torch.bfloat16)
        with torch.no_grad():
            model[0].weight.fill_(1.0)
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model, mesh=mesh)
        weight = model[0].weight
        optimizer = torch.optim.SGD([weight], lr=1.0)
        full.round_bf16_updates(optimizer, [weight])
        weight.grad = distribute_tensor(torch.full((8192, 8), 5e-4, dtype=torch.bfloat16), mesh, weight.placements)
        torch.manual_seed(rank)
        optimizer.step()
        assert optimizer.param_groups[0]["params"][0] is weight and weight.grad.dtype == torch.bfloat16
        shard = weight.detach().to_local().float().numpy()
        safetensors_io.write(Path(out) / f"rank{rank}.safetensors", {"shard": shard})
    finally:
        distributed.stop()


def test_sharded_bf16_weights_take_updates_stochastically_rounded(tmp_path):
    """FSDP2's DTensor parameters: the update below bf16's resolution still moves each rank's shard on average."""
    torch.multiprocessing.start_processes(
        _rounding_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="fork"
    )
    for rank in range(2):
        shard = safetensors_io.read(tmp_path / f"rank{rank}.safetensors")[0]["shard"]
        assert shard.shape == (4096, 8) and set(np.unique(shard).tolist()) == {1 - 2**-8, 1.0}
        assert abs(float(shard.mean()) - (1 - 5e-4)) < 1e-4


def _chunked_rank(rank: int, world: int, port: int, out: str) -> None:
    """Each rank trains two copies of a few bf16 weights sharded by FSDP2 with AdamW, one stepped whole and one a
    small chunk at a time (the masters swapped in chunk by chunk); writes its shards of both."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from trainer.estimate import full_step

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh, shards = init_device_mesh("cpu", (world,)), {}
        for name, chunk in (("whole", None), ("chunked", 600)):
            full_step.STEP_CHUNK_WEIGHTS = chunk or full_step.STEP_CHUNK_WEIGHTS
            torch.manual_seed(0)
            model = torch.nn.Sequential(*(torch.nn.Linear(16, 32, bias=True) for _ in range(3))).to(torch.bfloat16)
            fully_shard(model, mesh=mesh)
            weights = list(model.parameters())
            optimizer, held = torch.optim.AdamW(weights, lr=1e-2), []
            start = [w.detach().to_local().float().numpy().copy() for w in weights]
            step = optimizer.step
            optimizer.step = lambda: (held.append(sum(len(g["params"]) for g in optimizer.param_groups)), step())
            full.round_bf16_updates(optimizer, weights, "adamw" if chunk else None)
            generator = torch.Generator().manual_seed(1)
            torch.manual_seed(2 + rank)
            for _ in range(3):
                for w in weights:
                    grad = torch.randn(w.shape, generator=generator).bfloat16()
                    w.grad = distribute_tensor(grad, mesh, w.placements)
                optimizer.step()
            shards.update({f"{name}.{i}": w.detach().to_local().float().numpy() for i, w in enumerate(weights)})
            shards[f"{name}.held"] = np.array(max(held), np.float32)  # the most parameters one optimizer call saw
            shards[f"{name}.moved"] = np.array(
                all(not np.array_equal(a, w.detach().to_local().float().numpy()) for a, w in zip(start, weights)),
                np.float32,
            )
        safetensors_io.write(Path(out) / f"rank{rank}.safetensors", shards)
    finally:
        distributed.stop()


def test_sharded_bf16_weights_step_a_chunk_at_a_time_and_end_the_same(tmp_path):
    """FSDP2's DTensor parameters stepped a chunk at a time (fp32 masters swapped in per chunk) end where the
    all-at-once step ends, bit for bit, on every rank."""
    torch.multiprocessing.start_processes(
        _chunked_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="fork"
    )
    for rank in range(2):
        shards = safetensors_io.read(tmp_path / f"rank{rank}.safetensors")[0]
        whole = {k[6:]: v for k, v in shards.items() if k.startswith("whole.")}
        assert float(whole.pop("held")) == 6 and float(shards["chunked.held"]) < 6  # chunks: fewer at once
        assert float(whole.pop("moved")) == 1 and float(shards["chunked.moved"]) == 1
        assert len(whole) == 6
        for key, value in whole.items():
            np.testing.assert_array_equal(value, shards[f"chunked.{key}"], err_msg=f"rank {rank} weight {key}")
