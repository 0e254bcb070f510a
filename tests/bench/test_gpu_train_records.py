"""bench/gpu_train.py's memory figures on a CPU: the bytes a block stream copies per step (counted where the
streamer copies) and the issue's verdict on a capped row against its uncapped run."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_train  # noqa: E402

from trainer.backends.torch_backend import streaming  # noqa: E402


def test_streamed_bytes_counts_each_copy_of_a_step():
    """Four streamed blocks through two slots: forward copies all four, backward (reversed) finds the last one
    or two still in place; the count is each copy's bytes, and the wrapper comes off."""
    torch.manual_seed(0)
    blocks = [nn.Linear(16, 16) for _ in range(4)]
    for block in blocks:
        block.requires_grad_(False)
    block_bytes = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    counter = gpu_train.StreamedBytes(streaming)
    try:
        streamer = streaming.BlockStreamer(blocks, streaming.plan(blocks, [0, 1, 2, 3], 2), "cpu")
        log = []
        streamer.log = log
        x = torch.randn(2, 16, requires_grad=True)
        for step in range(2):
            counter.mark()
            y = x
            for block in blocks:
                y = block(y)
            y.sum().backward()
        counter.mark()
        streamer.remove()
    finally:
        counter.remove()
    assert streaming.BlockStreamer._load is counter.original
    copies = [entry for entry in log if entry[0] == "copy"]
    assert counter.total == len(copies) * block_bytes > 0
    per_step = counter.per_step_gib(warmup=1)
    assert per_step == round((counter.at_steps[2] - counter.at_steps[1]) / gpu_train.GIB, 3)


def _record(**changes):
    record = dict(
        kiln_s_per_step=1.0,
        uncapped_s_per_step=0.5,
        h2d_gb_per_step=20.0,
        h2d_gbps=20.0,
        kiln_loss_curve=[2.0, 1.9],
        uncapped_loss_curve=[2.0, 1.9019],
        peak_reserved_gb=11.0,
        memory_cap_gb=11.3,
    )
    return {**record, **changes}


def test_the_target_is_the_larger_of_the_uncapped_step_and_the_copies():
    verdict = gpu_train.against_uncapped(_record())
    assert verdict["streaming_s_per_step"] == 1.0 and verdict["target_s_per_step"] == 1.15
    assert verdict["within_target"] and verdict["loss_rel_diff_vs_uncapped"] == 0.001
    assert not gpu_train.against_uncapped(_record(kiln_s_per_step=1.2))["within_target"]
    assert not gpu_train.against_uncapped(_record(peak_reserved_gb=11.5))["within_target"]  # outside the card
    compute_bound = gpu_train.against_uncapped(_record(h2d_gb_per_step=1.0, uncapped_s_per_step=0.95))
    assert compute_bound["target_s_per_step"] == 1.0925 and compute_bound["within_target"]
    assert not gpu_train.against_uncapped(_record(uncapped_s_per_step=None))["within_target"]  # uncapped failed
