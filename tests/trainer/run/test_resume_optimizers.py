"""Each optimizer from its own package resumes exactly: N steps, a checkpoint, a resume, bitwise an unbroken run.

The state each one keeps is named (Lion's one moment, CAME's factored rows, schedule-free's z, torchao's 8-bit
codes), so a registry that quietly built AdamW instead would fail here."""

from __future__ import annotations

import logging

import pytest

from trainer.run import state

from helpers.resume import assert_bitwise_resume
from helpers.tiny_runs import train_until

# optimizer: (its package, settings it needs, a state tensor only it keeps: "optim.<param>.<this>")
OPTIMIZERS = {
    "lion": ("lion_pytorch", {"learning_rate": 3e-4, "adam_beta2": 0.99}, ".exp_avg"),
    "came": ("came_pytorch", {}, ".exp_avg_res_row"),
    "schedulefree": ("schedulefree", {"lr_schedule": "constant"}, ".z"),
    # rank 64: linear1's lora_B [160, 64] and linear2's lora_A [64, 96] reach torchao's 4096 entries, under which
    # it keeps fp32 moments; two targets only, as each new shape recompiles its step (the test's cost)
    "adamw8bit_torchao": ("torchao", {"rank": 64, "alpha": 64.0, "targets": ["linear1", "linear2"]}, ".exp_avg~codes"),
    "adamw8bit": (None, {}, ".exp_avg_sq"),  # on CPU: fp32 AdamW, said in the log
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_each_optimizer_resumes_bitwise(tmp_path, make_model, make_data, make_config, optimizer, caplog):
    package, settings, own_state = OPTIMIZERS[optimizer]
    if package:
        pytest.importorskip(package, reason=f"pip install -e '.[test]' installs {package}")
    # LoRA dropout (torch RNG), EMA, accumulation and a warm-up on, as in test_resume.py
    base = dict(steps=8, checkpoint_every=3, lora_dropout=0.1, ema=True, ema_decay=0.9, grad_accum=2, warmup_steps=2)
    cfg = make_config(optimizer=optimizer, **{**base, "lr_schedule": "cosine_with_warmup", **settings})
    with caplog.at_level(logging.WARNING, logger="kiln"):
        straight = train_until(tmp_path / "straight", make_model(), make_data(), cfg)
        first = train_until(tmp_path / "stopped", make_model(), make_data(), cfg, stop_at=3)
        assert first.stopped and first.step == 3
        resumed = train_until(tmp_path / "stopped", make_model(), make_data(), cfg, resume=True)
    assert resumed.step == 8
    tensors = assert_bitwise_resume(straight, resumed, holds=("ema.", "optim."))
    assert any(key.startswith("optim.") and key.endswith(own_state) for key in tensors), sorted(tensors)[:8]
    # what is not a tensor (step counts, schedule-free's weight sums, the lr) resumes as exactly
    infos = [state.load_checkpoint(run_dir).info["optimizer"] for run_dir in (straight.run_dir, resumed.run_dir)]
    assert infos[0] == infos[1]
    fallbacks = [r.getMessage() for r in caplog.records if "optimizer adamw8bit" in r.getMessage()]
    assert len(fallbacks) == (3 if optimizer == "adamw8bit" else 0)  # one line per run, saying why
    if fallbacks:
        assert "fp32 AdamW instead" in fallbacks[0] and "CUDA" in fallbacks[0]
