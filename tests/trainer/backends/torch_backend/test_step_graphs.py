"""Step graphs (trainer/backends/torch_backend/step_graphs.py): each batch shape's forward and backward
recorded once and replayed. CI has no GPU, so a recorder that keeps the CUDA graph's contract stands in:
recording computes nothing that lasts (a capture runs no kernel), and a replay recomputes into the same
output tensor from the same static inputs. What is tested is Kiln's side of that contract: which call
records, what is copied in before a replay, gradients added into fixed tensors, the fallback on a capture
that fails, and the auto decision. bench/step_graphs_check.py runs the same on a real GPU."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from trainer import config as config_module
from trainer.archs import get_arch
from trainer.backends.torch_backend import levers
from trainer.backends.torch_backend import step_graphs as step_graphs_module
from trainer.backends.torch_backend.backend import TorchBackend
from trainer.backends.torch_backend.step_graphs import StepGraphs
from trainer.run.loop import train

from helpers.torch_batches import fixed_batch, split


class Replaying:
    """A CUDA graph's contract on the CPU: `record(fn)` leaves the gradients as they were (a capture runs no
    kernel) and returns a replay that runs fn again into the same output tensor, reading what fn closed over
    (the static inputs) at replay time."""

    def __init__(self, fail: BaseException | None = None):
        self.fail, self.recorded, self.replays, self.params = fail, 0, 0, []

    def bind(self, params):
        self.params = params
        return self

    def record(self, fn):
        if self.fail is not None:
            raise self.fail
        before = [None if p.grad is None else p.grad.clone() for p in self.params]
        rng = torch.get_rng_state()
        out = fn()
        torch.set_rng_state(rng)  # a capture draws no random numbers: the replays draw them
        for param, grad in zip(self.params, before):  # the capture computed nothing
            if grad is None:
                param.grad = None
            else:
                param.grad.copy_(grad)
        self.recorded += 1

        def replay():
            self.replays += 1
            out.copy_(fn())

        return replay, out


def use(monkeypatch, recorder: Replaying) -> Replaying:
    """Step graphs on (as auto decides on a CUDA GPU), recorded by `recorder`."""
    monkeypatch.setattr(levers, "step_graphs", lambda *args, **kwargs: (True, "step_graphs auto → on (test)"))
    monkeypatch.setattr(
        "trainer.backends.torch_backend.backend.StepGraphs",
        lambda params, device, model: StepGraphs(params, device, recorder.bind(params), model=model),
    )
    return recorder


def _lora(result_backend_state) -> dict[str, np.ndarray]:
    return {path: np.concatenate([w.A.ravel(), w.B.ravel()]) for path, w in result_backend_state.items()}


def _trained(make_model, make_config, make_data, tmp_path, name, **overrides):
    cfg = make_config(steps=8, batch_size=1, **overrides)
    result = train(cfg, make_model(), make_data(), run_dir=str(tmp_path / name))
    return list(result.history.loss), _lora(result.lora)


def signature(inputs):
    """As on a GPU: "meta" tensors stand for the device's, CPU tensors are host values."""
    return step_graphs_module.signature(inputs, torch.device("meta"))


def on_device(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_signature_is_the_shapes_and_the_host_values():
    def inputs(x=(2, 3), tokens=(5, 7), guidance=1.0, dtype=torch.float32, **more):
        return {"x": on_device(*x, dtype=dtype), "n": torch.tensor(tokens), "g": guidance, **more}

    assert signature(inputs()) == signature(inputs())  # device values do not count
    assert signature(inputs()) != signature(inputs(x=(2, 4)))  # shapes do
    assert signature(inputs()) != signature(inputs(dtype=torch.bfloat16))  # and dtypes
    assert signature(inputs()) != signature(inputs(tokens=(5, 8)))  # host numbers choose shapes
    assert signature(inputs()) != signature(inputs(guidance=2.0))
    assert signature(inputs(mask=None)) != signature(inputs(mask=on_device(2, 3)))
    assert signature(inputs(extra=[on_device(1)])) != signature(inputs(extra=[on_device(1), on_device(1)]))
    assert signature({"x": on_device(1), "odd": bytearray(b"a")}) is None  # an unhashable value: never recorded


def test_a_shape_runs_eagerly_once_then_is_recorded_then_replayed():
    weight = torch.nn.Parameter(torch.tensor([2.0]))
    recorder = Replaying().bind([weight])
    graphs = StepGraphs([weight], torch.device("cpu"), recorder)
    calls = []

    def step(inputs):
        calls.append(inputs["x"].shape)
        loss = (weight * inputs["x"]).sum()
        loss.backward()
        return loss.detach()

    # read at once: a replay writes its loss into the graph's one output tensor (the backend adds it up)
    losses = [float(graphs.run({"x": torch.full((3,), float(v))}, step)) for v in (1, 2, 3, 4)]
    assert losses == [6.0, 12.0, 18.0, 24.0]
    assert recorder.recorded == 1 and recorder.replays == 3  # eager; recorded, then replayed; replayed x2
    assert float(weight.grad) == 3 * (1 + 2 + 3 + 4)  # every call's gradient added once
    graphs.run({"x": torch.ones(2)}, step)  # another shape: eager first
    assert recorder.recorded == 1 and len(graphs.graphs) == 1


@pytest.mark.parametrize(
    "settings", [{}, {"lora_dropout": 0.2, "gradient_checkpointing": True}], ids=["plain", "dropout-recomputed"]
)
def test_training_with_step_graphs_equals_training_without(
    make_model, make_config, make_data, tmp_path, monkeypatch, settings
):
    """Two buckets alternating (tiny_data's 4x4 and 4x6), EMA and clipping on: the replayed steps train the
    LoRA the eager steps train, bit for bit on the CPU; with LoRA dropout the masks are the eager run's (a
    capture draws nothing, each replay draws its step's)."""
    settings = {"ema": True, "max_grad_norm": 0.5, **settings}
    plain = _trained(make_model, make_config, make_data, tmp_path, "plain", **settings)
    recorder = use(monkeypatch, Replaying())
    graphed = _trained(make_model, make_config, make_data, tmp_path, "graphed", **settings)
    assert recorder.recorded == 2 and recorder.replays >= 4  # both shapes recorded and replayed
    assert graphed[0] == plain[0]
    for path in plain[1]:
        np.testing.assert_array_equal(graphed[1][path], plain[1][path])


def test_auto_records_only_the_small_steps(make_model, make_config, make_data, tmp_path, monkeypatch):
    """auto: a step of more image pixels than GRAPH_MAX_PIXELS runs as before (its GPU work hides the host);
    `on` records every shape. tiny_data's buckets are 4x4 and 4x6 latents: 1,024 and 1,536 px at batch 1."""
    monkeypatch.setattr("trainer.backends.torch_backend.backend.GRAPH_MAX_PIXELS", 1200)
    recorder = use(monkeypatch, Replaying())
    _trained(make_model, make_config, make_data, tmp_path, "auto")
    assert recorder.recorded == 1
    _trained(make_model, make_config, make_data, tmp_path, "on", step_graphs=True)
    assert recorder.recorded == 1 + 2


def test_micro_batches_of_one_shape_add_into_one_step(make_model, make_config, monkeypatch):
    """Gradient accumulation: two micro-batches of one shape replay one graph twice in a step; the update
    equals the whole batch's, as without graphs (tests/trainer/backends/torch_backend/test_backend.py)."""
    recorder = use(monkeypatch, Replaying())
    finals = {}
    for how in ("whole", "split"):
        backend = TorchBackend()
        backend.setup(make_model(), make_config(), get_arch("demo"))
        assert backend.graphs is not None
        for step in range(3):
            batch = fixed_batch(seed=step)
            backend.step([batch] if how == "whole" else split(batch), 1e-2)
        finals[how] = torch.cat([p.detach().flatten() for p in backend.params.values()])
        backend.teardown()
    assert recorder.replays >= 2 * 1 + 1  # split: steps 2 and 3 replay per micro-batch; whole: step 3
    torch.testing.assert_close(finals["split"], finals["whole"], rtol=1e-5, atol=1e-6)


def test_a_capture_that_fails_turns_graphs_off_and_loses_no_step(
    make_model, make_config, make_data, tmp_path, monkeypatch, caplog
):
    """A capture that fails (an op that waits for the host, memory): one warning naming the setting, the
    micro-batch runs as before, no later recording is tried, and the run trains what it trains without."""
    plain = _trained(make_model, make_config, make_data, tmp_path, "plain")
    use(monkeypatch, Replaying(fail=RuntimeError("operation not permitted when stream is capturing")))
    attempts = []
    original = StepGraphs._record

    def counted(self, *args):
        attempts.append(1)
        return original(self, *args)

    monkeypatch.setattr(StepGraphs, "_record", counted)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        fell_back = _trained(make_model, make_config, make_data, tmp_path, "fell_back")
    warnings = [r.getMessage() for r in caplog.records if "step_graphs" in r.getMessage()]
    assert len(warnings) == 1 and "could not be recorded" in warnings[0] and "set step_graphs off" in warnings[0]
    assert "operation not permitted when stream is capturing" in warnings[0]
    assert len(attempts) == 1
    assert fell_back[0] == plain[0]
    for path in plain[1]:
        np.testing.assert_array_equal(fell_back[1][path], plain[1][path])


def test_step_graphs_keep_the_gradients_in_place(make_model, make_config, monkeypatch):
    """The recorded backward adds into the gradient tensors that exist at recording, so the optimizer step
    zeroes them instead of dropping them (set_to_none would leave a replay adding into orphans)."""
    use(monkeypatch, Replaying())
    backend = TorchBackend()
    backend.setup(make_model(), make_config(), get_arch("demo"))
    backend.step([fixed_batch()], 1e-3)
    backend.step([fixed_batch()], 1e-3)  # recorded here
    grads = {name: p.grad for name, p in backend.params.items()}
    backend.step([fixed_batch()], 1e-3)  # replayed
    assert all(p.grad is grads[name] for name, p in backend.params.items())
    assert all(float(p.grad.abs().max()) == 0.0 for p in backend.params.values())  # zeroed after the update
    backend.teardown()


def test_graphs_are_recorded_again_when_comfyui_puts_new_weights_in_the_model(
    make_model, make_config, monkeypatch, caplog
):
    """A recorded graph reads the base weights where they lay at recording. Sampling between steps may have
    ComfyUI load another clone and then the training model again, with new tensors in the modules: the
    graphs are then dropped and each shape recorded anew (eager once, then recorded)."""
    recorder = use(monkeypatch, Replaying())
    backend = TorchBackend()
    model = make_model()
    backend.setup(model, make_config(), get_arch("demo"))
    for _ in range(3):
        backend.step([fixed_batch()], 1e-3)
    assert recorder.recorded == 1
    backend.step([fixed_batch()], 1e-3)
    assert recorder.recorded == 1 and len(backend.graphs.graphs) == 1  # unchanged weights: replayed
    frozen = [
        (module, name)
        for module in model.modules()
        for name, p in module.named_parameters(recurse=False)
        if not p.requires_grad
    ]
    for module, name in frozen:  # as ComfyUI's set_attr_param does when it patches or moves a model
        setattr(module, name, torch.nn.Parameter(getattr(module, name).detach().clone(), requires_grad=False))
    with caplog.at_level(logging.INFO, logger="kiln"):
        backend.step([fixed_batch()], 1e-3)
    assert "recorded again" in caplog.text and backend.graphs.graphs == {}  # dropped; this step ran eagerly
    backend.step([fixed_batch()], 1e-3)
    assert recorder.recorded == 2
    backend.teardown()


def test_out_of_memory_beside_the_pool_gives_up_the_graphs_first(make_model, make_config, monkeypatch, caplog):
    """step_graphs auto: a step that runs out of GPU memory while graphs hold their pool is redone without
    them (one warning; the pool only bought small buckets' speed), before checkpoint_budget auto steps back;
    the run trains what it trains without graphs. An explicit `on` keeps the error."""

    def trained(**settings):
        backend = TorchBackend()
        backend.setup(make_model(), make_config(**settings), get_arch("demo"))
        return backend

    plain = trained()
    for seed in range(4):
        plain.step([fixed_batch(seed=seed)], 1e-2)
    use(monkeypatch, Replaying())
    backend = trained()
    real_forward, calls = backend.forward, []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # step 3, a replay (1: eager, 2: recorded, 3: its replay)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_forward(*args, **kwargs)

    backend.forward = forward
    with caplog.at_level(logging.WARNING, logger="kiln"):
        for seed in range(4):
            backend.step([fixed_batch(seed=seed)], 1e-2)
    warnings = [r.getMessage() for r in caplog.records if r.name == "kiln"]
    assert len(warnings) == 1 and "step_graphs auto: a step ran out of GPU memory" in warnings[0]
    assert backend.graphs is None and not backend.levers.step_graphs and "step graphs: off" in backend.levers.note
    for name, param in plain.params.items():
        torch.testing.assert_close(backend.params[name], param, rtol=1e-6, atol=1e-7)
    plain.teardown()
    backend.teardown()

    forced = trained(step_graphs=True)
    real_forward, calls = forced.forward, []
    forced.forward = forward
    with pytest.raises(torch.OutOfMemoryError):
        for seed in range(4):
            forced.step([fixed_batch(seed=seed)], 1e-2)
    forced.teardown()


# ---------------------------------------------------------------- the auto decision

GIB = levers.GIB


def _decide(
    free_gib: float,
    *,
    device="cuda",
    parallel=False,
    cuda_graphs=False,
    resolutions=(512, 768, 1024),
    need=10 * GIB,
    pool=4 * GIB,
    budget=1.0,
    **settings,
):
    cfg = config_module.from_dict({"arch": "zimage", "resolutions": list(resolutions), **settings})
    sizes = {max(resolutions): need}

    def estimated(model, c, budget):
        return None if need is None else sizes.get(max(c.resolutions), pool)

    original = levers.estimated_step_bytes
    levers.estimated_step_bytes = estimated
    try:
        return levers.step_graphs(
            torch.nn.Linear(2, 2),
            cfg,
            torch.device(device),
            budget,
            cuda_graphs,
            parallel,
            (int(free_gib * GIB), 80 * GIB),
        )
    finally:
        levers.estimated_step_bytes = original


def test_auto_records_small_steps_on_one_cuda_gpu_where_the_pool_fits():
    on, why = _decide(60)
    assert (
        on and "step_graphs auto → on (steps of up to 800x800 px" in why and "a pool of ~8.0 GiB" in why
    )  # 2x the step
    # the pool (the largest recorded step) beside the largest eager step, with auto's safety factor and margin
    assert not _decide(20)[0] and "would not fit" in _decide(20)[1]
    assert "set checkpoint_budget lower to make room" in _decide(20)[1]
    # at budget 0 there is nothing to lower (Klein 4B on a 12 GiB card, measured): no such advice
    assert "would not fit" in _decide(20, budget=0.0)[1] and "checkpoint_budget" not in _decide(20, budget=0.0)[1]
    assert not _decide(60, resolutions=(1024,))[0]  # every step keeps the GPU busy
    assert not _decide(60, need=None)[0]  # no estimate: memory unknown, off
    assert _decide(60, batch_size=2)[0] and "up to 565x565 px" in _decide(60, batch_size=2)[1]


def test_step_graphs_are_off_where_they_cannot_work_and_say_so_only_when_asked_for():
    assert _decide(60, device="cpu") == (False, "")  # auto off on a CPU: no news
    assert _decide(60, parallel=True) == (False, "")
    assert _decide(60, cuda_graphs=True) == (False, "")
    assert _decide(60, device="cpu", step_graphs=True) == (False, "step_graphs → off (needs a CUDA GPU)")
    assert _decide(60, parallel=True, step_graphs=True)[1] == "step_graphs → off (not under torchrun)"
    assert _decide(2, step_graphs=True) == (True, "")  # asked for: memory is the user's call
    assert _decide(60, step_graphs=False) == (False, "")


def test_step_graphs_is_a_config_setting_with_auto():
    assert config_module.TrainConfig().step_graphs == "auto"
    for value in ("auto", True, False):
        assert config_module.from_dict({"step_graphs": value}).step_graphs == value
    with pytest.raises(config_module.ConfigError, match="step_graphs"):
        config_module.from_dict({"step_graphs": "sometimes"})


def test_the_levers_of_a_cpu_run_leave_step_graphs_off(make_model, make_config):
    backend = TorchBackend()
    backend.setup(make_model(), make_config(), get_arch("demo"))
    assert backend.graphs is None and not backend.levers.step_graphs
    backend.teardown()


def test_the_switch_turns_them_off(monkeypatch):
    monkeypatch.setattr(step_graphs_module, "ENABLED", False)
    monkeypatch.setattr(levers, "step_graphs", lambda *args, **kwargs: (True, ""))
    cfg = config_module.from_dict({"arch": "demo", "device": "cpu", "mixed_precision": "no"})
    assert not levers.decide(torch.nn.Linear(2, 2), cfg, torch.device("cpu")).step_graphs
