"""Untrusted files: checkpoints, LoRAs and caches are read as safetensors or JSON only (never pickle),
and a damaged or altered one gives an error that names the file, the key and the fix."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from trainer import safetensors_io
from trainer.lora import files as lora_format
from trainer.run import state
from trainer.run.loop import train

ROOT = Path(__file__).resolve().parents[2]
UNPICKLING = re.compile(
    r"\bimport (pickle|dill|joblib|shelve|cloudpickle)\b|\bfrom (pickle|dill|joblib) import|"
    r"\bpickle\.\w|\btorch\.load\(|allow_pickle\s*=\s*True|\b(np|numpy)\.load\(|"
    r"weights_only\s*=\s*False"
)


def test_no_unpickling_anywhere_in_the_pack():
    sources = [*ROOT.glob("trainer/**/*.py"), *ROOT.glob("nodes/**/*.py"), ROOT / "headless.py", ROOT / "__init__.py"]
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sources
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if UNPICKLING.search(line)
    ]
    assert found == []


@pytest.fixture
def run_copy(tmp_path, make_model, make_data, make_config):
    """A real two-step run with EMA on: tiny, so each test gets its own copy to damage."""
    cfg = make_config(steps=2, checkpoint_every=2, ema=True)
    train(cfg, make_model(), make_data(), run_dir=tmp_path / "run")
    return tmp_path / "run", tmp_path / "run" / "step-000002", cfg


def _edit_state(folder: Path, change) -> None:
    tensors, metadata = safetensors_io.read(folder / "state.safetensors")
    dtypes = change(tensors) or None
    safetensors_io.write(folder / "state.safetensors", tensors, metadata, dtype=dtypes)


def _edit_info(folder: Path, change) -> None:
    info = json.loads((folder / "run.json").read_text())
    replaced = change(info)  # dict edits work in place; a list replaces the whole
    info = replaced if isinstance(replaced, list) else info
    (folder / "run.json").write_text(json.dumps(info))


QKV = "double_blocks.0.img_attn.qkv"


def _moment(tensors):
    return next(k for k in tensors if k.startswith(f"optim.{QKV}.lora_A.exp_avg"))


STATE_EDITS = {  # change → (key in the message, words in the message)
    "A as float16": (lambda t: {f"lora.{QKV}.A": "F16"}, f"lora.{QKV}.A", "float32"),
    "A 3-D": (lambda t: t.update({f"lora.{QKV}.A": t[f"lora.{QKV}.A"][None]}), f"lora.{QKV}.A", "2-D"),
    "alpha a vector": (
        lambda t: t.update({f"lora.{QKV}.alpha": np.ones(2, np.float32)}),
        f"lora.{QKV}.alpha",
        "scalar",
    ),
    "EMA wrong shape": (lambda t: t.update({f"ema.{QKV}.B": np.zeros((3, 3), np.float32)}), f"ema.{QKV}.B", "EMA copy"),
    "EMA as int": (lambda t: t.update({f"ema.{QKV}.A": t[f"ema.{QKV}.A"].astype(np.int32)}), f"ema.{QKV}.A", "float32"),
    "old-named EMA wrong shape": (
        lambda t: t.update({f"ema.{QKV}.lora_B": np.zeros((3, 3), np.float32)}),
        f"ema.{QKV}.lora_B",
        "EMA copy",
    ),
    "moment wrong shape": (
        lambda t: t.update({_moment(t): np.zeros((1, 1), np.float32)}),
        "exp_avg",
        "optimizer moment",
    ),
    "RNG as float": (
        lambda t: t.update({"rng.torch_cpu": t["rng.torch_cpu"].astype(np.float32)}),
        "rng.torch_cpu",
        "integer",
    ),
}


@pytest.mark.parametrize("case", STATE_EDITS, ids=list(STATE_EDITS))
def test_altered_state_tensors_are_refused_with_file_and_key(run_copy, case):
    run_dir, folder, _ = run_copy
    change, key, words = STATE_EDITS[case]
    _edit_state(folder, change)
    with pytest.raises(ValueError, match=re.escape(key)) as error:
        state.load_checkpoint(run_dir)
    message = str(error.value)
    assert str(folder / "state.safetensors") in message and words in message and "earlier checkpoint" in message


def test_a_checkpoint_whose_weights_do_not_fit_the_run_names_it(run_copy, make_model, make_data):
    run_dir, folder, cfg = run_copy

    def other_width(tensors):  # consistent in itself (LoRA, EMA, moments), but for a 7-wide layer
        for key in [k for k in tensors if f"{QKV}.A" in k or f"{QKV}.lora_A" in k]:
            if tensors[key].ndim == 2:
                tensors[key] = np.zeros((4, 7), np.float32)

    _edit_state(folder, other_width)
    with pytest.raises(ValueError, match=rf"{re.escape(str(folder))}: cannot resume.*{QKV}.lora_A.*shape") as error:
        train(cfg.__class__(**{**cfg.__dict__, "steps": 4}), make_model(), make_data(), run_dir=run_dir, resume=run_dir)
    assert "start a new run" in str(error.value)


INFO_EDITS = {
    "not JSON": (None, "unreadable run state"),
    "a list": (lambda i: [1, 2], "not a Kiln run state"),
    "other format": (lambda i: i.update(format="other/1"), "not a Kiln run state"),
    "no step": (lambda i: i.pop("step"), "'step' is NoneType, not int"),
    "step a string": (lambda i: i.update(step="2"), "'step' is str"),
    "step true": (lambda i: i.update(step=True), "'step' is bool"),
    "step of another folder": (lambda i: i.update(step=7), "says step 7 but its folder is step-000002"),
    "history without loss": (lambda i: i["history"].pop("loss") and None, "'history' needs loss"),
    "config a list": (lambda i: i.update(config=[]), "'config' is list"),
}


@pytest.mark.parametrize("case", INFO_EDITS, ids=list(INFO_EDITS))
def test_altered_run_json_is_refused_with_the_file(run_copy, case):
    run_dir, folder, _ = run_copy
    change, words = INFO_EDITS[case]
    if change is None:
        (folder / "run.json").write_text('{"format": "kiln-run/1", "step": ')
    else:
        _edit_info(folder, change)
    with pytest.raises(ValueError) as error:
        state.load_checkpoint(folder)
    assert str(folder / "run.json") in str(error.value) and words in str(error.value)


@pytest.mark.parametrize(
    "field,value",
    [("numpy_rng", {"bit_generator": "Nope"}), ("cursor", {"epoch": "x"}), ("optimizer", {"names": ["x"]})],
)
def test_damaged_resume_fields_are_named(run_copy, make_model, make_data, field, value):
    run_dir, folder, cfg = run_copy
    _edit_info(folder, lambda info: info.update({field: value}))
    with pytest.raises(ValueError, match=rf"{re.escape(str(folder))}: cannot resume this run"):
        train(cfg.__class__(**{**cfg.__dict__, "steps": 4}), make_model(), make_data(), run_dir=run_dir, resume=run_dir)


@pytest.mark.parametrize("cut", [4, 20, -1])
def test_a_truncated_state_file_is_named(run_copy, cut):
    _, folder, _ = run_copy
    path = folder / "state.safetensors"
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(safetensors_io.SafetensorsError) as error:
        state.load_checkpoint(folder)
    assert str(path) in str(error.value) and "re-download or re-save" in str(error.value)


def test_a_lora_file_with_integer_weights_is_refused(tmp_path):
    path = tmp_path / "odd.safetensors"
    safetensors_io.write(
        path,
        {
            "diffusion_model.x.lora_A.weight": np.ones((4, 8), np.int32),
            "diffusion_model.x.lora_B.weight": np.ones((8, 4), np.float32),
        },
    )
    with pytest.raises(
        ValueError, match=r"odd\.safetensors: diffusion_model\.x: A is int32, not a number of the right kind"
    ):
        lora_format.load_lora(path)
