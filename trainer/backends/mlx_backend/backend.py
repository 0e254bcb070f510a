"""The MLX backend: LoRA layers in the model's own module tree, one compiled step per batch shape.

A step is two `mx.compile`d functions, both with the model's and the optimizer's state as
captured inputs and outputs: forward + loss + backward, one per micro-batch shape (a bucket
and batch size; shapeless compiles fail, REFERENCE.md MLX trap 4), and clip + optimizer
update, one for all shapes. Micro-batch gradients are summed between them, so accumulation
over mixed buckets never multiplies the compiled variants. The whole step stays lazy until
its one `mx.eval`. Noise and sigmas come in the Batch; the only randomness inside is LoRA
dropout, drawn from explicit keys that are inputs of the step (trap 3: no global RNG).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from ...archs import Arch
from ...config import TrainConfig
from ...lora.files import LoraWeights
from ...objective.flow import interpolate, velocity_target
from ..base import StepStats, parameter_name, saved_name
from .checkpointing import BlockCheckpointing
from .ema import Ema
from .lora import LoraSet, named_modules
from .optim import build_optimizer, clip_global_norm, state_in, state_out

_COMPUTE_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
_BATCH_FIELDS = ("latents", "noise", "sigmas", "weights", "context")
_ITEM = "#"  # `extra.reference_latents#1`: the second array of a list-valued extra


def apple_memory_limits() -> dict | None:
    """On Metal: wire the model's memory (no paging mid-step) up to the GPU's recommended working set
    and cap MLX's allocations just under it, so a too-large run fails with MLX's error instead of
    swapping the whole Mac; the previous limits come back at teardown. No-op on the CPU build."""
    if not (hasattr(mx, "metal") and mx.metal.is_available()):
        return None
    working_set = int(mx.metal.device_info().get("max_recommended_working_set_size", 0))
    if working_set <= 0:
        return None
    return {"memory": mx.set_memory_limit(int(working_set * 0.95)), "wired": mx.set_wired_limit(working_set)}


def restore_memory_limits(previous: dict | None) -> None:
    mx.clear_cache()  # give freed buffers back (ComfyUI and the OS share the same unified memory)
    if previous:
        mx.set_memory_limit(previous["memory"])
        mx.set_wired_limit(previous["wired"])


def default_forward(model, x_t, sigmas, context, extras):
    """ComfyUI's diffusion-model call convention: model(x, timestep, context, **extras)."""
    return model(x_t, sigmas, context, **extras)


def model_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype activations run in: the first floating parameter's (quantized weights are integers)."""
    for _, value in tree_flatten(model.parameters()):
        if value.dtype in _COMPUTE_DTYPES:
            return value.dtype
    return mx.bfloat16


class MlxBackend:
    name = "mlx"
    compile_step = True  # False (set before setup) runs the same step functions eagerly: benchmarks, tests

    def setup(self, model: nn.Module, cfg: TrainConfig, arch: Arch, forward=None) -> None:
        self.limits = apple_memory_limits()
        self.cfg, self.arch, self.model = cfg, arch, model
        self.forward = forward or default_forward
        self.dtype = model_dtype(model)
        if cfg.mixed_precision == "bf16" and self.dtype != mx.bfloat16:
            raise ValueError(
                f"mixed_precision 'bf16' needs the MLX model built in bfloat16 (it is {self.dtype}; "
                "MLX has no autocast): build it with dtype 'bfloat16', or set mixed_precision 'no'"
            )
        # Remember which parameters were frozen, so teardown leaves the model exactly as it came.
        self.frozen = [(module, set(module._no_grad)) for _, module in [("", model), *named_modules(model)]]
        try:
            model.freeze()
            targets = cfg.targets or list(arch.default_targets)
            self.lora = LoraSet(
                model,
                targets,
                rank=cfg.rank,
                alpha=cfg.alpha,
                dropout=cfg.lora_dropout,
                seed=cfg.seed,
                low_precision=cfg.mixed_precision == "bf16",
                adapter=cfg.adapter,
                lokr_factor=cfg.lokr_factor,
                lokr_full_w2=cfg.lokr_full_w2,
            )
            self.checkpointing = (
                BlockCheckpointing(model, arch.block_lists, cfg.skip_checkpoint_blocks)
                if cfg.gradient_checkpointing
                else None
            )
            self.optimizer = build_optimizer(
                cfg.optimizer,
                lr=cfg.learning_rate,
                eps=cfg.adam_eps,
                betas=(cfg.adam_beta1, cfg.adam_beta2),
                weight_decay=cfg.weight_decay,
            )
            self.optimizer.init(model.trainable_parameters())  # state tree fixed before the first compile
            self.ema = Ema(self.lora.parameters(), cfg.ema_decay) if cfg.ema else None
        except BaseException:
            self.teardown()
            raise
        self.key = mx.random.key(cfg.seed)  # LoRA dropout keys; part of the run state
        self.state = [model.state, self.optimizer.state]
        self.loss_and_grad = nn.value_and_grad(model, self._micro_loss)
        self.compiled: dict[tuple, Any] = {}  # micro-batch signature → gradient function
        self.update = self._compiled(self._clip_and_update)
        mx.reset_peak_memory()

    # --- training -----------------------------------------------------------------
    def _inputs(self, batch) -> tuple[dict, dict]:
        """A Batch → (arrays for the step, constant extras that become part of the compiled graph)."""
        arrays = {name: mx.array(getattr(batch, name), dtype=mx.float32) for name in _BATCH_FIELDS[:4]}
        arrays["context"] = mx.array(batch.context).astype(self.dtype)
        if batch.mask is not None:  # masked training: per-cell loss weights [B,1,H,W] (part of the signature)
            arrays["mask"] = mx.array(batch.mask, dtype=mx.float32)
        constants = {}
        self._extras_in(batch.extras, "", arrays, constants)
        kept = getattr(batch, "preservation", None)
        if kept is not None:  # DOP (trainer/objective/preservation.py): the class-word rows, and the rows with them
            arrays["dop.weights"] = mx.array(kept.weights, dtype=mx.float32)
            for where, context, extras in (
                ("dop.", kept.context, kept.extras),
                ("joint.", kept.joint_context, kept.joint_extras),
            ):
                arrays[f"{where}context"] = mx.array(context).astype(self.dtype)
                self._extras_in(extras, where, arrays, constants)
        return arrays, constants

    def _extras_in(self, extras: dict, where: str, arrays: dict, constants: dict) -> None:
        for key, value in extras.items():
            if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.integer):
                # Integer extras (Z-Image's per-row caption lengths) shape the graph: they are constants
                # of the compiled step (one graph per length pattern), never traced arrays.
                constants[where + key] = tuple(int(v) for v in value.reshape(-1))
            elif isinstance(value, (np.ndarray, mx.array)):
                arrays[f"{where}extra.{key}"] = mx.array(value).astype(self.dtype)
            elif isinstance(value, list):
                # A list of arrays (edit training's reference latents): each a traced input `key#i`, so
                # their shapes join the step's signature (a batch with references compiles its own graph).
                for index, item in enumerate(value):
                    arrays[f"{where}extra.{key}{_ITEM}{index}"] = mx.array(item).astype(self.dtype)
            else:
                constants[where + key] = value

    @staticmethod
    def _extras(arrays: dict, constants: dict, where: str = "") -> dict:
        """The model extras of `where` ("" the batch's, "dop." / "joint." DOP's) from _inputs' two dicts."""
        own: dict = {}
        for key, value in arrays.items():
            if key.startswith(f"{where}extra."):
                name, listed, _ = key[len(where) + 6 :].partition(_ITEM)
                if listed:  # `key#0`, `key#1`, ... back into one list, in order
                    own.setdefault(name, []).append(value)
                else:
                    own[name] = value
        return {
            **own,
            **{
                k[len(where) :]: v
                for k, v in constants.items()
                if k.startswith(where) and (where or not k.startswith(("dop.", "joint.")))
            },
        }

    def _micro_loss(self, arrays: dict, constants: dict, count: int) -> mx.array:
        x0, noise, sigmas, weights = (arrays[k] for k in _BATCH_FIELDS[:4])
        extras = self._extras(arrays, constants)
        x_t = interpolate(x0, noise, sigmas)  # [B,C,H,W] fp32
        target = velocity_target(x0, noise)
        if "dop.weights" in arrays:
            return self._preserving_loss(arrays, constants, x_t, sigmas, target, weights) / count
        # σ stays fp32: ComfyUI's samplers hand the model an fp32 timestep, so training must too.
        prediction = self.forward(self.model, x_t.astype(self.dtype), sigmas, arrays["context"], extras)
        # Loss in fp32: per-sample mean, weighted, batch mean; divided over the micro-batches.
        squared = mx.square(prediction.astype(mx.float32) - target)
        if "mask" in arrays:
            squared = squared * arrays["mask"]
        per_sample = mx.mean(squared.reshape(x0.shape[0], -1), axis=1)
        return mx.mean(per_sample * weights) / count

    def _preserving_loss(self, arrays, constants, x_t, sigmas, target, weights) -> mx.array:
        """Differential output preservation, as the torch backend's: the base model's prediction on the
        class-word captions (LoRA layers off their parents while traced, no gradient) is the target of
        the LoRA's, from one forward of the rows and their class-word rows."""
        x_in, rows = x_t.astype(self.dtype), x_t.shape[0]
        with self.lora.disabled():
            base = self.forward(
                self.model, x_in, sigmas, arrays["dop.context"], self._extras(arrays, constants, "dop.")
            )
        base = mx.stop_gradient(base.astype(mx.float32))
        prediction = self.forward(
            self.model,
            mx.concatenate([x_in, x_in]),
            mx.concatenate([sigmas, sigmas]),
            arrays["joint.context"],
            self._extras(arrays, constants, "joint."),
        )
        prediction = prediction.astype(mx.float32)
        squared = mx.square(prediction[:rows] - target)
        if "mask" in arrays:  # masked training weighs the trained rows' cells; the preserved rows stay whole
            squared = squared * arrays["mask"]
        trained = mx.mean(squared.reshape(rows, -1), axis=1)  # [B]
        preserved = mx.mean(mx.square(prediction[rows:] - base).reshape(rows, -1), axis=1)  # [B]
        return mx.mean(trained * weights) + mx.mean(preserved * arrays["dop.weights"])

    def _compiled(self, function):
        # value_and_grad and checkpointing write the traced parameters into the model, so the
        # state is an output of the gradient function too, not only of the update.
        return mx.compile(function, inputs=self.state, outputs=self.state) if self.compile_step else function

    def _gradient_function(self, constants: dict, count: int):
        def gradients(arrays: dict, key: mx.array):
            self.lora.set_dropout_key(key)
            try:
                return self.loss_and_grad(arrays, constants, count)
            finally:
                self.lora.set_dropout_key(None)

        return self._compiled(gradients)

    def _clip_and_update(self, grads: dict, loss: mx.array) -> tuple[mx.array, mx.array]:
        grads, grad_norm = clip_global_norm(grads, self.cfg.max_grad_norm)
        # A NaN/inf loss or gradient keeps weights and optimizer state (moments, step) as they were:
        # selected inside the graph (MLX arrays are immutable, so the old ones are the backup); no host read.
        finite = mx.isfinite(loss) & mx.isfinite(grad_norm)
        before_state = tree_map(lambda value: value, self.optimizer.state)
        before = tree_map(lambda _, param: param, grads, self.model.parameters())
        updated = self.optimizer.apply_gradients(grads, self.model)
        self.model.update(tree_map(lambda new, old: mx.where(finite, new, old), updated, before))
        _select_in_place(self.optimizer.state, before_state, finite)
        return grad_norm, finite

    def step(self, micro_batches, lr: float) -> StepStats:
        self.optimizer.learning_rate = lr  # an mx.array in the optimizer state: no recompile
        keys = mx.random.split(self.key, len(micro_batches) + 1)
        self.key = keys[0]
        total, grads = mx.zeros((), mx.float32), None
        for index, batch in enumerate(micro_batches):
            arrays, constants = self._inputs(batch)
            signature = (
                tuple((k, v.shape, str(v.dtype)) for k, v in arrays.items()),
                repr(sorted(constants.items())),
                len(micro_batches),
            )
            if signature not in self.compiled:
                self.compiled[signature] = self._gradient_function(constants, len(micro_batches))
            loss, micro_grads = self.compiled[signature](arrays, keys[index + 1])
            total = total + loss
            grads = micro_grads if grads is None else _add_trees(grads, micro_grads)
        grad_norm, self.finite = self.update(grads, total)
        pending_ema = list(self.ema.shadow.values()) if self.ema is not None else []
        mx.eval(self.state, total, grad_norm, self.finite, self.key, pending_ema)
        return StepStats(loss=total, grad_norm=grad_norm, finite=self.finite)

    def eval_loss(self, batches) -> float:
        rows = [len(batch.sigmas) for batch in batches]
        with self.sampling():  # outside a step the LoRA branches draw no dropout
            losses = [self._micro_loss(*self._inputs(batch), 1) for batch in batches]
            mx.eval(losses)
        return float(np.dot(self.scalars(losses), rows) / sum(rows))

    def update_ema(self) -> None:
        if self.ema is not None:
            self.ema.update(self.lora.parameters(), getattr(self, "finite", None))

    def scalars(self, values) -> list[float]:
        if not values:
            return []
        return np.array(mx.stack([mx.array(v).astype(mx.float32).reshape(()) for v in values])).tolist()

    # --- state in and out (numpy, keyed by ComfyUI module path) ------------------
    def lora_state(self) -> dict[str, LoraWeights]:
        """LoraWeights per module (AdapterWeights for adapter lokr/loha/dora)."""
        return {path: layer.weights() for path, layer in self.lora.layers.items()}

    def load_lora_state(self, lora: dict[str, LoraWeights]) -> None:
        missing = sorted(set(self.lora.layers) - set(lora))
        if missing:
            raise ValueError(f"LoRA state lacks {len(missing)} module(s), e.g. {missing[:3]}")
        for path, layer in self.lora.layers.items():
            layer.load(lora[path], path)

    def ema_state(self) -> dict[str, np.ndarray]:
        return {} if self.ema is None else {saved_name(name): v for name, v in self.ema.state().items()}

    def load_ema_state(self, tensors: dict[str, np.ndarray]) -> None:
        if self.ema is not None and tensors:
            self.ema.load_state({parameter_name(k): v for k, v in tensors.items()})

    def optimizer_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Tensors keyed '<param name>.<state key>'; step and learning rate as JSON-able meta."""
        return state_out(self.optimizer, list(self.lora.parameters()), self.cfg.optimizer)

    def load_optimizer_state(self, tensors, meta) -> None:
        state_in(self.optimizer, list(self.lora.parameters()), self.cfg.optimizer, tensors, meta)

    def rng_state(self) -> dict[str, np.ndarray]:
        return {"mlx_key": np.array(self.key)}

    def load_rng_state(self, tensors: dict[str, np.ndarray]) -> None:
        if "mlx_key" in tensors:
            self.key = mx.array(np.asarray(tensors["mlx_key"], dtype=np.uint32))

    # --- inference helpers --------------------------------------------------------
    @contextmanager
    def ema_weights(self):
        if self.ema is None:
            yield
            return
        trained = self.lora.parameters()  # MLX arrays are immutable: references are the backup
        self.lora.set_parameters(self.ema.shadow)
        try:
            yield
        finally:
            self.lora.set_parameters(trained)

    @contextmanager
    def sampling(self):
        """For validation samples: EMA weights swapped in (when on). LoRA dropout only runs inside a step."""
        with self.ema_weights():
            yield

    def plan(self) -> list[str]:
        """A Mac's GPU shares the host's memory: the whole model sits in it (base_quantize stores it smaller)."""
        return [f"memory plan: the whole model in unified memory (base_quantize {self.cfg.base_quantize})"]

    def trainable_parameter_count(self) -> int:
        return self.lora.parameter_count()

    def peak_memory_bytes(self) -> int:
        return int(mx.get_peak_memory())

    def teardown(self) -> None:
        """Base layers back on their parents, blocks their own class, frozen flags as they were."""
        restore_memory_limits(getattr(self, "limits", None))
        self.limits = None
        if getattr(self, "checkpointing", None) is not None:
            self.checkpointing.remove()
        self.checkpointing = None
        if getattr(self, "lora", None) is not None:
            self.lora.remove()
        for module, no_grad in getattr(self, "frozen", []):
            module._no_grad.clear()
            module._no_grad.update(no_grad)
        # Compiled functions hold the optimizer state: let it all go (memory returns after the run).
        self.frozen, self.compiled, self.update, self.state, self.optimizer = [], {}, None, None, None


def _select_in_place(tree, before, keep_new: mx.array) -> None:
    """Every array leaf of `tree` becomes where(keep_new, leaf, before's leaf), in place: a compiled
    step holds the optimizer's own state containers."""
    for key in range(len(tree)) if isinstance(tree, list) else list(tree):
        value = tree[key]
        if isinstance(value, (dict, list)):
            _select_in_place(value, before[key], keep_new)
        elif isinstance(value, mx.array):
            tree[key] = mx.where(keep_new, value, before[key])


def _add_trees(a, b):
    if isinstance(a, dict):
        return {k: _add_trees(a[k], b[k]) for k in a}
    if isinstance(a, (list, tuple)):
        return type(a)(_add_trees(x, y) for x, y in zip(a, b))
    return a + b
