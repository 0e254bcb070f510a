"""LoRA tools after training: Merge LoRAs, Resize LoRA, Extract LoRA (trainer/lora/tools.py, lora_extract.py).
Each returns ComfyUI's own LORA_MODEL (save it with Kiln Save LoRA or ComfyUI's SaveLoRA) and shows the
energy report on the node."""

from __future__ import annotations

from comfy_api.latest import io, ui

from ..trainer.archs import guess_arch
from ..trainer.lora.extract import SVD_MODES, extract
from ..trainer.lora.tools import DYNAMIC, RankRule, format_report, merge, resize
from .comfy import bridge
from .widgets import CATEGORY

SLOTS = 4  # Merge LoRAs' inputs: lora_1..4, each with its weight
METHODS = ["fixed", *DYNAMIC]
_METHOD_TIP = (
    "fixed: every module gets `rank`. Dynamic (kohya's names; rank caps them, 0 = no cap): sv_ratio keeps "
    "σ > σ_max/threshold (threshold ≥ 1, e.g. 10); sv_fro keeps the threshold fraction of each module's "
    "Frobenius norm (0–1, e.g. 0.9); sv_cumulative the threshold fraction of Σσ (0–1)"
)
_THRESHOLD_TIP = "The dynamic method's target (see method); unused with fixed"


def rule_from(node: str, rank: int, method: str, threshold: float, *, exact: bool = False) -> RankRule | None:
    """The widgets as a RankRule; None (exact) where the node allows rank 0 with method fixed."""
    try:
        if method == "fixed":
            if rank == 0 and exact:
                return None
            return RankRule(rank)
        return RankRule(rank or None, method, threshold)
    except ValueError as error:
        raise ValueError(f"{node}: {error}") from None


def _rank_inputs(rank_default: int, rank_tip: str, *, minimum: int) -> list:
    return [
        io.Int.Input("rank", default=rank_default, min=minimum, max=4096, tooltip=rank_tip),
        io.Combo.Input("method", options=METHODS, default="fixed", tooltip=_METHOD_TIP),
        io.Float.Input("threshold", default=0.9, min=0.0, max=1000.0, step=0.01, tooltip=_THRESHOLD_TIP),
    ]


def _output(weights, report):
    lora = bridge.lora_model_from(weights, guess_arch(weights))
    return io.NodeOutput(lora, ui=ui.PreviewText(format_report(report)))


class KilnMergeLoRAs(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        slots = []
        for i in range(1, SLOTS + 1):
            slots += [
                io.LoraModel.Input(
                    f"lora_{i}",
                    optional=i > 1,
                    tooltip=f"LoRA {i} (a LORA_MODEL: Kiln Train LoRA, ComfyUI's LoraModelLoader or Load LoRA Model…)",
                ),
                io.Float.Input(
                    f"weight_{i}",
                    default=1.0,
                    min=-10.0,
                    max=10.0,
                    step=0.05,
                    tooltip=f"Weight of LoRA {i} (its strength in the sum; negative subtracts)",
                ),
            ]
        return io.Schema(
            node_id="KilnMergeLoRAs",
            display_name="Kiln Merge LoRAs",
            category=f"{CATEGORY}/lora",
            description="Σ weight·LoRA per module as one LoRA: exact (rank = sum of ranks) with rank 0, or reduced by "
            "SVD to a rank, with the energy kept shown. LoRAs must be for one model.",
            inputs=[
                *slots,
                *_rank_inputs(
                    0,
                    "0 = exact merge (rank = sum of ranks, nothing lost); otherwise the "
                    "merged LoRA is reduced by SVD to this rank (with a dynamic method: "
                    "the cap)",
                    minimum=0,
                ),
            ],
            outputs=[io.LoraModel.Output(display_name="lora", tooltip="The merged LoRA (alpha = rank)")],
        )

    @classmethod
    def execute(cls, lora_1, weight_1, rank, method, threshold, **slots):
        rule = rule_from("Kiln Merge LoRAs", rank, method, threshold, exact=True)
        inputs = [(lora_1, weight_1, "lora_1")] + [
            (slots[f"lora_{i}"], slots.get(f"weight_{i}", 1.0), f"lora_{i}")
            for i in range(2, SLOTS + 1)
            if slots.get(f"lora_{i}") is not None
        ]
        try:
            weights, report = merge(
                [bridge.lora_weights_from(lora) for lora, _, _ in inputs],
                [weight for _, weight, _ in inputs],
                rule,
                sources=[n for _, _, n in inputs],
            )
        except ValueError as error:
            raise ValueError(f"Kiln Merge LoRAs: {error}") from None
        return _output(weights, report)


class KilnResizeLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnResizeLoRA",
            display_name="Kiln Resize LoRA",
            category=f"{CATEGORY}/lora",
            description="A LoRA's rank changed by SVD (fixed, or dynamic per module), alpha set so the effect is "
            "kept; shows the energy kept per module and overall.",
            inputs=[
                io.LoraModel.Input("lora", tooltip="The LoRA to resize (a LORA_MODEL)"),
                *_rank_inputs(
                    16,
                    "The new rank (with a dynamic method: the cap, 0 = none); a module never grows past its own rank",
                    minimum=0,
                ),
            ],
            outputs=[io.LoraModel.Output(display_name="lora", tooltip="The resized LoRA (alpha = rank)")],
        )

    @classmethod
    def execute(cls, lora, rank, method, threshold):
        if method == "fixed" and rank == 0:
            raise ValueError("Kiln Resize LoRA: rank 0 keeps nothing; give a rank, or a dynamic method")
        weights, report = resize(bridge.lora_weights_from(lora), rule_from("Kiln Resize LoRA", rank, method, threshold))
        return _output(weights, report)


class KilnExtractLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KilnExtractLoRA",
            display_name="Kiln Extract LoRA",
            category=f"{CATEGORY}/lora",
            description="A LoRA of tuned − base: every weight matrix that differs, by SVD (the LoRAs and merges "
            "applied to either MODEL count). Biases and norms that differ are listed (a LoRA cannot "
            "hold them).",
            inputs=[
                io.Model.Input("base", tooltip="The base model"),
                io.Model.Input("tuned", tooltip="The fine-tuned model (or the base with LoRAs applied)"),
                *_rank_inputs(32, "Rank of each module (with a dynamic method: the cap)", minimum=1),
                io.Float.Input(
                    "clamp_quantile",
                    default=1.0,
                    min=0.5,
                    max=1.0,
                    step=0.001,
                    tooltip="Clamp factor entries beyond this quantile of their absolute values "
                    "(kohya's 0.99); 1 = no clamp",
                ),
                io.Combo.Input(
                    "svd",
                    options=list(SVD_MODES),
                    default="auto",
                    tooltip="auto: exact SVD up to 1024 wide, randomized (torch.svd_lowrank) above; "
                    "full: always exact (slower); lowrank: always randomized",
                ),
            ],
            outputs=[io.LoraModel.Output(display_name="lora", tooltip="The extracted LoRA (alpha = rank)")],
        )

    @classmethod
    def execute(cls, base, tuned, rank, method, threshold, clamp_quantile, svd):
        rule = rule_from("Kiln Extract LoRA", rank, method, threshold)
        device = bridge.compute_device()
        bar = {}

        def progress(done, total):
            bar.setdefault("bar", bridge.progress(total)).update(done)

        try:
            weights, report = extract(
                bridge.EffectiveWeights(base, device),
                bridge.EffectiveWeights(tuned, device),
                rule,
                clamp_quantile=clamp_quantile if clamp_quantile < 1 else None,
                svd=svd,
                device=device,
                progress=progress,
            )
        except ValueError as error:
            raise ValueError(f"Kiln Extract LoRA: {error}") from None
        result = _output(weights, report)
        bridge.require_fit(base, result.result[0], "Kiln Extract LoRA")  # every key loads into the base
        return result


NODES = [KilnMergeLoRAs, KilnResizeLoRA, KilnExtractLoRA]
