"""Gradient checkpointing over a model's block lists, by instance-forward override.

Each checkpointed block's activations are dropped after forward and recomputed in backward; only
block inputs stay alive. `skip` blocks at the end keep their activations (faster backward, more
memory). `compile` wraps each block in torch.compile (regional compilation: the blocks of one list
share their compiled code), with the checkpoint inside the compiled region, where it keeps the
attention outputs (selective checkpointing). `offload` moves the inputs a checkpointed block keeps to pinned
host memory until its backward (offload_activations; a compiled block is then compiled whole inside the
checkpoint). Removal restores every block exactly.
"""

from __future__ import annotations

import functools
import logging
import os
import types
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from ...run.faults import first_line
from ..base import checkpointed, restore_forward
from .offload import offloaded


class CompileFailed(RuntimeError):
    """torch.compile could not build the blocks on this machine (no Triton, no C++ compiler, a bug)."""


@contextmanager
def compile_errors_explained():
    """compile_blocks on a machine torch.compile cannot build for (no Triton, no C++ compiler): say so."""
    from torch._dynamo.exc import BackendCompilerFailed

    try:
        yield
    except BackendCompilerFailed as error:
        inner = getattr(error, "inner_exception", None) or error
        text = first_line(inner)
        # Flux2's blocks add into a tensor a norm has kept for backward (`x += ...` after `norm(x)`). Under
        # bf16 autocast on CUDA the norm keeps its fp32 cast instead, and the block traces; without (fp32,
        # or CPU autocast, which leaves norms in bf16) autograd refuses it while tracing.
        why = (
            "this model's blocks write into tensors autograd keeps for backward, which torch.compile traces "
            "only under bf16 autocast on a CUDA GPU: set mixed_precision to bf16 there, or turn compile_blocks "
            "off (or auto)"
            if "modified by an inplace operation" in text
            else "it needs Triton on CUDA or a C++ compiler on CPU"
        )
        raise CompileFailed(
            f"compile_blocks: torch.compile could not compile the model's blocks here "
            f"({type(inner).__name__}: {text[:300]}). Turn compile_blocks off (or auto) in Kiln "
            f"Training Options (or the config); {why}."
        ) from error


def find_blocks(model: nn.Module, block_lists: tuple[str, ...]) -> list[nn.Module]:
    """The blocks named by the arch; with no names, every top-level ModuleList."""
    if not block_lists:
        lists = [child for child in model.children() if isinstance(child, nn.ModuleList)]
    else:
        lists = []
        for name in block_lists:
            found = getattr(model, name, None)
            if not isinstance(found, nn.ModuleList):
                raise ValueError(
                    f"model has no block list {name!r} for gradient checkpointing; "
                    f"its ModuleLists are {[n for n, c in model.named_children() if isinstance(c, nn.ModuleList)]}"
                )
            lists.append(found)
    return [block for blocks in lists for block in blocks]


# Attention kernels whose outputs a compiled checkpointed block keeps instead of recomputing: one
# [B, L, D] output and a log-sum-exp, against recomputing 4·L²·D FLOPs (bench/RESULTS.md, lever
# "selective checkpointing"). Every SDPA backend torch may pick; the math fallback decomposes into
# matmuls and is recomputed.
SAVED_OPS = [
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
]

# torch.compile's inductor backend; tests swap in "aot_eager" (same graphs, no C++/Triton build).
COMPILE_BACKEND = "inductor"
# dynamo's own shape policy: static at the first shape, symbolic from the second (the run's other
# buckets then reuse that code). Measured on an H100 (bench/wall.py, 1,000 mixed-bucket steps): True
# (symbolic from the first call) compiled Z-Image once in 41 s instead of 43 + 23 s, Klein 4B in 65 s
# instead of 37 + 40 s, but a Klein run whose first batch held 3 images had not finished compiling
# after 170 s; so not yet (bench/RESULTS.md).
COMPILE_DYNAMIC = None
# Left at that policy, a run with several buckets compiles each block twice: static at the first shape,
# symbolic at the second (Klein 4B on an H100: 31 s, then 28 s, of a 223 s first run). MARK_TOKEN_DIMS
# marks the sequence dims of a compiled block's inputs dynamic from the first call (_mark_token_dims),
# which is what dynamo's second compile makes of them; batch and feature dims stay static. Measured on an
# H100 (bench/wall.py, 1,000 mixed-bucket steps, fresh caches): Klein 4B 226.5 → 209.0 s to the LoRA,
# Z-Image 280.6 → 268.1 s, steady steps unchanged (bench/RESULTS.md); False restores dynamo's policy.
MARK_TOKEN_DIMS = True


def _mark_token_dims(values) -> None:
    """Marks (maybe_mark_dynamic) the first dim of size L after the batch dim, and the dims of size L right
    after it, where L is the dim-1 size of a [B, L, D] input or the sum of them (Flux2's RoPE table spans
    image and text tokens), in every tensor input; a [B, L, D] input's feature dim never. Token counts,
    masks ([B, 1, L, L]: both) and RoPE tables follow the bucket; widths do not, even where one equals a
    token count (a RoPE table's [.., L, 1, 64, 2, 2] at L = 64)."""
    tensors = [v for v in values if torch.is_tensor(v) and v.dim() >= 2]
    lengths = {t.shape[1] for t in tensors if t.dim() == 3 and t.shape[1] > 1}
    if not lengths:
        return
    lengths.add(sum(lengths))
    for t in tensors:
        dims = range(1, t.dim() - 1 if t.dim() == 3 else t.dim())
        first = next((d for d in dims if t.shape[d] in lengths), None)
        for dim in dims if first is not None else ():
            if dim >= first:
                if t.shape[dim] not in lengths:
                    break
                torch._dynamo.maybe_mark_dynamic(t, dim)


def _copy_floats(value):
    return value.clone() if torch.is_tensor(value) and value.is_floating_point() else value


# inductor keeps what it compiled (FX graphs, AOTAutograd's graphs, Triton kernels, autotuning choices) under
# TORCHINDUCTOR_CACHE_DIR, by default in the temp folder, which most Linux systems empty at boot. A model's
# second run that finds them compiles in 18 s instead of 76 s (Klein 4B, H100, bench/RESULTS.md), so Kiln
# keeps them in the user's cache folder, as vLLM keeps its own (~/.cache/vllm/torch_compile_cache); a
# TORCHINDUCTOR_CACHE_DIR that is set wins, unless it is inductor's own default, which importing torch._dynamo
# writes into the variable (as ComfyUI's process has done long before a run starts).
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def _inductor_default() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return os.path.abspath(default_cache_dir())
    except Exception:  # noqa: BLE001 — another torch: any value set is then the user's
        return None


def compile_cache_folder(environ=os.environ) -> Path:
    """Where Kiln's compiled blocks are cached: %LOCALAPPDATA%\\kiln\\torch_compile on Windows, else
    $XDG_CACHE_HOME/kiln/torch_compile (~/.cache/kiln/torch_compile)."""
    if os.name == "nt" and environ.get("LOCALAPPDATA"):
        home = Path(environ["LOCALAPPDATA"])
    else:  # the XDG spec: a relative XDG_CACHE_HOME is ignored
        xdg = environ.get("XDG_CACHE_HOME", "")
        home = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return home / "kiln" / "torch_compile"


def keep_compiled(environ=os.environ) -> str | None:
    """Points inductor's cache at compile_cache_folder() unless TORCHINDUCTOR_CACHE_DIR is set (to anything but
    inductor's default) or the folder cannot be written (a read-only home: inductor's temp folder then, as
    before). The folder, or None."""
    chosen, default = environ.get(CACHE_ENV), _inductor_default()
    if COMPILE_BACKEND != "inductor" or (chosen and os.path.abspath(chosen) != default):
        return None
    try:
        folder = compile_cache_folder(environ)
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            return None
    except (OSError, RuntimeError, KeyError):  # RuntimeError, KeyError: Path.home() without a home
        return None
    environ[CACHE_ENV] = str(folder)
    # inductor writes TRITON_CACHE_DIR (its folder's triton/<device>) at its first Triton kernel, in this process
    # and in each compile worker; one written before (another node's compile) would keep the kernels in the temp
    # folder. Set anew, it reaches the workers too (each job carries it; a removed one would not reach them).
    triton = environ.get("TRITON_CACHE_DIR")
    if default and triton and os.path.abspath(triton).startswith(default + os.sep):
        environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    logging.getLogger("kiln").info(
        "[Kiln] compiled blocks are cached in %s (a later run of the same model and "
        "settings compiles from it; set %s to move it)",
        folder,
        CACHE_ENV,
    )
    return str(folder)


# Dynamo keeps compiled graphs on the traced function's code object and does not guard on settings
# read outside the traced code (the memory budget, the attention kernel, the kept ops). Measured on an
# H100: a second run on the same MODEL with another checkpoint_budget reused the first run's graphs
# (no compile, the first budget's memory). So each settings key gets code objects of its own: a run
# with other settings compiles anew, a run with the same settings (a re-queue, a resume) reuses.
_CODES: dict[tuple, types.CodeType] = {}


def _compiled(fn, key: str, cuda_graphs: bool = False):
    """torch.compile of a copy of `fn` whose code object is shared only by calls with the same key.
    `cuda_graphs`: inductor's "reduce-overhead" mode records each compiled graph (forward and backward, per
    shape) as a CUDA graph and replays it, one launch instead of one per kernel (the loop marks each step's
    start: backend.step)."""
    code = _CODES.setdefault((fn.__code__, f"{key}|graphs={cuda_graphs}"), fn.__code__.replace())
    twin = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return torch.compile(
        twin, backend=COMPILE_BACKEND, dynamic=COMPILE_DYNAMIC, mode="reduce-overhead" if cuda_graphs else None
    )


def _budgeted(compiled, budget: float):
    """Calls of a compiled block under torch's activation memory budget: when the block compiles, the
    min-cut partitioner keeps `budget` of its activation memory and recomputes the rest, choosing what
    is cheapest to recompute per byte (pointwise ops first, matmuls and attention last)."""
    config = torch._functorch.config

    def call(*args, **kwargs):
        if config.activation_memory_budget == budget:  # budget 1, torch's default: no patch per block call
            return compiled(*args, **kwargs)
        with config.patch(activation_memory_budget=budget):
            return compiled(*args, **kwargs)

    return call


def _wrapped(
    block_forward,
    recompute: bool,
    compile: bool = False,
    budget: float = 0.0,
    key: str = "",
    pure: bool = False,
    cuda_graphs: bool = False,
    offload: bool = False,
):
    """The block's forward under training: eager (recomputed, or keeping its residuals) or compiled; `offload`
    (recomputed, eager): its kept inputs on the host."""
    fresh_inputs = _on_copies(block_forward)
    if offload and recompute:
        # compiled whole inside the checkpoint (one block's activations live at a time, in its recompute); a pure
        # block's copies are made inside the compiled region (see _compiled_training)
        kept = _whole(block_forward) if pure else fresh_inputs
        training = offloaded(_compiled(kept, f"{key}|offload|pure={pure}") if compile else fresh_inputs)
    elif compile:
        training = _compiled_training(block_forward, fresh_inputs, recompute, budget, key, pure, cuda_graphs)
    else:
        training = _checkpointed(fresh_inputs) if recompute else _keeping_residuals(block_forward)

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return block_forward(*args, **kwargs)
        if compile and MARK_TOKEN_DIMS:
            _mark_token_dims([*args, *kwargs.values()])
        return training(*args, **kwargs)

    return forward


def _whole(block_forward):
    """A plain function around a (bound) forward: _compiled copies its code object, which a method's would not bind."""

    def whole(*args, **kwargs):
        return block_forward(*args, **kwargs)

    return whole


def _on_copies(block_forward):
    # ComfyUI's Flux2 blocks add into their own inputs (`img += ...`), which autograd (and the
    # checkpoint's recompute) still needs: a block under training works on copies (transient memory).
    def fresh_inputs(*args, **kwargs):
        return block_forward(*map(_copy_floats, args), **{k: _copy_floats(v) for k, v in kwargs.items()})

    return fresh_inputs


def _keeping_residuals(block_forward):
    def keep_residuals(*args, **kwargs):
        # No recompute: tensors autograd saves from the block's own inputs (e.g. a norm's input)
        # are copied when saved, because `x += ...` later in the block overwrites them. The
        # checkpointed path needs no copy: its recompute stops before the in-place add.
        args, kwargs = list(map(_copy_floats, args)), {k: _copy_floats(v) for k, v in kwargs.items()}
        inputs = {_storage(t) for t in [*args, *kwargs.values()] if torch.is_tensor(t) and t.is_floating_point()}
        inputs.discard(None)

        def pack(t):
            return t.clone() if _storage(t) in inputs else t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return block_forward(*args, **kwargs)

    return keep_residuals


def _checkpointed(fresh_inputs, **options):
    """The block under torch.utils.checkpoint: its inputs kept, the rest recomputed in backward."""

    def recomputed(*args, **kwargs):
        return checkpoint(fresh_inputs, *args, use_reentrant=False, **options, **kwargs)

    return recomputed


def _compiled_training(block_forward, fresh_inputs, recompute, budget, key, pure, cuda_graphs):
    # As torchtitan does: the checkpoint goes inside the compiled region, so the recompute is
    # compiled too and the partitioner keeps the attention outputs (SAVED_OPS). Eager, that
    # policy's per-op dispatch cost more than it saved (bench/RESULTS.md).
    keep_attention = functools.partial(create_selective_checkpoint_contexts, list(SAVED_OPS))
    key = f"{key}|saved={sorted(str(op) for op in SAVED_OPS)}|pure={pure}"

    whole = _whole(block_forward)
    # A block compiled whole (it keeps its activations, or the partitioner chooses within a budget)
    # is made pure first: a block that writes into its inputs (Flux2's `img += ...`) gets copies of
    # them inside the compiled region, where functionalisation turns the writes into new tensors.
    # Compiled as it was, with the writes on the graph's own inputs, such a block gave NaNs and an
    # illegal memory access on an H100 (bench/RESULTS.md).
    kept = whole if pure else fresh_inputs
    if recompute and budget > 0:
        # Compiled whole, without torch.utils.checkpoint: the partitioner decides what to
        # recompute within the budget (checkpoint_budget).
        return _budgeted(_compiled(kept, f"{key}|budget={budget!r}", cuda_graphs), budget)
    if not recompute:
        return _compiled(kept, key, cuda_graphs)
    recomputed = _checkpointed(fresh_inputs, context_fn=keep_attention) if SAVED_OPS else _checkpointed(fresh_inputs)
    return _compiled(recomputed, key, cuda_graphs)


class BlockCheckpointing:
    """`recompute=False` keeps only the input copies: gradient checkpointing off, still safe for
    blocks that write into their inputs."""

    def __init__(
        self,
        model: nn.Module,
        block_lists: tuple[str, ...],
        recompute: bool = True,
        *,
        skip: int = 0,
        compile: bool = False,
        pure_blocks: bool = False,
        budget: float = 0.0,
        compile_key: str = "",
        cuda_graphs: bool = False,
        offload: bool = False,
    ):
        """`compile` compiles every block; `pure_blocks` False (blocks that write into their inputs, Flux2)
        gives each block compiled whole copies of its inputs first. `budget` > 0 (compiled blocks): a
        recomputed block keeps that share of its activation memory, chosen by the compiler, instead of
        only its input. `compile_key` names the caller's settings that compiled graphs bake in (the
        attention kernel)."""
        if budget > 0 and not compile:
            raise ValueError("checkpoint_budget needs compile_blocks (the compiler chooses what to keep)")
        if offload and (budget > 0 or cuda_graphs):
            raise ValueError(
                "offload_activations recomputes each block from its input: no checkpoint_budget, no CUDA graphs"
            )
        self.recompute = recompute
        self.blocks = find_blocks(model, block_lists)
        self.previous = []
        plan = checkpointed(len(self.blocks), recompute, skip)
        if compile:
            # The blocks of a list share compiled code; its cache holds one entry per block kind,
            # grad mode, first-block input and bucket shape (then dims turn dynamic): above torch's 8.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            keep_compiled()
        for block, recomputed in zip(self.blocks, plan):
            self.previous.append(block.__dict__.get("forward"))
            block.forward = _wrapped(
                block.forward, recomputed, compile, budget, compile_key, pure_blocks, cuda_graphs, offload
            )

    def remove(self) -> None:
        for block, previous in zip(self.blocks, self.previous):
            restore_forward(block, previous)
        self.blocks, self.previous = [], []


def _storage(t: torch.Tensor) -> int | None:
    """The address of a tensor's storage; None for a tensor subclass that has none (ComfyUI's quantized
    fp8 weights, comfy-kitchen's QuantizedTensor): never one of a block's inputs."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
