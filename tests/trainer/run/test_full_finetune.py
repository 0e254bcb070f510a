"""Full fine-tune (adapter "full"): every block weight trains, resume is bitwise exact, the model goes back as it
came, the run writes a diffusion-model file, and extract turns it into a LoRA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer import config as config
from trainer import safetensors_io
from trainer.config import ConfigError
from trainer.lora.extract import extract
from trainer.lora.model_file import save_diffusion_model
from trainer.lora.tools import RankRule
from trainer.run.loop import train

from helpers.resume import assert_bitwise_resume


@pytest.fixture
def full_config(make_config):
    return make_config(
        adapter="full",
        steps=8,
        checkpoint_every=4,
        caption_dropout=0.3,
        ema=True,
        ema_decay=0.9,
        grad_accum=2,
        lr_schedule="cosine_with_warmup",
        warmup_steps=2,
        gradient_checkpointing=True,
        learning_rate=1e-3,
    )


def run(tmp_path, name, model, make_data, cfg, *, stop_at=None, resume=False):
    run_dir, progress = tmp_path / name, []
    stop = (lambda: len(progress) >= stop_at) if stop_at else None
    return train(
        cfg,
        model,
        make_data(),
        run_dir=run_dir,
        resume=run_dir if resume else None,
        on_step=progress.append,
        should_stop=stop,
    )


BLOCKS = ("double_blocks.", "single_blocks.")  # the demo arch's block_lists


def block_names(model) -> list[str]:
    return [name for name, _ in model.named_parameters() if name.startswith(BLOCKS)]


def test_every_block_weight_trains_and_the_model_comes_back(tmp_path, make_model, make_data, full_config):
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = run(tmp_path, "full", model, make_data, full_config)
    assert result.trainable_parameters == sum(p.numel() for n, p in model.named_parameters() if n.startswith(BLOCKS))
    assert result.lora == {} and result.model is not None and set(result.model) == set(before)
    for name in block_names(model):  # every block weight moved (EMA weights in the result)
        assert not np.array_equal(result.model[name], before[name].numpy()), name
    outside = [k for k in before if not k.startswith(BLOCKS)]
    assert outside and all(np.array_equal(result.model[k], before[k].numpy()) for k in outside)
    for name, tensor in model.state_dict().items():  # the model handed back is the base, bit for bit
        assert torch.equal(tensor, before[name]), name
    state, _ = safetensors_io.read(result.checkpoint / "state.safetensors")
    assert {f"full.{n}" for n in block_names(model)} <= set(state)


def test_resume_is_bitwise_exact(tmp_path, make_model, make_data, full_config):
    straight = run(tmp_path, "straight", make_model(), make_data, full_config)
    first = run(tmp_path, "stopped", make_model(), make_data, full_config, stop_at=3)
    assert first.stopped and first.step == 3
    resumed = run(tmp_path, "stopped", make_model(), make_data, full_config, resume=True)
    assert resumed.step == 8
    assert_bitwise_resume(straight, resumed, holds=("full.", "ema.", "optim."))
    assert all(np.array_equal(straight.model[k], resumed.model[k]) for k in straight.model)


def test_extract_at_full_rank_reproduces_the_delta(tmp_path, make_model, make_data, full_config):
    base_model = make_model()
    base = {k: v.float().numpy() for k, v in base_model.state_dict().items()}
    result = run(tmp_path, "full", base_model, make_data, config.replace(full_config, ema=False, steps=4))
    path = tmp_path / "tuned.safetensors"
    save_diffusion_model(path, result.model, dtype="fp32", metadata={})
    tuned, metadata = safetensors_io.read(path)
    assert metadata["kiln.kind"] == "diffusion_model"
    assert all(np.array_equal(tuned[k], result.model[k]) for k in result.model)
    lora, _ = extract(base, tuned, RankRule(rank=4096), svd="full")
    assert lora
    for path_, weights in lora.items():
        delta = tuned[f"{path_}.weight"] - base[f"{path_}.weight"]
        rebuilt = weights.B @ weights.A * (weights.alpha / weights.A.shape[0])
        assert np.allclose(rebuilt, delta, atol=1e-5 * max(1.0, float(np.abs(delta).max()))), path_


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"backend": "mlx"}, "backend 'torch' only"),
        ({"preservation_weight": 0.5, "preservation_class": "person"}, "preservation_weight to 0"),
        ({"base_quantize": "int8"}, "base_quantize to none"),
    ],
)
def test_full_refuses_what_it_cannot_train_with(make_config, overrides, named):
    with pytest.raises(ConfigError, match=named):
        make_config(adapter="full", **overrides)
