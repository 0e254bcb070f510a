"""trainer/backends/torch_backend/streaming.py: the frozen base streamed through a ring of slots trains the
same gradients as a resident base, copies in the order the blocks run, and never refills a slot in use."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.backends.torch_backend.streaming import BlockStreamer, frozen_weights, plan


class Block(nn.Module):
    """A frozen two-layer block with a trainable low-rank branch, like a DiT block under a LoRA."""

    def __init__(self, width: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
            p.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(4, width, generator=g) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(width, 4, generator=g) * 0.1)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x))) + x @ self.lora_a.T @ self.lora_b.T


def blocks_of(count=5, width=16):
    return [Block(width, seed) for seed in range(count)]


def run(blocks, x, recompute: bool):
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
    return x


def grads(blocks, recompute: bool, steps: int = 2):
    """Trainable gradients of `steps` forward/backward passes (gradient accumulation), and a no-grad output."""
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(7))
    for _ in range(steps):
        run(blocks, x, recompute).square().mean().backward()
    with torch.no_grad():
        sampled = [run(blocks, x, False) for _ in range(2)]  # sampling twice: the ring wraps around
    return [p.grad.clone() for b in blocks for p in (b.lora_a, b.lora_b)], sampled


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("slots", [2, 3])
def test_streamed_blocks_train_the_same_gradients_and_sample_the_same(recompute, slots):
    expected, expected_samples = grads(blocks_of(), recompute)
    blocks = blocks_of()
    streamer = BlockStreamer(blocks, plan(blocks, list(range(5)), slots), "cpu")
    got, samples = grads(blocks, recompute)
    for a, b in zip(expected + expected_samples, got + samples):
        assert torch.equal(a, b)
    # the frozen weights live in the ring: 5 blocks' weights in `slots` buffers
    rings = {t.untyped_storage().data_ptr() for t in streamer.ring}
    assert all(p.untyped_storage().data_ptr() in rings for b in blocks for _, p in frozen_weights(b))
    streamer.remove()
    assert all(p.untyped_storage().data_ptr() not in rings for b in blocks for _, p in frozen_weights(b))
    assert torch.equal(grads(blocks, recompute)[1][0], expected_samples[0])


def test_copies_run_ahead_in_the_order_the_blocks_run():
    blocks, log = blocks_of(), []
    BlockStreamer(blocks, plan(blocks, list(range(5)), 3), "cpu", log=log)
    x = torch.randn(2, 16)
    run(blocks, x, recompute=True).sum().backward()
    events = [(kind, i) for kind, i in log]
    copies = [i for kind, i in events if kind == "copy"]
    # forward: 0, 1, 2 up front, then one block ahead of each use; the backward finds 2, 3, 4 in place and
    # copies 1, then 0, as it goes down; nothing is copied twice in a row
    assert copies == [0, 1, 2, 3, 4, 1, 0]
    uses = [(kind, i) for kind, i in events if kind != "copy"]
    assert uses == [("forward", i) for i in range(5)] + [("backward", i) for i in range(4, -1, -1)]
    # a copy is issued only into a slot whose block has run: before block j's use, j + 2 at most is on its way
    for n, (kind, i) in enumerate(events):
        if kind == "copy":
            used = [j for k, j in events[:n] if k == "forward"]
            assert not used or i <= max(used) + 2


def test_a_ring_smaller_than_two_slots_is_refused():
    blocks = blocks_of(2)
    with pytest.raises(ValueError, match="at least 2"):
        plan(blocks, [0, 1], 1)


def test_the_plan_counts_the_ring_and_the_host_copy():
    blocks = blocks_of(4, width=16)
    stream = plan(blocks, [1, 2, 3], 2)
    per_block = sum(p.numel() * p.element_size() for _, p in frozen_weights(blocks[0]))
    assert stream.slots == 2 and stream.slot_bytes >= per_block
    assert stream.gpu_bytes() == 2 * stream.slot_bytes < stream.streamed_bytes == 3 * stream.slot_bytes


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_run_with_streamed_blocks_trains_the_same_lora_and_gives_the_model_back(
    tmp_path, make_model, make_data, make_config, checkpointing, monkeypatch
):
    """stream_blocks through the whole loop (setup, steps, a checkpoint, teardown): bitwise the LoRA of the run
    without it, and the model as it came (its weights, no forward left behind)."""
    from trainer.backends.torch_backend import streaming
    from trainer.run.loop import train

    uses = []
    real_use = streaming.BlockStreamer.use
    monkeypatch.setattr(streaming.BlockStreamer, "use", lambda self, *a, **k: uses.append(a) or real_use(self, *a, **k))
    results, models = [], []
    for stream in (0, 2):
        model = make_model()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        cfg = make_config(steps=4, stream_blocks=stream, gradient_checkpointing=checkpointing, checkpoint_every=2)
        results.append(train(cfg, model, make_data(), run_dir=tmp_path / f"s{stream}"))
        assert all("forward" not in m.__dict__ for m in model.modules())
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        models.append(model)
    assert results[0].lora.keys() == results[1].lora.keys()
    for key, weights in results[0].lora.items():
        other = results[1].lora[key]
        assert np.array_equal(weights.A, other.A) and np.array_equal(weights.B, other.B), key
    assert any(np.abs(w.B).sum() > 0 for w in results[0].lora.values())  # it trained
    assert len(uses) >= 4 * 2 * 2  # and the second run streamed: 4 steps, 2 blocks, forward and backward


def test_stream_blocks_is_refused_for_mlx():
    from trainer.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match="stream_blocks is for backend 'torch'"):
        from_dict({"arch": "demo", "backend": "mlx", "stream_blocks": 2})


def test_spread_picks_evenly_spaced_blocks():
    from trainer.backends.torch_backend.streaming import spread

    assert spread(3, 6) == [1, 3, 5]
    assert spread(6, 4) == [0, 1, 2, 3]
    assert spread(1, 30) == [15]


def test_the_gate_keeps_an_output_that_needed_no_gradient_without_one():
    """A block returning (a trained tensor, a frozen one): the gate passes both on, the frozen one still needs no
    gradient, and the trained one's backward reaches the block."""

    class TwoOut(Block):
        def forward(self, x):
            return super().forward(x), x.detach() * 2

    blocks = [TwoOut(16, 0), TwoOut(16, 1)]
    BlockStreamer(blocks, plan(blocks, [0, 1], 2), "cpu")
    x = torch.randn(2, 16)
    y, frozen = blocks[0](x)
    assert not frozen.requires_grad and y.requires_grad
    y.sum().backward()
    assert blocks[0].lora_a.grad is not None


def test_a_weight_replaced_between_steps_is_taken_over_and_a_moved_one_is_refused():
    """ComfyUI re-patches a model after a validation sample by setting new Parameters (the right values): the
    stream takes the new one as its master, and the block computes with it. A weight whose data was moved off the
    ring under the stream (an unload mid-run) could hold another block's weights: refused, not trained on."""
    blocks = blocks_of(3)
    reference = blocks_of(3)
    BlockStreamer(blocks, plan(blocks, [0, 1, 2], 2), "cpu")
    x = torch.randn(2, 16)
    fresh = torch.randn(32, 16)
    blocks[1].up.weight = nn.Parameter(fresh.clone(), requires_grad=False)  # as comfy.utils.set_attr_param does
    reference[1].up.weight = nn.Parameter(fresh.clone(), requires_grad=False)
    with torch.no_grad():
        assert torch.equal(run(blocks, x, False), run(reference, x, False))
        assert blocks[1].up.weight.data_ptr() != fresh.data_ptr()  # it points into the ring again
    blocks[2].down.weight.data = blocks[2].down.weight.data.clone()  # moved under the stream
    with pytest.raises(RuntimeError, match="moved off the GPU ring"):
        run(blocks, x, False)
