"""The PyTorch backend: LoRA on the model's own modules, one optimizer step per call."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import numpy as np
import torch
from torch import nn

from ...archs import Arch
from ...config import AUTO, TrainConfig
from ...estimate.torch_step import GRAPH_MAX_PIXELS
from ...lora.files import LoraWeights
from ...objective.flow import interpolate, velocity_target
from ...run import distributed
from ..base import StepStats, parameter_name, saved_name
from . import attention, devices, fallbacks, full, levers, lora, memory_plan, optim, preserving, sharding, streaming
from .checkpointing import (  # noqa: F401 (CompileFailed: imported from here)
    BlockCheckpointing,
    CompileFailed,
    compile_errors_explained,
    find_blocks,
)
from .device_batch import extras_on_device, flow_tensors, to_device
from .ema import Ema
from .lora import LoraSet
from .step_graphs import StepGraphs


def default_forward(model, x_t, sigmas, context, extras):
    """ComfyUI's diffusion-model call convention: model(x, timestep, context, **extras)."""
    return model(x_t, sigmas, context, **extras)


class TorchBackend:
    name = "torch"

    def setup(self, model: nn.Module, cfg: TrainConfig, arch: Arch, forward=None) -> None:
        cfg = full.settings(cfg)  # a full fine-tune: nothing streams, quantizes or records the trained blocks
        self.cfg, self.arch, self.model = cfg, arch, model
        self.forward = forward or default_forward
        self.device = devices.pick_device(cfg.device)
        self.dtype = devices.model_dtype(model)
        self.autocast = cfg.mixed_precision == "bf16"
        self.attention = attention.resolve(cfg.attention, self.device)
        # for teardown, by name: a list of the Parameters kept the whole base alive beside FSDP2's shards (sharding.py)
        self.frozen = [(name, p.requires_grad) for name, p in model.named_parameters()]
        model.requires_grad_(False)
        try:
            self._place(model, cfg, arch)
        except BaseException:  # the model goes back as it came (a ComfyUI MODEL is used again)
            self.teardown()
            raise
        self.params = dict(self.lora.named_parameters())
        self.graphs = self._step_graphs()
        self.optimizer = optim.build_optimizer(
            list(self.params.values()),
            cfg.optimizer,
            lr=cfg.learning_rate,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            device=self.device,
        )
        full.round_bf16_updates(self.optimizer, list(self.params.values()), cfg.optimizer)  # no-op: fp32, LoRA
        self.ema = Ema(self.params, cfg.ema_decay) if cfg.ema else None
        # The model call; under torchrun a DDP module averaging the LoRA gradients over the ranks.
        # self.forward read at each call (a test, or a later wrapper, may replace it after setup)
        self.call = distributed.data_parallel(
            lambda *inputs: self.forward(self.model, *inputs), full.replicated(self.lora, self.sharded)
        )
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        # LoRA dropout draws from torch's global RNG (so checkpointing's recompute replays the
        # same masks); seed it for the run and give the caller's state back at teardown.
        self.outer_rng = self.rng_state()
        torch.manual_seed(distributed.rank_seed(cfg.seed))

    def _place(self, model, cfg, arch) -> None:
        """The LoRA on the model, the memory plan (what streams) and the levers decided, the blocks wrapped."""
        self.blocks = find_blocks(model, arch.block_lists)
        cfg, storage_note = memory_plan.storage(model, cfg, self.device, self.blocks)  # base_quantize auto
        self.cfg = cfg
        fp8_note = self._add_lora()
        self.parallel = distributed.current().world > 1  # auto levers never fall back mid-step on one rank alone
        plan = memory_plan.decide(model, cfg, self.device, self.blocks)
        self.memory = sharding.place(cfg, plan, self.blocks, self.device, self.fp8 is not None, self.lora, model)
        self.sharded = sharding.is_sharded(p for _, p in self.lora.named_parameters())  # a sharded full run
        self.levers = levers.decide(
            model,
            cfg,
            self.device,
            notes=(storage_note, fp8_note, self.memory.note),
            parallel=self.parallel,
            blocks_write_norm_inputs=arch.blocks_write_norm_inputs,
            memory=self.memory,
        )
        for line in self.plan():
            levers.log.info("[Kiln] %s", line)
        self.stream = self._stream()
        # what lay on the host and does not stream (the adapters of its Linears were made there too)
        self.arrived = memory_plan.arrive([model, *self.lora.branches().values()], self.device)
        self._wrap_blocks(self.levers)

    def _add_lora(self) -> str:
        """The LoRA branches on the targets, over the fp8 forwards where fp8 is on; the fp8 lever's note."""
        cfg, arch, model = self.cfg, self.arch, self.model
        targets = cfg.targets or list(arch.default_targets)
        # the quantized base's forwards (int8, else fp8: self.fp8 holds either) go in first, so the LoRA
        # branches wrap them (removed in the reverse order)
        self.fp8, fp8_note = levers.quantized_base(model, cfg, self.device, self.blocks, arch.fp8_quantize_kernel)
        if cfg.adapter == full.FULL:  # the blocks' own weights, not branches (full.py)
            self.lora = full.FullSet(model, self.blocks)
            return fp8_note
        self.lora = LoraSet(
            model,
            targets,
            rank=cfg.rank,
            alpha=cfg.alpha,
            dropout=cfg.lora_dropout,
            seed=cfg.seed,
            adapter=cfg.adapter,
            lokr_factor=cfg.lokr_factor,
            lokr_full_w2=cfg.lokr_full_w2,
        )
        return fp8_note

    def _wrap_blocks(self, chosen: "levers.Levers") -> None:
        # Blocks are wrapped either way: with checkpointing off the wrapper only copies block inputs.
        cfg = self.cfg
        self.checkpointing = BlockCheckpointing(
            self.model,
            self.arch.block_lists,
            recompute=cfg.gradient_checkpointing,
            skip=cfg.skip_checkpoint_blocks,
            compile=chosen.compile,
            pure_blocks=self.arch.pure_blocks,
            budget=chosen.budget,
            cuda_graphs=chosen.cuda_graphs,
            # the adapter kind: a full run's blocks train their weights, graphs of their own (never a LoRA run's)
            compile_key=f"attention={self.attention}|fp8={self.fp8.mode if self.fp8 else 'off'}|{cfg.adapter}",
            offload=self.memory.offload,
        )
        if self.stream is not None:
            self.stream.hook()  # outside the checkpoint and the compiled region: the copies are not traced

    def _unwrap_blocks(self) -> None:
        if self.stream is not None:
            self.stream.unhook()
        self.checkpointing.remove()

    def _stream(self, released=({}, [])):
        """The memory plan's blocks streamed from host memory (streaming.py), or None; `released`: a smaller
        stream's weights, taken over."""
        if not self.memory.stream or self.memory.shards > 1:  # a sharded base's host shards: FSDP2 copies them
            return None
        stream = streaming.for_blocks(self.blocks, self.memory.chosen, self.device, released)
        return stream if self.fp8 is None else self.fp8.streamed(stream, self.blocks)  # no copy of it kept on the GPU

    def _step_graphs(self):
        """A fresh set of step graphs (none recorded) where the levers say so; after a fallback the blocks
        changed, and graphs recorded over the old ones must not replay."""
        return (
            StepGraphs(list(self.params.values()), self.device, model=self.model) if self.levers.step_graphs else None
        )

    def _again(self, micro_batches, lr: float) -> StepStats:
        """The step once more after a fallback, the failed step's graph gone (its memory back to the GPU)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return self.step(micro_batches, lr)

    # --- training -----------------------------------------------------------------
    def _to_device(self, array: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        return to_device(array, self.device, dtype)

    def _micro_loss(self, batch) -> torch.Tensor:
        if getattr(batch, "preservation", None) is not None:
            return self._preserving_loss(batch)
        return self._loss(self._device_batch(batch))

    def _device_batch(self, batch) -> dict:
        """The micro-batch's tensors on the device (integer extras stay on the host: they choose shapes)."""
        return {
            **flow_tensors(batch, self.device),
            "context": self._to_device(batch.context, self.dtype),
            "extras": self._extras(batch.extras),
        }

    def _amp(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast else nullcontext()

    def _loss(self, inputs: dict) -> torch.Tensor:
        """The loss from the device tensors alone (no host work: a step graph records exactly this)."""
        x0, noise, sigmas = inputs["x0"], inputs["noise"], inputs["sigmas"]
        x_t = interpolate(x0, noise, sigmas)  # [B,C,H,W] fp32
        target = velocity_target(x0, noise)
        with self._amp():
            # σ stays fp32: ComfyUI's samplers hand the model an fp32 timestep, so training must too.
            prediction = self.call(x_t.to(self.dtype), sigmas, inputs["context"], inputs["extras"])
        # Loss in fp32: per-sample mean (per-cell mask weights first, masked training), weighted, batch mean.
        squared = (prediction.float() - target).square()
        if inputs["mask"] is not None:
            squared = squared * inputs["mask"]  # [B,1,H,W] over the channels
        per_sample = squared.flatten(1).mean(dim=1)
        return (per_sample * inputs["weights"]).mean()

    def _extras(self, extras: dict) -> dict:
        return extras_on_device(extras, self.device, self.dtype)

    def _preserving_loss(self, batch) -> torch.Tensor:
        return preserving.loss(self, batch)

    def step(self, micro_batches, lr: float):
        # a schedule-free optimizer's training point is in the weights only inside a step (optim.training_mode)
        with optim.training_mode(self.optimizer):
            return self._step(micro_batches, lr)

    def _step(self, micro_batches, lr: float):
        optim.set_lr(self.optimizer, lr)
        total = torch.zeros((), device=self.device)
        if self.levers.cuda_graphs:  # a new step: the CUDA graphs' outputs of the last one may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        # The attention kernel choice covers forward, backward and checkpointing's recompute alike.
        try:
            with attention.kernel_context(self.attention), compile_errors_explained():
                for index, batch in enumerate(micro_batches):
                    with distributed.accumulating(self.call, final=index == len(micro_batches) - 1):
                        total += self._micro_step(batch, len(micro_batches))
        except BaseException as error:  # an auto lever that failed steps back (fallbacks.py): the step again
            if not fallbacks.recover(self, error):
                raise
            loss = total = None  # noqa: F841 — the failed step's graph goes before the step is redone
        if total is None:  # an auto lever fell back: the same step again, outside the except block
            return self._again(micro_batches, lr)
        total = distributed.mean(total)  # the global mean loss; the gradients were averaged in backward
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        grad_norm = (sharding if self.sharded else optim).clip_global_norm(grads, self.cfg.max_grad_norm)
        # A NaN/inf loss or gradient skips the update (weights, moments, step count, EMA unchanged).
        finite = torch.isfinite(total) & torch.isfinite(grad_norm)  # device bool, no sync
        if getattr(self.optimizer, "_step_supports_amp_scaling", False):
            # Fused AdamW (the CUDA default) skips on a device flag, as under GradScaler: its kernel
            # leaves params and moments alone and takes the step count back. No host sync.
            self.optimizer.found_inf = (~finite).float()
            self.optimizer.step()
            self.finite = finite  # for update_ema, on device
        else:
            # Other optimizers cannot skip on the device: one host read of one bool per step, which
            # waits for backward to finish (~the host's batch-building time per step on a GPU).
            self.finite = bool(finite.item())
            if self.finite:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self.graphs is None)  # step graphs add into fixed gradients
        return StepStats(loss=total, grad_norm=grad_norm, finite=finite)

    def _micro_step(self, batch, count: int) -> torch.Tensor:
        """One micro-batch's forward and backward: its detached share of the loss. Replayed as a CUDA graph
        per batch shape where step graphs are on (step_graphs.py); DOP's micro-batches run as they are."""
        if getattr(batch, "preservation", None) is not None:
            return self._backward(lambda: self._preserving_loss(batch), count)
        inputs = self._device_batch(batch)
        pixels = inputs["x0"][:, 0].numel() * self.arch.latent_downscale**2  # image px of the rows ([B,C,H,W])
        if self.graphs is None or (self.cfg.step_graphs == AUTO and pixels > GRAPH_MAX_PIXELS):
            return self._backward(lambda: self._loss(inputs), count)
        return self.graphs.run((inputs, count), lambda static: self._backward(lambda: self._loss(static[0]), count))

    def _backward(self, loss_of, count: int) -> torch.Tensor:
        with self._step_weights():
            loss = loss_of() / count
            loss.backward()  # (a compiled block's backward compiles at its first call)
        return loss.detach()

    def _step_weights(self):
        """Under bf16 autocast the LoRA weights are cast once per micro-batch (LoraSet.step_weights), not at
        each use. Not with CUDA graphs: their recorded blocks would copy each new input in per call. Not
        under torchrun: every gradient would reach its master only when the whole backward is done, and
        DDP's all-reduce of the first buckets could no longer overlap the rest of the backward."""
        if self.autocast and not self.levers.cuda_graphs and not self.parallel and lora.STEP_WEIGHTS:
            return self.lora.step_weights(torch.bfloat16)
        return nullcontext()

    def eval_loss(self, batches) -> float:
        rows = [len(batch.sigmas) for batch in batches]
        with torch.no_grad(), self.sampling(), attention.kernel_context(self.attention):
            losses = [self._micro_loss(batch) for batch in batches]  # device scalars, read in one transfer
        return float(np.dot(self.scalars(losses), rows) / sum(rows))

    def update_ema(self) -> None:
        finite = getattr(self, "finite", True)  # the last step's: a host bool, or a device flag (fused)
        if self.ema is not None and finite is not False:
            self.ema.update(None if finite is True else finite)

    def scalars(self, values) -> list[float]:
        if not values:
            return []
        return torch.stack([v.detach().float().reshape(()) for v in values]).cpu().tolist()

    # --- state in and out (numpy, keyed by ComfyUI module path) ------------------
    def lora_state(self) -> dict[str, LoraWeights]:
        """LoraWeights per module (AdapterWeights for adapter lokr/loha/dora)."""
        return {path: branch.weights() for path, branch in self.lora.branches().items()}

    def load_lora_state(self, lora: dict[str, LoraWeights]) -> None:
        branches = self.lora.branches()
        missing = sorted(set(branches) - set(lora))
        if missing:
            raise ValueError(f"LoRA state lacks {len(missing)} module(s), e.g. {missing[:3]}")
        for path, branch in branches.items():
            branch.load(lora[path], path)

    def full_state(self) -> dict[str, np.ndarray]:
        return full.state(self.lora)

    def load_full_state(self, tensors: dict[str, np.ndarray]) -> None:
        full.load_state(self.lora, tensors)

    def model_state(self) -> dict[str, np.ndarray]:
        return full.model_tensors(self.model, self.sharded)

    def ema_state(self) -> dict[str, np.ndarray]:
        if self.ema is None:
            return {}
        return {saved_name(name): full.whole(t).cpu().numpy() for name, t in self.ema.state().items()}

    def load_ema_state(self, tensors: dict[str, np.ndarray]) -> None:
        if self.ema is not None and tensors:
            self.ema.load_state({parameter_name(k): torch.from_numpy(v) for k, v in tensors.items()})

    def optimizer_state(self):
        return optim.optimizer_arrays(self.optimizer, list(self.params))

    def load_optimizer_state(self, tensors, meta) -> None:
        optim.load_optimizer_arrays(self.optimizer, list(self.params), tensors, meta)
        sharding.shard_optimizer_state(self.optimizer)  # whole tensors back to the shards of a sharded full run

    def gathered(self):
        """What a checkpoint writes, on every rank before rank 0 writes it (sharding.Gathered)."""
        return sharding.gathered(self)

    def rng_state(self) -> dict[str, np.ndarray]:
        return devices.rng_state(self.device)

    def load_rng_state(self, tensors: dict[str, np.ndarray]) -> None:
        devices.load_rng_state(self.device, tensors)

    # --- inference helpers --------------------------------------------------------
    @contextmanager
    def ema_weights(self):
        if self.ema is None:
            yield
            return
        with self.ema.swapped_in():
            yield

    @contextmanager
    def sampling(self):
        """For validation samples: EMA weights swapped in (when on) and LoRA dropout off."""
        dropouts = [b.dropout for b in self.lora.branches().values() if isinstance(b.dropout, nn.Dropout)]
        rates = [d.p for d in dropouts]
        for d in dropouts:
            d.p = 0.0
        try:
            with self.ema_weights():
                yield
        finally:
            for d, rate in zip(dropouts, rates):
                d.p = rate

    def plan(self) -> list[str]:
        return [f"memory plan: {self.memory.summary()}", *([self.levers.note] if self.levers.note else [])]

    def trainable_parameter_count(self) -> int:
        return self.lora.parameter_count()

    def peak_memory_bytes(self) -> int:
        return devices.peak_memory_bytes(self.device)

    def teardown(self) -> None:
        if getattr(self, "checkpointing", None) is not None:
            self._unwrap_blocks()
            self.checkpointing = None
        if getattr(self, "stream", None) is not None:
            self.stream.remove()  # after the forwards, before the LoRA and fp8 forwards come off
            self.stream = None
        memory_plan.leave(getattr(self, "arrived", []))  # back to the host, where the model's loader left it
        self.arrived = []
        if getattr(self, "lora", None) is not None:
            self.lora.remove()
        if getattr(self, "fp8", None) is not None:
            self.fp8.remove()
            self.fp8 = None
        if getattr(self, "outer_rng", None) is not None:
            self.load_rng_state(self.outer_rng)
            self.outer_rng = None
        params = dict(self.model.named_parameters()) if getattr(self, "frozen", None) else {}
        for name, requires_grad in (item for item in getattr(self, "frozen", []) if item[0] in params):
            params[name].requires_grad_(requires_grad)
        self.frozen = []
        self.optimizer = self.call = None
