"""Where a training step's GPU time goes: torch.profiler over a few steps, kernels grouped by kind.

Used by bench/gpu_train.py (`--profile N`): N steps after the timed ones are profiled (profiling adds
host overhead, so those steps are never in the timing). The summary, per profiled step:

    step_ms           wall time between the step boundaries (the harness syncs at each)
    busy_ms           time at least one kernel ran (union of kernel intervals)
    idle_pct          1 - busy / step: host work the GPU waited for (launches, batch assembly, the
                      step-boundary sync); the most CUDA graphs or a host running ahead could win back
    kinds_ms          kernel time per kind (KINDS below; sums overlap-free only on one stream)
    lora_gemm_ms      GEMM time of the LoRA branches (matmul ops with a rank-sized dimension)
    ops_ms            kernel time under a few named ops (NAMED_OPS: the NaN check, clipping, AdamW, copies)
    top               the 12 longest kernels (name cut at 90 chars, ms per step, calls per step)
    host_ms           the host's time inside profiled ops and CUDA runtime calls (self CPU time summed; the
                      Python between them is not in it)
    host_top          the 15 ops / runtime calls with the most self CPU time (ms per step, calls per step):
                      launches, dynamo's guard checks, autograd, ComfyUI's small ops
"""

from __future__ import annotations

import os
import re
import time

import torch

# First match wins; checked against the kernel's name. Inductor's kernels first (their names list the
# fused ops, e.g. "_to_copy"); attention before GEMM (cuDNN's and flash's kernels are GEMM-like too).
KINDS = {
    "fused (inductor)": re.compile(r"^triton_", re.I),
    "attention": re.compile(r"flash|fmha|sdpa|attention|attn", re.I),
    "gemm": re.compile(r"gemm|xmma|cutlass|nvjet|wgmma|cublas|splitk", re.I),
    "optimizer": re.compile(r"multi_tensor|adam|foreach", re.I),
    "copy": re.compile(r"memcpy|memset|copy", re.I),
    "elementwise / reduce": re.compile(r"elementwise|vectorized|reduce|unrolled|index|cat|norm|softmax", re.I),
}
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
# Ops whose own kernel time is reported by name: the NaN-skip check (isfinite), clipping's norm, the
# optimizer, host->device copies, and a bf16 full fine-tune's stochastic rounding (random_) and fp32 copies (_to_copy).
NAMED_OPS = (
    "aten::isfinite",
    "aten::_foreach_norm",
    "aten::linalg_vector_norm",
    "aten::_fused_adamw_",
    "aten::_foreach_mul_",
    "aten::copy_",
    "aten::random_",
    "aten::_to_copy",
)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS.items() if pattern.search(name)), "other")


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


class StepProfiler:
    """Profiles steps first..first+count-1 of a run; call on_step(step) at the end of every step."""

    def __init__(self, first: int, count: int, rank: int, device: torch.device):
        self.first, self.count, self.rank, self.device = first, count, rank, device
        self.profile = None
        self.wall = 0.0
        self.result: dict | None = None

    def on_step(self, step: int) -> None:
        if self.count <= 0 or self.device.type != "cuda":
            return
        if step == self.first - 1:
            torch.cuda.synchronize(self.device)
            self.profile = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                record_shapes=True,
            )
            self.profile.__enter__()
            self.started = time.perf_counter()
        elif step == self.first + self.count - 1 and self.profile is not None:
            torch.cuda.synchronize(self.device)
            self.wall = time.perf_counter() - self.started
            self.profile.__exit__(None, None, None)
            self.result = self.summarise()
            self.profile = None

    def summarise(self) -> dict:
        events = self.profile.events()
        # GPU-side ranges of record_function (e.g. inductor's "## Call CompiledFxGraph ... ##") are not kernels.
        kernels = [
            e
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith("## ")
        ]

        def ms(total_us: float) -> float:  # a total over the profiled steps → ms per step
            return round(total_us / 1e3 / self.count, 2)

        kinds: dict[str, float] = {}
        by_name: dict[str, list[float]] = {}
        for k in kernels:
            duration = k.time_range.end - k.time_range.start
            kinds[kind_of(k.name)] = kinds.get(kind_of(k.name), 0.0) + duration
            by_name.setdefault(k.name, []).append(duration)
        busy = _union_us([(k.time_range.start, k.time_range.end) for k in kernels])
        named = {op: 0.0 for op in NAMED_OPS}
        for avg in self.profile.key_averages():
            if avg.key in named:
                named[avg.key] = avg.device_time_total
        lora = 0.0
        for avg in self.profile.key_averages(group_by_input_shape=True):
            shapes = [dim for shape in (avg.input_shapes or []) if isinstance(shape, list) for dim in shape]
            if avg.key in MATMUL_OPS and self.rank in shapes:
                lora += avg.self_device_time_total
        top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[: int(os.environ.get("KILN_PROFILE_TOP", "12"))]
        host = [
            (avg.key, avg.self_cpu_time_total, avg.count)
            for avg in self.profile.key_averages()
            if avg.self_cpu_time_total > 0
        ]
        host_top = sorted(host, key=lambda item: -item[1])[:15]
        step_ms = self.wall * 1e3 / self.count
        return {
            "steps": self.count,
            "step_ms": round(step_ms, 2),
            "busy_ms": ms(busy),
            "idle_pct": round(100 * (1 - busy / 1e3 / self.count / step_ms), 1) if step_ms else None,
            "kinds_ms": {kind: ms(us) for kind, us in sorted(kinds.items(), key=lambda i: -i[1])},
            "lora_gemm_ms": ms(lora),
            "ops_ms": {op.removeprefix("aten::"): ms(us) for op, us in named.items()},
            "kernels_per_step": round(len(kernels) / self.count),
            "top": [[name[:90], ms(sum(times)), round(len(times) / self.count)] for name, times in top],
            "host_ms": ms(sum(us for _, us, _ in host)),
            "host_top": [[name[:90], ms(us), round(calls / self.count)] for name, us, calls in host_top],
        }
