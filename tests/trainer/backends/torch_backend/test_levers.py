"""Speed levers of the PyTorch backend (bench/RESULTS.md): partial checkpointing and compiled blocks
must give the gradients of the plain model; compiled blocks run under torch.compile's "aot_eager"
backend here (the same dynamo and autograd graphs as inductor, no C++/Triton build on CI)."""

from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.utils import counters

from trainer import config as config_module
from trainer.archs import get_arch
from trainer.backends.torch_backend import checkpointing, levers
from trainer.backends.torch_backend.backend import CompileFailed, TorchBackend
from trainer.backends.torch_backend.lora import LoraSet
from trainer.estimate.torch_step import AUTO_BUDGETS, AUTO_SAFETY, estimate

from helpers.torch_batches import HeaderModel, fixed_batch, gradients, inplace_net_with_lora, with_lora


@pytest.fixture
def eager_compile(monkeypatch):
    monkeypatch.setattr(checkpointing, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_skip_keeps_the_last_blocks_out_of_checkpointing():
    assert checkpointing.checkpointed(5, True, 2) == [True, True, True, False, False]
    assert checkpointing.checkpointed(3, True, 0) == [True, True, True]
    assert checkpointing.checkpointed(3, True, 99) == [False, False, False]
    assert checkpointing.checkpointed(3, False, 0) == [False, False, False]  # checkpointing off: skip moot


@pytest.mark.parametrize(
    "settings",
    [
        dict(gradient_checkpointing=True, skip_checkpoint_blocks=1),
        dict(gradient_checkpointing=True, compile_blocks=True),
        dict(gradient_checkpointing=True, compile_blocks=True, skip_checkpoint_blocks=1),
    ],
    ids=["skip", "compile", "compile+skip"],
)
def test_levers_give_the_plain_gradients(make_model, make_config, eager_compile, settings):
    reference = gradients(make_model, make_config, gradient_checkpointing=False)
    got = gradients(make_model, make_config, **settings)
    assert torch.count_nonzero(reference) > 0.5 * reference.numel()
    torch.testing.assert_close(got, reference, atol=1e-6, rtol=1e-5)
    if settings.get("compile_blocks"):
        assert counters["stats"]["unique_graphs"] >= 1  # it really ran compiled


def test_compiled_checkpointed_blocks_may_write_into_their_inputs(eager_compile):
    """ComfyUI's Flux2 blocks do `x += ...`; compiled with the checkpoint inside, gradients stay true."""
    x, grads = torch.randn(2, 3, 8), []
    for compile in (False, True):
        net, lora = inplace_net_with_lora()
        hooks = checkpointing.BlockCheckpointing(net, ("blocks",), recompute=compile, compile=compile)
        net(x).square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for _, p in lora.named_parameters()]))
        hooks.remove()
        assert "forward" not in net.blocks[0].__dict__  # removal gives the class forward back
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


class PureNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


@pytest.mark.parametrize(
    "recompute, budget", [(False, 0.0), (True, 0.0), (True, 0.5)], ids=["keeps-activations", "checkpointed", "budget"]
)
def test_blocks_that_write_into_their_inputs_compile_with_the_eager_gradients(eager_compile, recompute, budget):
    """Flux2's blocks do `x += ...`. Compiled whole as they are (keeping their activations, or under a
    budget), such blocks gave NaNs on an H100; compiled with their inputs copied inside the compiled
    region (pure_blocks False), every block compiles and the gradients are the eager model's."""
    x = torch.randn(2, 3, 8)
    net, lora = inplace_net_with_lora()
    net(x).square().sum().backward()
    reference = torch.cat([p.grad.flatten() for _, p in lora.named_parameters()])
    net, lora = inplace_net_with_lora()
    hooks = checkpointing.BlockCheckpointing(
        net, ("blocks",), recompute=recompute, compile=True, pure_blocks=False, budget=budget
    )
    before = x.clone()
    net(x).square().sum().backward()
    hooks.remove()
    torch.testing.assert_close(
        torch.cat([p.grad.flatten() for _, p in lora.named_parameters()]), reference, atol=1e-6, rtol=1e-5
    )
    assert torch.equal(x, before) and counters["stats"]["unique_graphs"] > 0


def test_the_pure_copy_is_inside_the_compiled_block(eager_compile, monkeypatch):
    """The copies that make a block pure are traced with it (one graph per block kind, no graph break),
    and a pure block gets none."""
    seen = []
    real = checkpointing._compiled
    monkeypatch.setattr(
        checkpointing, "_compiled", lambda fn, key, *graphs: seen.append(fn.__name__) or real(fn, key, *graphs)
    )
    for pure in (False, True):
        net, _ = inplace_net_with_lora()
        checkpointing.BlockCheckpointing(net, ("blocks",), recompute=False, compile=True, pure_blocks=pure).remove()
    assert seen == ["fresh_inputs", "fresh_inputs", "whole", "whole"]


def test_config_refuses_compile_blocks_on_mlx():
    with pytest.raises(config_module.ConfigError, match="compile_blocks is for backend 'torch'"):
        config_module.from_dict({"backend": "mlx", "compile_blocks": True})
    assert config_module.from_dict({"skip_checkpoint_blocks": 4}).skip_checkpoint_blocks == 4
    with pytest.raises(config_module.ConfigError, match="skip_checkpoint_blocks"):
        config_module.from_dict({"skip_checkpoint_blocks": -1})


def test_estimate_counts_the_blocks_that_keep_their_activations():
    base = estimate("zimage", resolution=1024)
    totals = [estimate("zimage", resolution=1024, skip_checkpoint_blocks=n).total for n in (0, 1, 7)]
    assert totals[0] == base.total and totals[0] < totals[1] < totals[2]
    per_block = totals[1] - totals[0]
    assert totals[2] - totals[0] == 7 * per_block  # the last blocks are alike (Z-Image's layers)
    off = estimate("zimage", resolution=1024, gradient_checkpointing=False).total
    assert totals[2] < off
    from trainer.estimate.torch_advice import advice

    first = advice(estimate("zimage", resolution=1024, skip_checkpoint_blocks=7).settings)[0]
    assert first[1] == {"skip_checkpoint_blocks": 0}


def test_a_failed_compile_says_to_turn_compile_blocks_off(make_model, make_config, monkeypatch):
    def broken_backend(graph, example_inputs):
        raise OSError("no C++ compiler")

    monkeypatch.setattr(checkpointing, "COMPILE_BACKEND", broken_backend)
    torch._dynamo.reset()
    backend = TorchBackend()
    backend.setup(make_model(), make_config(gradient_checkpointing=True, compile_blocks=True), get_arch("demo"))
    try:
        with pytest.raises(RuntimeError, match="Turn compile_blocks off"):
            backend.step([fixed_batch()], 1e-3)
    finally:
        backend.teardown()
        torch._dynamo.reset()


class MlpNet(torch.nn.Module):
    """Pure residual MLP blocks: enough intermediate tensors for the partitioner to choose among."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            [
                torch.nn.Sequential(
                    torch.nn.Linear(16, 64),
                    torch.nn.GELU(),
                    torch.nn.Linear(64, 64),
                    torch.nn.SiLU(),
                    torch.nn.Linear(64, 16),
                )
                for _ in range(2)
            ]
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return x


_SAVED: list[list[int]] = [[]]  # where the recording backend appends: the current run's list


def _record_partition(joint, inputs, *, num_fwd_outputs, **kwargs):
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    forward, backward = min_cut_rematerialization_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
    outputs = next(n for n in forward.graph.nodes if n.op == "output").args[0][num_fwd_outputs:]
    _SAVED[0].append(
        sum(
            o.meta["val"].numel() * o.meta["val"].element_size()
            for o in outputs
            if hasattr(o, "meta") and torch.is_tensor(o.meta.get("val"))
        )
    )
    return forward, backward


def _recording_backend():
    """One backend object for every run, as "inductor" is one backend: dynamo only reuses graphs
    compiled by the same backend."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    if not hasattr(_recording_backend, "backend"):
        _recording_backend.backend = aot_autograd(
            fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=_record_partition
        )
    return _recording_backend.backend


def _budget_run(budget: float | None, saved: list[int], reset: bool = True, net: torch.nn.Module | None = None):
    """LoRA gradients of MlpNet, compiled with the partitioner recording the bytes each block saves."""
    _SAVED[0] = saved
    backend = _recording_backend()

    net = net or MlpNet()
    net.requires_grad_(False)
    lora = LoraSet(net, ["re:.*"], rank=4, alpha=4, dropout=0, seed=0)
    with torch.no_grad():
        for _, p in lora.named_parameters():
            p.add_(0.05)
    previous = checkpointing.COMPILE_BACKEND
    checkpointing.COMPILE_BACKEND = backend
    if reset:
        torch._dynamo.reset()
    try:
        hooks = checkpointing.BlockCheckpointing(
            net,
            ("blocks",),
            recompute=budget is not None,
            compile=budget is not None,
            pure_blocks=True,
            budget=budget or 0.0,
        )
        net(torch.randn(64, 16)).square().sum().backward()
        hooks.remove()
    finally:
        checkpointing.COMPILE_BACKEND = previous
    grads = torch.cat([p.grad.flatten() for _, p in lora.named_parameters()])
    lora.remove()
    return grads


def test_checkpoint_budget_keeps_more_activations_and_the_same_gradients():
    reference = _budget_run(None, [])
    saved_small, saved_large = [], []
    small, large = _budget_run(0.05, saved_small), _budget_run(1.0, saved_large)
    torch.testing.assert_close(small, reference, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(large, reference, atol=1e-5, rtol=1e-4)
    assert saved_small and saved_large
    assert max(saved_small) < max(saved_large)  # the budget reached the partitioner


def test_a_run_with_other_settings_on_the_same_model_compiles_anew(eager_compile):
    """Dynamo does not guard on the budget (read outside the traced code), and a new run's LoRA branches
    on the same model pass its guards: on an H100 a second run with another budget reused the first
    run's graphs. Code objects per settings key make it compile anew; the same settings reuse."""
    net = MlpNet()
    first, second, again = [], [], []
    _budget_run(0.05, first, reset=False, net=net)
    _budget_run(1.0, second, reset=False, net=net)
    _budget_run(1.0, again, reset=False, net=net)
    assert first and second and max(first) < max(second)
    assert again == []  # same settings: the compiled graphs are found, no compile


def test_checkpoint_budget_is_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match="checkpoint_budget needs compile_blocks"):
        checkpointing.BlockCheckpointing(MlpNet(), ("blocks",), compile=False, pure_blocks=True, budget=0.5)
    zimage = {"arch": "zimage", "compile_blocks": True, "checkpoint_budget": 0.4}
    assert config_module.from_dict(zimage).checkpoint_budget == 0.4
    assert config_module.from_dict({**zimage, "arch": "flux2_klein"}).checkpoint_budget == 0.4  # Flux2 too
    for change in ({"compile_blocks": False}, {"gradient_checkpointing": False}):
        with pytest.raises(config_module.ConfigError, match="checkpoint_budget 0.4 needs"):
            config_module.from_dict({**zimage, **change})


def test_estimate_counts_the_checkpoint_budget_against_the_measured_peaks():
    from trainer.estimate.torch_advice import advice

    measured = {0.0: 15.25, 0.3: 19.38, 0.5: 22.05, 0.8: 26.33}  # GiB, H100, Z-Image 1024 px (RESULTS.md)
    totals = {b: estimate("zimage", resolution=1024, checkpoint_budget=b).total / 2**30 for b in measured}
    assert all(measured[b] <= totals[b] <= 1.15 * measured[b] for b in measured)  # never below the peak
    assert totals[0.0] < totals[0.3] < totals[0.5] < totals[0.8]
    assert totals[0.8] < estimate("zimage", resolution=1024, gradient_checkpointing=False).total / 2**30
    first = advice(estimate("zimage", resolution=1024, checkpoint_budget=0.3).settings)[0]
    assert first[1] == {"checkpoint_budget": 0.0}


# ---------------------------------------------------------------- the defaults: compile_blocks and budget "auto"


def test_auto_is_the_default_and_old_booleans_still_load():
    cfg = config_module.from_dict({})
    assert cfg.compile_blocks == "auto" and cfg.checkpoint_budget == "auto"
    old = config_module.from_dict({"compile_blocks": False, "checkpoint_budget": 0.0})  # a run.json of 0.1
    assert old.compile_blocks is False and old.checkpoint_budget == 0.0
    for bad in ({"compile_blocks": "yes"}, {"checkpoint_budget": "max"}):
        with pytest.raises(config_module.ConfigError, match='or "auto"'):
            config_module.from_dict(bad)
    assert config_module.from_dict({"backend": "mlx"}).compile_blocks == "auto"  # auto is fine on MLX


def test_auto_compiles_only_where_it_pays():
    cpu = levers.decide(torch.nn.Linear(2, 2), config_module.from_dict({}), torch.device("cpu"))
    assert cpu == levers.Levers(False, 0.0, cpu.note)
    assert "compile_blocks auto → off (cpu)" in cpu.note and "checkpoint_budget auto → 0" in cpu.note
    explicit = levers.decide(
        torch.nn.Linear(2, 2),
        config_module.from_dict({"compile_blocks": True, "checkpoint_budget": 0.3}),
        torch.device("cpu"),
    )
    assert explicit == levers.Levers(True, 0.3, "")  # explicit values are taken as they are


def test_auto_leaves_blocks_that_write_into_a_norms_input_uncompiled_outside_bf16_autocast(monkeypatch):
    """Flux2's blocks (`x += ...` after `norm(x)`) trace only under bf16 autocast on CUDA; in fp32 on an H100
    the attempt failed at the first step (12 s lost), so auto does not try. Pure blocks compile in fp32."""
    monkeypatch.setattr(levers, "can_compile", lambda device: True)  # a CUDA GPU with Triton

    def decided(arch: str, precision: str, compile_blocks="auto") -> levers.Levers:
        cfg = config_module.from_dict(
            {"arch": arch, "mixed_precision": precision, "checkpoint_budget": 0.0, "compile_blocks": compile_blocks}
        )
        return levers.decide(
            torch.nn.Linear(2, 2),
            cfg,
            torch.device("cuda"),
            blocks_write_norm_inputs=get_arch(arch).blocks_write_norm_inputs,
        )

    assert decided("flux2_klein", "bf16").compile and decided("flux2_dev", "bf16").compile
    for arch in ("flux2_klein", "flux2_dev"):
        fp32 = decided(arch, "no")
        assert not fp32.compile and "compile_blocks auto → off (this model's blocks write into" in fp32.note
    assert decided("zimage", "no").compile and not get_arch("generic").blocks_write_norm_inputs
    assert decided("flux2_klein", "no", compile_blocks=True).compile  # explicit: tried (its error names the fix)


def test_auto_compiles_no_adapter_run_after_a_full_fine_tune_compiled_in_the_process(monkeypatch):
    """On an H200 a compiled LoRA run after a compiled full fine-tune in one process failed with an illegal memory
    access (the process's CUDA context lost); eager, it trained. So auto leaves the blocks eager after one, says
    why, and an explicit compile_blocks is taken as it is."""
    monkeypatch.setattr(levers, "can_compile", lambda device: True)  # a CUDA GPU with Triton
    monkeypatch.setattr(levers, "FULL_COMPILED_HERE", [])

    def decided(adapter: str, device="cuda", compile_blocks="auto") -> levers.Levers:
        cfg = config_module.from_dict(
            {"adapter": adapter, "checkpoint_budget": 0.0, "compile_blocks": compile_blocks, "step_graphs": False}
        )
        return levers.decide(torch.nn.Linear(2, 2), cfg, torch.device(device))

    assert decided("lora").compile and not levers.FULL_COMPILED_HERE  # a LoRA run leaves no mark
    assert decided("full").compile and levers.FULL_COMPILED_HERE == ["cuda"]
    after = decided("lora")
    assert not after.compile and "compile_blocks auto → off (a full fine-tune compiled its blocks" in after.note
    assert decided("full").compile  # another full run compiles as the first did
    assert decided("lokr", compile_blocks=True).compile  # explicit: taken as it is


@pytest.mark.parametrize("variant, arch", [("zimage", "zimage"), ("flux2-klein-4b", "flux2_klein")])
def test_auto_budget_is_the_largest_that_leaves_the_margin(variant, arch):
    model, cfg = HeaderModel(variant), config_module.from_dict({"arch": arch, "resolutions": [512, 1024]})
    need = {
        b: (lambda e: e.total - e.weights)(estimate(variant, resolution=1024, checkpoint_budget=b))
        for b in (0.0, *AUTO_BUDGETS)
    }
    gib = levers.GIB
    chosen = []
    for free in (2, 8, 12, 16, 24, 40, 79):
        budget, why = levers.auto_budget(model, cfg, torch.device("cuda"), (free * gib, 80 * gib))
        margin = max(4 * gib, 0.1 * 80 * gib)
        assert budget == 0.0 or AUTO_SAFETY * need[budget] <= free * gib - margin, (free, budget)
        larger = [b for b in AUTO_BUDGETS if b > budget]
        assert all(AUTO_SAFETY * need[b] > free * gib - margin for b in larger), (free, budget)
        chosen.append(budget)
    assert chosen == sorted(chosen) and chosen[0] == 0.0 and chosen[-1] == 1.0  # more memory, more kept
    assert levers.auto_budget(torch.nn.Linear(4, 4), cfg, torch.device("cuda"), (79 * gib, 80 * gib)) == (
        0.0,
        "0 (no memory estimate for this model)",
    )


def test_a_zimage_step_on_a_small_card_gets_a_small_budget():
    """Weights resident, 12 GiB free of 24: plain checkpointing needs ~4.2 GiB more and budget 0.1 ~5.7
    (each counted 1.25x); with the 4 GiB margin the largest that fits is 0.1, and with 10 GiB free none."""
    cfg = config_module.from_dict({"arch": "zimage", "resolutions": [1024]})
    budget, why = levers.auto_budget(
        HeaderModel("zimage"), cfg, torch.device("cuda"), (12 * levers.GIB, 24 * levers.GIB)
    )
    assert budget == 0.1 and "12.0 GiB free" in why
    assert (
        levers.auto_budget(HeaderModel("zimage"), cfg, torch.device("cuda"), (10 * levers.GIB, 24 * levers.GIB))[0]
        == 0.0
    )


def test_free_memory_is_counted_under_a_per_process_cap(monkeypatch):
    """A process capped with torch.cuda.set_per_process_memory_fraction (a shared GPU, a 24 GB card simulated on
    an 80 GB one) plans within the cap: its allocator raises out of memory there, whatever the GPU has free."""
    gib = levers.GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 14 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 12 * gib)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def fraction_of(share):
        def fraction(device):  # torch 2.11 refuses a device without an index ("cuda"), as Kiln's may be
            assert isinstance(device, int)
            return share

        return fraction

    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction_of(1.0), raising=False)
    assert levers.free_bytes(torch.device("cuda")) == (72 * gib, 80 * gib)  # the reserved-but-unused 2 GiB count
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction_of(0.3), raising=False)
    free, total = levers.free_bytes(torch.device("cuda"))
    assert total == int(0.3 * 80 * gib) and free == total - 12 * gib
    cfg = config_module.from_dict({"arch": "zimage", "resolutions": [1024]})
    capped = levers.auto_budget(HeaderModel("zimage"), cfg, torch.device("cuda"))[0]
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction_of(1.0), raising=False)
    assert capped < levers.auto_budget(HeaderModel("zimage"), cfg, torch.device("cuda"))[0] == 1.0


def test_compiled_blocks_are_cached_where_a_reboot_keeps_them(tmp_path, monkeypatch):
    """inductor's default cache is in the temp folder, which most Linux systems empty at boot; Kiln points it
    at the user's cache folder when compiled blocks are set up, unless TORCHINDUCTOR_CACHE_DIR is set or the
    folder cannot be made."""
    environ = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    assert checkpointing.keep_compiled(environ) == str(tmp_path / "cache" / "kiln" / "torch_compile")
    assert environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "kiln" / "torch_compile")
    assert (tmp_path / "cache" / "kiln" / "torch_compile").is_dir()
    relative = checkpointing.compile_cache_folder({"XDG_CACHE_HOME": "cache"})  # the XDG spec: ignored
    assert relative.is_absolute() and relative.parts[-3:] == (".cache", "kiln", "torch_compile")
    mine = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "TORCHINDUCTOR_CACHE_DIR": "/fast/disk"}
    assert checkpointing.keep_compiled(mine) is None and mine["TORCHINDUCTOR_CACHE_DIR"] == "/fast/disk"
    (tmp_path / "file").write_text("not a folder")
    blocked = {"XDG_CACHE_HOME": str(tmp_path / "file")}
    assert checkpointing.keep_compiled(blocked) is None and "TORCHINDUCTOR_CACHE_DIR" not in blocked
    # importing torch._dynamo writes inductor's default into the variable (ComfyUI's process has): not a choice
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    defaulted = {
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "TORCHINDUCTOR_CACHE_DIR": default_cache_dir(),
        "TRITON_CACHE_DIR": os.path.join(default_cache_dir(), "triton", "0"),
    }  # inductor wrote both
    assert (
        checkpointing.keep_compiled(defaulted)
        == defaulted["TORCHINDUCTOR_CACHE_DIR"]
        == str(tmp_path / "cache" / "kiln" / "torch_compile")
    )
    assert defaulted["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "kiln" / "torch_compile" / "triton")
    own_triton = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "TRITON_CACHE_DIR": "/fast/triton"}
    checkpointing.keep_compiled(own_triton)
    assert own_triton["TRITON_CACHE_DIR"] == "/fast/triton"  # the user's own stays
    # inductor reads the variable at each use, so setting it once torch is imported is enough
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    assert checkpointing.keep_compiled() == cache_dir() == str(tmp_path / "home" / "kiln" / "torch_compile")
    monkeypatch.setattr(checkpointing, "COMPILE_BACKEND", "aot_eager")  # nothing of inductor's to keep
    assert checkpointing.keep_compiled({"XDG_CACHE_HOME": str(tmp_path / "other")}) is None


def test_compiled_blocks_set_up_their_cache_and_uncompiled_ones_do_not(monkeypatch):
    calls = []
    monkeypatch.setattr(checkpointing, "keep_compiled", lambda: calls.append(1))
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    checkpointing.BlockCheckpointing(MlpNet(), ("blocks",), compile=False, pure_blocks=True).remove()
    assert calls == []
    checkpointing.BlockCheckpointing(MlpNet(), ("blocks",), compile=True, pure_blocks=True).remove()
    assert calls == [1]


def test_a_failed_compile_under_auto_trains_on_uncompiled(make_model, make_config, monkeypatch, caplog):
    """compile_blocks auto where the compile fails (here: a compiler that raises, as inductor does without
    a C++ compiler or Triton): one warning, the same step's gradients as an eager run, no lost run."""

    def broken(gm, example_inputs):
        raise OSError("no C++ compiler")

    reference = gradients(make_model, make_config, gradient_checkpointing=True, compile_blocks=False)
    monkeypatch.setattr(levers, "can_compile", lambda device: True)
    monkeypatch.setattr(checkpointing, "COMPILE_BACKEND", broken)
    torch._dynamo.reset()
    caplog.set_level("WARNING", logger="kiln")
    backend = TorchBackend()
    backend.setup(
        make_model(),
        make_config(gradient_checkpointing=True, compile_blocks="auto", checkpoint_budget=0.0),
        get_arch("demo"),
    )
    assert backend.levers.compile
    backend.optimizer.step = lambda: None
    backend.optimizer.zero_grad = lambda set_to_none=True: None
    with torch.no_grad():
        for p in backend.params.values():
            p.add_(0.01)
    backend.step([fixed_batch()], 1e-3)
    got = torch.cat([p.grad.flatten() for p in backend.params.values()])
    backend.teardown()
    torch._dynamo.reset()
    assert not backend.levers.compile and "compile failed" in backend.levers.note
    warnings = [r.getMessage() for r in caplog.records if r.name == "kiln"]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0] and "goes on without" in warnings[0]
    torch.testing.assert_close(got, reference, atol=1e-6, rtol=1e-5)


def test_an_auto_budget_that_runs_out_of_memory_goes_on_at_budget_0(
    make_model, make_config, monkeypatch, caplog, eager_compile
):
    """checkpoint_budget auto chose too much (Flux2 Dev on an fp8 base did on an H100): the step that ran
    out of memory is redone with plain checkpointing, with one warning, and gives the eager gradients."""
    reference = gradients(make_model, make_config, gradient_checkpointing=True, compile_blocks=False)
    monkeypatch.setattr(
        levers, "decide", lambda model, cfg, device, notes=(), **arch_facts: levers.Levers(True, 0.5, "auto")
    )
    caplog.set_level("WARNING", logger="kiln")
    backend = TorchBackend()
    backend.setup(
        make_model(),
        make_config(gradient_checkpointing=True, compile_blocks=True, checkpoint_budget="auto"),
        get_arch("demo"),
    )
    real_forward, failed = backend.forward, []

    def forward(*args, **kwargs):
        if backend.levers.budget > 0:
            failed.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 486.00 MiB")
        return real_forward(*args, **kwargs)

    backend.forward = forward
    backend.optimizer.step = lambda: None
    backend.optimizer.zero_grad = lambda set_to_none=True: None
    with torch.no_grad():
        for p in backend.params.values():
            p.add_(0.01)
    backend.step([fixed_batch()], 1e-3)
    got = torch.cat([p.grad.flatten() for p in backend.params.values()])
    backend.teardown()
    assert failed == [True] and backend.levers.budget == 0.0 and backend.levers.compile
    warnings = [r.getMessage() for r in caplog.records if r.name == "kiln"]
    assert len(warnings) == 1 and "budget 0.5 ran out of GPU memory" in warnings[0]
    torch.testing.assert_close(got, reference, atol=1e-6, rtol=1e-5)


def test_an_explicit_budget_that_runs_out_of_memory_stops_as_before(
    make_model, make_config, monkeypatch, eager_compile
):
    backend = TorchBackend()
    backend.setup(
        make_model(),
        make_config(gradient_checkpointing=True, compile_blocks=True, checkpoint_budget=0.5),
        get_arch("demo"),
    )

    def forward(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    backend.forward = forward
    with pytest.raises(torch.OutOfMemoryError):
        backend.step([fixed_batch()], 1e-3)
    backend.teardown()


def test_cuda_graphs_compile_the_blocks_in_reduce_overhead_mode(monkeypatch):
    """cuda_graphs asks inductor for its CUDA-graph mode on every compiled block (a code object of its own,
    so a run without it never replays a graph recorded with it), and only where graphs can run."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.append(kwargs) or fn)
    for graphs in (False, True):
        ckpt = checkpointing.BlockCheckpointing(
            MlpNet(), ("blocks",), compile=True, pure_blocks=True, budget=0.5, cuda_graphs=graphs
        )
        ckpt.remove()
    assert {kw["mode"] for kw in seen[: len(seen) // 2]} == {None}
    assert {kw["mode"] for kw in seen[len(seen) // 2 :]} == {"reduce-overhead"}
    cpu = levers.decide(torch.nn.Linear(2, 2), config_module.from_dict({"cuda_graphs": True}), torch.device("cpu"))
    assert cpu.cuda_graphs is False and "cuda_graphs → off" in cpu.note
    with pytest.raises(config_module.ConfigError, match="cuda_graphs replays compiled blocks"):
        config_module.from_dict({"cuda_graphs": True, "compile_blocks": False})
    with pytest.raises(config_module.ConfigError, match="cuda_graphs"):
        config_module.from_dict({"cuda_graphs": True, "backend": "mlx", "arch": "zimage"})


def test_a_cuda_graph_step_marks_its_start(make_model, make_config, monkeypatch):
    """Each step tells the CUDA-graph trees that a new iteration begins (the last step's graph outputs are
    dead), so replaying never overwrites a tensor that is still read."""
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    backend = TorchBackend()
    backend.setup(make_model(), make_config(compile_blocks=False), get_arch("demo"))
    backend.levers = levers.Levers(False, 0.0, cuda_graphs=True)
    backend.step([fixed_batch()], 1e-3)
    backend.step([fixed_batch()], 1e-3)
    backend.teardown()
    assert marks == [1, 1]


class TwoStreamBlock(torch.nn.Module):
    """Flux2's double block in miniature: image and text tokens, and a RoPE-like table over both."""

    def __init__(self):
        super().__init__()
        self.img, self.txt = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, img, txt, pe):
        scale = pe.sum(dim=(-1, -2))[:, 0, :, None]
        return self.img(img) * scale[:, : img.shape[1]], self.txt(txt) * scale[:, img.shape[1] :]


class TwoStreamNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([TwoStreamBlock(), TwoStreamBlock()])

    def forward(self, img, txt):
        pe = torch.ones(img.shape[0], 1, img.shape[1] + txt.shape[1], 3, 2) / 6
        for block in self.blocks:
            img, txt = block(img, txt, pe)
        return img.square().mean() + txt.square().mean()


def _two_stream_gradients(inputs, compile: bool):
    """Each input pair's LoRA gradients, and the compiled graphs counted after each."""
    net, lora = with_lora(TwoStreamNet(), ["img", "txt"])
    hooks = checkpointing.BlockCheckpointing(net, ("blocks",), recompute=True, compile=compile)
    grads, graphs = [], []
    for img, txt in inputs:
        for _, p in lora.named_parameters():
            p.grad = None
        net(img, txt).backward()
        grads.append(torch.cat([p.grad.flatten() for _, p in lora.named_parameters()]))
        graphs.append(counters["stats"]["unique_graphs"])
    hooks.remove()
    return grads, graphs


@pytest.mark.parametrize("mark", [True, False], ids=["token-dims-marked", "dynamo-default"])
def test_a_second_bucket_compiles_nothing_new(eager_compile, monkeypatch, mark):
    """With MARK_TOKEN_DIMS a compiled block meets a second token count (another bucket) without compiling
    again: the sequence dims of its inputs (and of a table spanning image and text tokens) are symbolic from
    the first call. Left to dynamo (static first, the default) the second count compiles anew, which cost
    28-38 s per first run on an H100. Either way the gradients are the eager model's."""
    monkeypatch.setattr(checkpointing, "MARK_TOKEN_DIMS", mark)
    torch.manual_seed(2)
    inputs = [(torch.randn(1, tokens, 8), torch.randn(1, 4, 8)) for tokens in (6, 10, 13)]
    grads, graphs = _two_stream_gradients(inputs, compile=True)
    assert graphs[0] >= 1 and graphs[2] == graphs[1]  # dynamic after the second count either way
    assert (graphs[1] == graphs[0]) is mark
    eager, _ = _two_stream_gradients(inputs, compile=False)
    for got, want in zip(grads, eager):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_only_the_token_dim_of_a_table_is_marked():
    """A RoPE table [B, L, 1, 64, 2, 2] whose width equals the token count (L = 64) gets only its token
    dim marked: marking the width too made the table's next bucket, with another L, compile again. A
    [B, 1, L, L] mask gets both its token dims."""
    x, rope, mod = torch.randn(1, 64, 8), torch.randn(1, 64, 1, 64, 2, 2), torch.randn(1, 1, 64)
    mask = torch.zeros(1, 1, 64, 64, dtype=torch.bool)
    checkpointing._mark_token_dims([x, rope, mod, mask])
    assert x._dynamo_weak_dynamic_indices == {1} and rope._dynamo_weak_dynamic_indices == {1}
    assert mask._dynamo_weak_dynamic_indices == {2, 3}  # a token × token mask: both
    assert not hasattr(mod, "_dynamo_weak_dynamic_indices")  # [B, 1, D]: no token dim


class NormThenAddBlock(torch.nn.Module):
    """Flux2's pattern: a norm keeps its input for backward, then the block adds into that input."""

    def __init__(self):
        super().__init__()
        self.norm, self.lin = torch.nn.LayerNorm(8, elementwise_affine=False), torch.nn.Linear(8, 8)

    def forward(self, x):
        x = x + 1.0
        x += self.lin(self.norm(x))
        return x


def test_a_block_that_writes_into_what_a_norm_kept_fails_to_compile_with_the_fix_named(eager_compile):
    """Without bf16 autocast on CUDA (fp32 here), torch.compile cannot trace such a block: the error says so
    and names the fix (mixed_precision bf16 on CUDA, or compile_blocks off), not a missing compiler."""
    net = torch.nn.Module()
    net.blocks = torch.nn.ModuleList([NormThenAddBlock(), NormThenAddBlock()])
    net.forward = lambda x: net.blocks[1](net.blocks[0](x))
    net, _ = with_lora(net, ["lin"])
    hooks = checkpointing.BlockCheckpointing(net, ("blocks",), recompute=True, compile=True, budget=1.0)
    with (
        pytest.raises(CompileFailed, match="mixed_precision to bf16") as caught,
        checkpointing.compile_errors_explained(),
    ):
        net(torch.randn(1, 3, 8)).sum().backward()
    hooks.remove()
    assert "modified by an inplace operation" in str(caught.value) and "C++ compiler" not in str(caught.value)


def test_the_memory_plan_counts_adamw8bit_as_the_fp32_adamw_it_falls_back_to(monkeypatch):
    """Where bitsandbytes' 8-bit AdamW cannot run (optim.adamw8bit_fallback: missing, or off CUDA) a step counts
    fp32 AdamW's 8 B a LoRA weight, not 2 B; where it runs, 2 B (#47)."""
    from trainer.backends.torch_backend import optim

    model = HeaderModel("zimage")

    def step(optimizer: str) -> int:
        cfg = config_module.from_dict({"arch": "zimage", "resolutions": [512], "optimizer": optimizer})
        return levers.estimated_step_bytes(model, cfg, 0.0)

    state = {name: estimate("zimage", resolution=512, optimizer=name).optimizer for name in ("adamw", "adamw8bit")}
    assert state["adamw"] == 4 * state["adamw8bit"] > 0
    monkeypatch.setattr(optim, "adamw8bit_fallback", lambda device: "runs on CUDA only")
    assert step("adamw8bit") == step("adamw")
    monkeypatch.setattr(optim, "adamw8bit_fallback", lambda device: None)
    assert step("adamw") - step("adamw8bit") == state["adamw"] - state["adamw8bit"]
    assert optim.optimizer_that_runs("prodigy", torch.device("cpu")) == "prodigy"


def test_adamw8bit_falls_back_where_bitsandbytes_cannot_run():
    from trainer.backends.torch_backend import optim

    assert optim.adamw8bit_fallback(torch.device("cpu")) == "runs on CUDA only"
    assert optim.optimizer_that_runs("adamw8bit", torch.device("cpu")) == "adamw"
    assert optim.optimizer_that_runs("adamw8bit", torch.device("meta")) == "adamw"
