"""The checks behind config.from_dict: each value's type and bounds, sample prompts, settings wrong together.

They read the tables fields.py derives from the declarations; build.py calls them, so the import graph has one
direction.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from typing import Any

from ..archs import ARCHS
from ..lora import adapters
from ..objective.flow import parse_sigma_range
from .declaration import AUTO, ConfigError
from .fields import AUTO_FIELDS, BOUNDS, CHOICES, KIND, TrainConfig
from .optimiser import MLX_OPTIMIZER_NAMES
from .prompts import PROMPT_FLAGS, PROMPT_KEYS

_KINDS = {
    "str": str,
    "int": int,
    "float": float,
    "bool": bool,
    "list[str]": list,
    "list[int]": list,
    "list[str | dict]": list,
}
_FLAG = re.compile(r"(?:^|\s)--(\S+)")


def check_value(key: str, value: Any) -> Any:
    """One setting's value, checked for its type and its bounds or choices; an int for a float comes back a float."""
    value = _check_type(key, value)
    _check_range(key, value)
    return value


def _check_type(key: str, value: Any) -> Any:
    if key in AUTO_FIELDS and value == AUTO:
        return value
    kind = KIND[key]
    expected, shown = _KINDS[kind], f'{kind} or "{AUTO}"' if key in AUTO_FIELDS else kind
    if kind == "list[str | dict]":
        if not isinstance(value, list):
            raise ConfigError(
                f"{key} must be a list of prompts (strings or tables), got {type(value).__name__} "
                f'({value!r}); e.g. {key} = ["a photo of ohwx"]'
            )
        return [_check_prompt(f"{key}[{number}]", entry) for number, entry in enumerate(value)]
    if kind == "float" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and expected is not bool:
        raise ConfigError(f"{key} must be {shown}, got a boolean ({value!r})")
    if not isinstance(value, expected):
        raise ConfigError(f"{key} must be {shown}, got {type(value).__name__} ({value!r})")
    if kind.startswith("list["):
        item = str if kind == "list[str]" else int
        for element in value:
            if isinstance(element, bool) or not isinstance(element, item):
                raise ConfigError(f"{key} must be {kind}; element {element!r} is {type(element).__name__}")
            _check_text(key, element)
        return list(value)
    if kind == "float" and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    _check_text(key, value)
    return value


def _check_range(key: str, value: Any) -> None:
    if key in AUTO_FIELDS and value == AUTO:
        return
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"{key} must be one of {list(CHOICES[key])}, got {value!r}")
    if key not in BOUNDS:
        return
    low, high = BOUNDS[key]
    for number in value if isinstance(value, list) else [value]:
        if not low <= number <= high:
            span = f"{low}..{high}" if isinstance(low, int) and isinstance(high, int) else f"{low:g}..{high:g}"
            raise ConfigError(f"{key} must be in {span}, got {number!r}")


def _check_text(key: str, value: Any) -> None:
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate, e.g. "\ud800" in a JSON file
            raise ConfigError(f"{key} holds an invalid character ({value[err.start]!r}); retype that text") from None


def parse_prompt(entry: str | dict, where: str = "sample prompt") -> dict[str, Any]:
    """A sample prompt → {prompt, and the settings it sets}: a table as it is, a string with ai-toolkit's
    flags (`--n` negative, `--w`/`--h` size, `--seed`/`--d`, `--cfg`/`--l`, `--steps`/`--s`) read out."""
    if isinstance(entry, dict):
        unknown = [k for k in entry if k not in PROMPT_KEYS]
        if unknown:
            hints = [
                f"{k!r} (did you mean {m[0]!r}?)"
                if (m := difflib.get_close_matches(str(k), PROMPT_KEYS, 1))
                else repr(k)
                for k in unknown
            ]
            raise ConfigError(
                f"{where}: unknown key(s) {', '.join(hints)}; a prompt table takes {', '.join(PROMPT_KEYS)}"
            )
        if "prompt" not in entry:
            raise ConfigError(f'{where}: a prompt table needs prompt = "..." (the text to sample)')
        return dict(entry)
    if not isinstance(entry, str):
        raise ConfigError(
            f'{where} must be a string or a table {{prompt = "...", seed = 7, ...}}, '
            f"got {type(entry).__name__} ({entry!r})"
        )
    parts = _FLAG.split(entry)
    values: dict[str, Any] = {"prompt": parts[0]}
    for flag, text in zip(parts[1::2], parts[2::2]):
        if flag not in PROMPT_FLAGS:
            raise ConfigError(
                f"{where}: unknown flag --{flag}; a prompt string takes --n (negative), --w, --h, "
                '--seed, --cfg, --steps (or a table: {prompt = "...", seed = 7})'
            )
        key, text = PROMPT_FLAGS[flag], text.strip()
        kind = KIND[PROMPT_KEYS[key]]
        if kind == "str":
            values[key] = text
            continue
        try:
            values[key] = int(text) if kind == "int" else float(text)
        except ValueError:
            raise ConfigError(
                f"{where}: --{flag} needs a {'whole ' if kind == 'int' else ''}number, got {text!r}"
            ) from None
    return values


def _check_prompt(where: str, entry: Any) -> str | dict:
    """One sample prompt, checked (types, bounds, a non-empty text); a table comes back with cfg a float."""
    values = parse_prompt(entry, where)
    for key, value in values.items():
        setting_key = PROMPT_KEYS[key]
        kind = KIND[setting_key] if setting_key else "str"
        try:
            if setting_key:
                values[key] = value = _check_type(setting_key, value)
                _check_range(setting_key, value)
            elif not isinstance(value, str):
                raise ConfigError(f"must be str, got {type(value).__name__} ({value!r})")
            else:
                _check_text(key, value)
        except ConfigError as err:
            problem = str(err).removeprefix(f"{setting_key or key} ")
            raise ConfigError(f"{where}: {key} {problem}") from None
        if kind == "str" and key == "prompt" and not value.strip():
            raise ConfigError(f"{where}: the prompt text is empty")
    return values if isinstance(entry, dict) else entry


def check_combinations(cfg: TrainConfig) -> None:
    """Settings that are fine alone but wrong together: every problem found, in one ConfigError."""
    problems = [problem for check in _COMBINATION_CHECKS for problem in check(cfg)]
    if problems:
        raise ConfigError("; ".join(problems))


def _schedule_problems(cfg: TrainConfig) -> list[str]:
    problems = []
    if cfg.warmup_steps >= cfg.steps:
        problems.append(f"warmup_steps ({cfg.warmup_steps}) must be below steps ({cfg.steps})")
    if cfg.lr_schedule == "cosine" and cfg.warmup_steps > 0:
        problems.append("lr_schedule 'cosine' has no warm-up; use 'cosine_with_warmup' or set warmup_steps = 0")
    if cfg.lr_schedule == "cosine_with_warmup" and cfg.warmup_steps == 0:
        problems.append("lr_schedule 'cosine_with_warmup' needs warmup_steps > 0")
    if cfg.optimizer == "schedulefree" and cfg.lr_schedule != "constant":
        problems.append(
            f"optimizer schedulefree replaces the lr schedule (it averages its weights instead of decaying the lr); "
            f"set lr_schedule to constant (got {cfg.lr_schedule!r}; warmup_steps still warms it up)"
        )
    if cfg.optimizer == "prodigy" and cfg.learning_rate < 0.1:
        problems.append(f"prodigy finds its own step size; set learning_rate to 1.0 (got {cfg.learning_rate:g})")
    return problems


def _backend_problems(cfg: TrainConfig) -> list[str]:
    problems = []
    if cfg.backend == "mlx" and not ARCHS[cfg.arch].mlx_model:
        problems.append(
            f"arch {cfg.arch!r} has no MLX port (it trains ComfyUI's own PyTorch model); use backend 'torch'"
        )
    # adamw8bit is allowed: the MLX backend trains it as fp32 AdamW and says so in the log
    if cfg.backend == "mlx" and cfg.optimizer not in MLX_OPTIMIZER_NAMES:
        problems.append(
            f"optimizer {cfg.optimizer!r} is PyTorch-only; use one of {', '.join(MLX_OPTIMIZER_NAMES)} with "
            "backend 'mlx'"
        )
    if cfg.backend == "mlx" and cfg.attention != "auto":
        problems.append(
            f"attention {cfg.attention!r} picks a PyTorch kernel; MLX has one (mx.fast.scaled_dot_product_attention): "
            "set attention to auto"
        )
    if (
        cfg.checkpoint_budget != AUTO
        and cfg.checkpoint_budget > 0
        and not (cfg.backend == "torch" and cfg.compile_blocks is not False and cfg.gradient_checkpointing)
    ):
        problems.append(
            f"checkpoint_budget {cfg.checkpoint_budget:g} needs backend 'torch' with compile_blocks and "
            f"gradient_checkpointing on; set it to 0 (or auto) or use skip_checkpoint_blocks"
        )
    if cfg.backend == "mlx" and cfg.compile_blocks is True:
        problems.append("compile_blocks is for backend 'torch' (MLX compiles its whole step already); turn it off")
    if cfg.backend == "mlx" and cfg.stream_blocks not in (0, AUTO):
        problems.append(
            "stream_blocks is for backend 'torch' (a Mac's GPU shares the host's memory: nothing to stream); set it "
            "to 0 or auto"
        )
    if cfg.fp8_compute is True and (cfg.backend != "torch" or cfg.mixed_precision != "bf16"):
        problems.append(
            "fp8_compute needs backend 'torch' with mixed_precision 'bf16' (its matmuls return bf16); turn it off"
        )
    if cfg.cuda_graphs and (cfg.backend != "torch" or cfg.compile_blocks is False):
        problems.append(
            "cuda_graphs replays compiled blocks: it needs backend 'torch' with compile_blocks on (or "
            "auto); turn cuda_graphs off"
        )
    if cfg.backend == "torch" and cfg.base_quantize not in ("auto", "none", "int8"):
        problems.append(
            f"base_quantize {cfg.base_quantize!r} is for backend 'mlx'; PyTorch takes auto, none or int8 (or load the "
            "model with weight_dtype fp8_e4m3fn in Load Diffusion Model for a smaller base)"
        )
    # one quantized forward per Linear: fp8_compute copies a bf16 weight that int8 has already replaced
    if cfg.base_quantize == "int8" and cfg.fp8_compute is True:
        problems.append(
            "base_quantize int8 and fp8_compute both quantize the base's matmuls; pick one: fp8_compute for "
            "H100-class GPUs, base_quantize int8 for Ampere/Ada cards (fp8_compute auto yields to int8)"
        )
    return problems


def _resolution_problems(cfg: TrainConfig) -> list[str]:
    problems = []
    if not ARCHS[cfg.arch].default_targets and not cfg.targets:
        problems.append(f"arch {cfg.arch!r} has no default targets; list module patterns in `targets`")
    if len(set(cfg.resolutions)) != len(cfg.resolutions) or not cfg.resolutions:
        problems.append(f"resolutions must be a non-empty list without repeats, got {cfg.resolutions}")
    bad_res = [r for r in cfg.resolutions if r % ARCHS[cfg.arch].bucket_divisor]
    if bad_res:
        problems.append(f"resolutions {bad_res} must be multiples of {ARCHS[cfg.arch].bucket_divisor} for {cfg.arch}")
    return problems


def _sample_problems(cfg: TrainConfig) -> list[str]:
    arch, problems = ARCHS[cfg.arch], []
    if cfg.sample_prompts and not arch.clip_type:
        problems.append(
            f"sample_prompts: arch {cfg.arch!r} has no ComfyUI text encoder to sample with (headless "
            f"samples need one of {[a.name for a in ARCHS.values() if a.clip_type]}); "
            "leave sample_prompts empty"
        )
    if cfg.sample_prompts and cfg.sharding == "shard":  # rank 0 samples alone; a sharded block needs every rank
        problems.append(
            "sample_prompts with sharding shard: rank 0 samples alone and a sharded base needs every rank; leave "
            "sample_prompts empty (sample from the saved LoRA) or set sharding auto or replicate"
        )
    sizes = [("sample_width", cfg.sample_width), ("sample_height", cfg.sample_height)]
    for number, entry in enumerate(cfg.sample_prompts):
        values = parse_prompt(entry)
        sizes += [(f"sample_prompts[{number}]: {key}", values[key]) for key in ("width", "height") if key in values]
    for where, size in sizes:
        if size % arch.bucket_divisor:
            problems.append(
                f"{where} {size} must be a multiple of {arch.bucket_divisor} for {cfg.arch} "
                f"(e.g. {size - size % arch.bucket_divisor or arch.bucket_divisor})"
            )
    for key in ("sample_sampler", "sample_scheduler"):
        if not re.fullmatch(r"[A-Za-z0-9_]+", getattr(cfg, key)):
            problems.append(
                f"{key} must be a ComfyUI {key[7:]} name (e.g. euler, simple) or auto, got {getattr(cfg, key)!r}"
            )
    return problems


def _preservation_problems(cfg: TrainConfig) -> list[str]:
    if cfg.preservation_weight > 0 and not cfg.preservation_class.strip():
        return [
            (
                "preservation_weight > 0 needs preservation_class, the class word that replaces the trigger "
                "word (e.g. person; in a graph, on Kiln Encode Captions); or set preservation_weight to 0"
            )
        ]
    return []


def offload_possible(cfg: TrainConfig) -> bool:
    """Whether the blocks' kept inputs can wait on the host (offload_activations): checkpointing keeps them, and each
    block is recomputed whole, so no checkpoint_budget and no CUDA graphs. The run's auto and the estimate ask it too."""
    return cfg.gradient_checkpointing and cfg.checkpoint_budget in (0, AUTO) and not cfg.cuda_graphs


def _offload_problems(cfg: TrainConfig) -> list[str]:
    if cfg.offload_activations is not True or (cfg.backend == "torch" and offload_possible(cfg)):
        return []
    return [
        "offload_activations true moves the inputs gradient checkpointing keeps to host memory and recomputes each "
        "block whole from its input: it needs backend torch, gradient_checkpointing on, checkpoint_budget 0 (or auto) "
        "and cuda_graphs off"
    ]


def _full_problems(cfg: TrainConfig) -> list[str]:
    """A full fine-tune trains the blocks' own weights on PyTorch: nothing may quantize, stream or stand in for them."""
    if cfg.adapter != "full":
        return []
    problems = []
    if cfg.backend != "torch":
        problems.append(
            "adapter 'full' (full fine-tune) runs on backend 'torch' only; set backend to torch or choose lora"
        )
    if cfg.preservation_weight > 0:
        problems.append("adapter 'full' keeps no base model beside the trained one; set preservation_weight to 0")
    if cfg.base_quantize not in ("auto", "none") or cfg.fp8_compute is True:  # auto: none for a full run
        problems.append("adapter 'full' trains the base weights: set base_quantize to none and fp8_compute off")
    if cfg.stream_blocks not in (0, AUTO) or cfg.cuda_graphs or cfg.step_graphs is True:
        problems.append(
            "adapter 'full' keeps every trained block on the device: set stream_blocks, cuda_graphs and "
            "step_graphs to 0/off/auto"
        )
    return problems


def _holdout_problems(cfg: TrainConfig) -> list[str]:
    problems = []
    if cfg.holdout >= 1 and cfg.holdout != int(cfg.holdout):
        problems.append(
            f"holdout {cfg.holdout:g} must be a whole number of images (1, 2, ...) or a share below 1 "
            f"(e.g. {cfg.holdout / 100:g})"
        )
    if cfg.early_stop_patience and not cfg.holdout:
        problems.append(
            f"early_stop_patience {cfg.early_stop_patience} stops on the held-out loss: set holdout "
            "(e.g. 0.1) or set early_stop_patience to 0"
        )
    return problems


def _target_problems(cfg: TrainConfig) -> list[str]:
    problems = []
    if cfg.init_lora_sha256 and not re.fullmatch(r"[0-9a-f]{64}", cfg.init_lora_sha256):
        problems.append(
            f"init_lora_sha256 must be 64 lower-case hex digits (a sha256) or empty, got {cfg.init_lora_sha256!r}"
        )
    for pattern in cfg.targets:
        if not pattern.strip():
            problems.append("targets contains an empty pattern")
        elif pattern.startswith("re:"):
            _check_regex(pattern, problems)
    return problems


def _sigma_range_problems(cfg: TrainConfig) -> list[str]:
    try:
        parse_sigma_range(cfg.sigma_range)
    except ValueError as error:
        return [str(error)]
    return []


def _check_regex(pattern: str, problems: list[str]) -> None:
    try:
        re.compile(pattern[3:])
    except re.error as err:
        problems.append(f"target {pattern!r} is not a valid regular expression: {err}")


# check_combinations runs these in order; the problems they find join into one message in this order.
_COMBINATION_CHECKS: tuple[Callable[[TrainConfig], list[str]], ...] = (
    _schedule_problems,
    _backend_problems,
    _resolution_problems,
    _sample_problems,
    _preservation_problems,
    adapters.check_config,
    _full_problems,
    _offload_problems,
    _holdout_problems,
    _target_problems,
    _sigma_range_problems,
)
