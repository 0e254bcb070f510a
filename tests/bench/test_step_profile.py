"""bench/step_profile.py's bookkeeping: kernel kinds by name and busy time as a union of intervals."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import step_profile  # noqa: E402


def test_kernels_fall_into_their_kinds():
    names = {
        "pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128": "attention",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm",
        "void at::native::(anonymous namespace)::fused_adamw_kernel<...>": "optimizer",
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "fused (inductor)",
        "void at::native::vectorized_elementwise_kernel<4, ...>": "elementwise / reduce",
        "Memcpy HtoD (Pinned -> Device)": "copy",
        "some_custom_kernel": "other",
    }
    for name, kind in names.items():
        assert step_profile.kind_of(name) == kind, name


def test_busy_time_counts_overlaps_once():
    assert step_profile._union_us([]) == 0
    assert step_profile._union_us([(0, 10), (5, 15), (20, 30)]) == 25
    assert step_profile._union_us([(0, 100), (10, 20), (30, 40)]) == 100  # nested kernels on two streams


def test_host_time_is_summed_per_step_and_its_largest_ops_named():
    import torch

    profiler = step_profile.StepProfiler(first=1, count=2, rank=4, device=torch.device("cpu"))
    a, b = torch.randn(64, 64), torch.randn(64, 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(2):  # two "steps", 3 matmuls each
            for _ in range(3):
                a @ b
    profiler.profile, profiler.wall = profile, 0.01
    summary = profiler.summarise()
    top = {name: (ms, calls) for name, ms, calls in summary["host_top"]}
    assert top["aten::mm"][1] == 3  # calls per step, not over both
    assert 0 < top["aten::mm"][0] <= summary["host_ms"]
    assert summary["busy_ms"] == 0 and summary["kernels_per_step"] == 0  # no GPU kernels on a CPU
