"""Optimizers as a dict registry, global-norm clipping as one batched reduction.

Every registry entry takes the same flat values, (params, lr, betas, eps, weight_decay, device), and
uses those its optimizer has; the backend reads them off the config."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np
import torch

from ...config import OPTIMIZER_NAMES


class OptimizerUnavailable(RuntimeError):
    """The chosen optimizer needs a package that is not installed; says which and what to pick instead."""


Betas = tuple[float, float]
log = logging.getLogger("kiln")

# The pinned versions the tests run (pyproject's test extra); the error gives the command that installs them.
PACKAGES = {
    "bitsandbytes": "bitsandbytes",
    "prodigyopt": "prodigyopt",
    "lion_pytorch": "lion-pytorch==0.2.5",
    "came_pytorch": "came-pytorch==0.1.3",
    "schedulefree": "schedulefree==1.4.1",
    "torchao": "torchao==0.18.0",
}


def _package(module: str, optimizer: str):
    """The optimizer's package, imported when it is chosen (none of them loads with the trainer)."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise OptimizerUnavailable(
            f"optimizer {optimizer!r} needs the {module} package: pip install {PACKAGES[module]} "
            "(in ComfyUI's Python), or choose optimizer 'adamw'"
        ) from err


def _adamw(params, lr: float, betas: Betas, eps: float, weight_decay: float, device: torch.device):
    # fused on CUDA (one kernel for all tensors); foreach elsewhere.
    fused = device.type == "cuda"
    return torch.optim.AdamW(
        params,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        fused=fused or None,
        foreach=None if fused else True,
    )


def adamw8bit_fallback(device: torch.device) -> str | None:
    """Why bitsandbytes' 8-bit AdamW cannot run on `device` (adamw8bit then trains as fp32 AdamW), or None: the one
    predicate the optimizer and the memory plan (levers.estimated_step_bytes) share."""
    if device.type != "cuda":
        return "runs on CUDA only"
    try:
        import bitsandbytes

        bitsandbytes.optim.AdamW8bit  # noqa: B018 — present only in a build that loaded
    except Exception as err:  # noqa: BLE001 — missing, or present without a usable CUDA build (it raises many kinds)
        return f"is not usable here ({type(err).__name__}: {str(err)[:120]})"
    return None


def optimizer_that_runs(name: str, device: torch.device) -> str:
    """The optimizer whose state a run of `name` on `device` keeps: adamw where adamw8bit falls back."""
    return "adamw" if name == "adamw8bit" and adamw8bit_fallback(device) else name


def _adamw8bit(params, lr: float, betas: Betas, eps: float, weight_decay: float, device: torch.device):
    # Falls back rather than fails: a LoRA's fp32 AdamW state is small (~0.3 GB for Klein 4B at rank 32), so a
    # workflow made on an NVIDIA card still trains on a Mac or CPU; the one log line says so.
    reason = adamw8bit_fallback(device)
    if reason is None:
        try:
            import bitsandbytes

            return bitsandbytes.optim.AdamW8bit(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        except Exception as err:  # noqa: BLE001 — loaded, yet its optimizer refuses these parameters
            reason = f"is not usable here ({type(err).__name__}: {str(err)[:120]})"
    state_mb = 8 * sum(p.numel() for p in params) / 2**20
    log.warning(
        "[Kiln] optimizer adamw8bit: bitsandbytes %s on %s; training with fp32 AdamW instead (its state is "
        "%.0f MB for this LoRA; pip install bitsandbytes on an NVIDIA GPU for the 8-bit one)",
        reason,
        device.type,
        state_mb,
    )
    fallback = _adamw(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, device=device)
    fallback.kiln_fell_back = "adamw8bit"  # its checkpoints say so: their state is fp32 AdamW's, not 8-bit
    return fallback


def _adafactor(params, lr: float, betas: Betas, eps: float, weight_decay: float, device: torch.device):
    return torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay, foreach=True)


def _prodigy(params, lr: float, betas: Betas, eps: float, weight_decay: float, device: torch.device):
    prodigy = _package("prodigyopt", "prodigy")
    return prodigy.Prodigy(params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)


def _lion(params, lr: float, betas: Betas, eps: float, weight_decay: float, device: torch.device):
    # lion-pytorch's weight decay is decoupled (p *= 1 - lr * wd), as AdamW's; no eps (sign updates)
    return _package("lion_pytorch", "lion").Lion(params, lr=lr, betas=betas, weight_decay=weight_decay)


def _came(params, lr: float, betas: Betas, eps: float, weight_decay: float, device: torch.device):
    # CAME's third beta (its confidence average) and its two epsilons keep the paper's values: adam_eps is
    # scaled for Adam's denominator, not for CAME's factored statistics
    came = _package("came_pytorch", "came")
    return came.CAME(params, lr=lr, betas=(*betas, 0.9999), weight_decay=weight_decay)


def _schedulefree(params, lr: float, betas: Betas, eps: float, weight_decay: float, device: torch.device):
    # its own warmup stays 0: the loop's constant schedule with warmup_steps scales the lr it reads each step,
    # which is what its warmup does (checks.py keeps lr_schedule constant)
    schedulefree = _package("schedulefree", "schedulefree")
    return schedulefree.AdamWScheduleFree(
        params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, warmup_steps=0, foreach=True
    )


def _adamw8bit_torchao(params, lr: float, betas: Betas, eps: float, weight_decay: float, device: torch.device):
    _package("torchao", "adamw8bit_torchao")
    return importlib.import_module("torchao.optim").AdamW8bit(
        params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
    )


OPTIMIZERS: dict[str, Callable] = {
    "adamw": _adamw,
    "adamw8bit": _adamw8bit,
    "adafactor": _adafactor,
    "prodigy": _prodigy,
    "lion": _lion,
    "came": _came,
    "schedulefree": _schedulefree,
    "adamw8bit_torchao": _adamw8bit_torchao,
}
assert tuple(OPTIMIZERS) == OPTIMIZER_NAMES, "config.OPTIMIZER_NAMES and the torch registry must agree"


def build_optimizer(
    params: list[torch.nn.Parameter],
    name: str,
    *,
    lr: float,
    betas: Betas,
    eps: float,
    weight_decay: float,
    device: torch.device,
):
    return OPTIMIZERS[name](params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, device=device)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The step's learning rate; torchao keeps it as a tensor (its compiled step would recompile on a float)."""
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


@contextmanager
def training_mode(optimizer):
    """Schedule-free optimizers keep two points: train() puts the one gradients are taken at into the parameters,
    eval() the averaged one samples and saves should see. Only a step is in train mode, so validation, the
    held-out loss, the EMA and every saved LoRA or checkpoint read the averaged weights; others pass through."""
    if not callable(getattr(optimizer, "train", None)):
        yield
        return
    optimizer.train()
    try:
        yield
    finally:
        optimizer.eval()


@torch.no_grad()
def clip_global_norm(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Total L2 norm of all grads (a device scalar, no host sync); scales them to max_norm if above.

    Per-tensor norms come from one foreach kernel and are stacked into one
    reduction: no Python loop that chains hundreds of small ops. Same result as
    torch.nn.utils.clip_grad_norm_ (eps 1e-6). max_norm 0 only measures.
    """
    if not grads:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if max_norm > 0:
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coefficient)
    return total


def optimizer_arrays(optimizer: torch.optim.Optimizer, names: list[str]):
    """The optimizer's state as tensors keyed '<param name>.<state key>' (`names` in parameter order);
    everything else as JSON-able meta. A quantized state (torchao's 8-bit moments) is kept as its inner tensors,
    '<param name>.<state key>~<inner>', and the class and values that rebuild it in meta["packed"]."""
    index_to_name = dict(enumerate(names))
    state = optimizer.state_dict()
    tensors, scalars, packed = {}, {}, {}
    for index, entries in state["state"].items():
        name = index_to_name[index]
        for key, value in entries.items():
            if _is_packed(value):
                inner, context = value.__tensor_flatten__()
                tensors.update({f"{name}.{key}~{part}": _array(getattr(value, part)) for part in inner})
                packed[f"{name}.{key}"] = {"class": _class_path(value), "inner": inner, "context": _json(context)}
            elif torch.is_tensor(value):
                tensors[f"{name}.{key}"] = _array(value)
            else:
                scalars[f"{name}.{key}"] = value
    meta = {
        "param_groups": [{k: _json(v) for k, v in g.items() if k != "params"} for g in state["param_groups"]],
        "scalars": scalars,
        "names": list(names),
        **({"packed": packed} if packed else {}),  # absent for every other optimizer: their checkpoints as before
        **({"fell_back": optimizer.kiln_fell_back} if hasattr(optimizer, "kiln_fell_back") else {}),
    }
    return tensors, meta


def load_optimizer_arrays(optimizer: torch.optim.Optimizer, names: list[str], tensors, meta) -> None:
    """optimizer_arrays' output back into `optimizer`, whose parameters must be the same `names`."""
    if meta.get("names") != names:
        raise ValueError("optimizer state belongs to other LoRA parameters (targets or rank changed)")
    saved, here = meta.get("fell_back"), getattr(optimizer, "kiln_fell_back", None)
    if saved != here:  # adamw8bit ran as fp32 AdamW on one machine and as bitsandbytes' 8-bit one on the other
        kinds = {None: "bitsandbytes' 8-bit AdamW", "adamw8bit": "fp32 AdamW (adamw8bit's fallback off CUDA)"}
        raise ValueError(
            f"optimizer adamw8bit: this checkpoint's state is {kinds[saved]}'s, and here it builds {kinds[here]}; "
            "resume on the kind of machine the run was saved on (with or without bitsandbytes on CUDA)"
        )
    template = optimizer.state_dict()
    index_of = {name: index for index, name in enumerate(names)}
    state: dict[int, dict] = {}
    # Keys are '<param name>.<state key>'; state keys hold no dots.
    for key, array in tensors.items():
        if "~" not in key:
            name, entry = key.rsplit(".", 1)
            state.setdefault(index_of[name], {})[entry] = torch.from_numpy(np.array(array))
    for key, spec in meta.get("packed", {}).items():
        name, entry = key.rsplit(".", 1)
        state.setdefault(index_of[name], {})[entry] = _unpack(spec, {p: tensors[f"{key}~{p}"] for p in spec["inner"]})
    for key, value in meta["scalars"].items():
        name, entry = key.rsplit(".", 1)
        state.setdefault(index_of[name], {})[entry] = value
    groups = [
        {**{k: _like(group.get(k), v) for k, v in saved.items()}, "params": group["params"]}
        for saved, group in zip(meta["param_groups"], template["param_groups"])
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    _keep_saved_dtypes(optimizer, state)


def _keep_saved_dtypes(optimizer: torch.optim.Optimizer, saved: dict[int, dict]) -> None:
    """torch's load_state_dict casts floating state to its parameter's dtype; a full fine-tune's bf16 weights keep
    fp32 moments (their step runs on fp32 copies: full.round_bf16_updates), so each such tensor is put back as
    saved, not cast back from bf16 (a bf16 full run's resume met "expected dtype BFloat16" at its first step, and
    moments rounded to bf16 would end it elsewhere than the run that never stopped)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entries in saved.items():
        live = optimizer.state[params[index]]
        for entry, value in entries.items():
            held = live.get(entry)
            if torch.is_tensor(value) and torch.is_tensor(held) and not _is_packed(value) and held.dtype != value.dtype:
                live[entry] = value.to(held.device)  # plain: a sharded run cuts it after (shard_optimizer_state)


def _array(tensor: torch.Tensor) -> np.ndarray:
    if hasattr(tensor, "full_tensor"):  # a sharded full fine-tune's moment: gathered whole (every rank calls it)
        tensor = tensor.full_tensor()
    return tensor.detach().cpu().numpy()


def _is_packed(value) -> bool:
    subclass = torch.is_tensor(value) and type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__")
    return subclass and not hasattr(value, "device_mesh")  # a DTensor (sharded full run) is gathered whole instead


def _class_path(value) -> str:
    return f"{type(value).__module__}:{type(value).__qualname__}"


def _json(value):
    """A param group's or a packed state's value as JSON: a 0-d tensor (torchao's lr) as its float, a dtype by
    its name; lists and tuples item by item."""
    if torch.is_tensor(value):
        return value.item()
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        return [_json(item) for item in value]
    return value


def _from_json(value):
    if isinstance(value, dict) and set(value) == {"dtype"}:
        return getattr(torch, value["dtype"])
    return value


def _like(current, saved):
    """A saved group value in the type the live optimizer holds it (torchao's lr stays a tensor)."""
    if torch.is_tensor(current):
        return torch.tensor(saved, dtype=current.dtype)
    return tuple(saved) if isinstance(current, tuple) else saved


def _unpack(spec: dict, inner: dict[str, np.ndarray]) -> torch.Tensor:
    module, qualname = spec["class"].split(":")
    cls = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    parts = {name: torch.from_numpy(np.array(array)) for name, array in inner.items()}
    context = [_from_json(item) for item in spec["context"]]
    first = parts[spec["inner"][0]]
    return cls.__tensor_unflatten__(parts, context, first.shape, first.stride())
