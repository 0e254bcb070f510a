"""Named GPUs and a predicted (not measured) step time on each: `python -m trainer estimate CONFIG --memory-gb N`.

The model, stated once:

    step time = max(compute, copy) + HOST_OVERHEAD_S
    compute   = the step's FLOPs / (the card's dense tensor rate x EFFICIENCY)
    copy      = bytes streamed host→GPU a step / the card's host link

FLOPs (step_flops) from the model dims the memory estimate already has; the base is frozen, so its Linears need
no weight gradient: forward 2·P·T, activation gradient 2·P·T, and the checkpoint recompute 2·P·T times the share
recomputed (1 - checkpoint_budget), where P is the block Linear weights a token passes through (a two-stream
block's tokens each pass through one stream's half) and T the tokens each block sees. Attention adds 4·L²·D
forward (QKᵀ and AV), twice that backward, once more recomputed. LoRA's own matmuls: 2·r·(in+out)·T forward,
twice that backward. Embedders, the final layer and the modulation Linears (< 1 % of the FLOPs) are left out.
The rate: bf16 tensor cores with fp32 accumulate (what torch's bf16 matmul uses), the fp8 rate where the base
is stored in fp8 or fp8_compute is on (on Ampere, without fp8, the bf16 rate), the int8 rate for an int8 base.
Copy: every streamed block twice a step (forward, then recompute and backward), as measured (Z-Image, all 34
blocks: 22.9 GB a step = 2 x 11.44 GiB). A base sharded over N GPUs (sharding shard): each GPU copies its own
shards on the host twice, and receives (N-1)/N of every block twice in all-gathers, counted over the same link
(consumer cards have no NVLink); not measured.

EFFICIENCY and HOST_OVERHEAD_S are calibrated once, from the two resident default rows at 1024 px on the H200
(bench/results.json, commit b73b35f, compiled blocks, checkpoint_budget auto → 1: nothing recomputed, the text
tokens the bench ran): Klein 4B 0.1616 s/step (mean of 3 rows) and Z-Image 0.2609 (mean of 2). Two rows, two
unknowns: EFFICIENCY 0.54 of the dense rate (533 TFLOP/s of the H200's 989), HOST_OVERHEAD_S 0.016 s. The FLOP
count matches the bench's own (bench/gpu_train.py model_flops) within 2 %. Checked against the other H200 rows
(same file; predicted vs measured s/step): Klein 4B 768 px 0.096 vs 0.091 (+5 %); at 512 px with step graphs
Z-Image 0.077 vs 0.071 (+8 %) and Klein 4B 0.056 vs 0.048 (+16 %); Z-Image 1024 px streamed, 17 of 34 blocks
0.260 vs 0.278 (-7 %), all 34 0.459 vs 0.471 (-3 %, copy-bound), all 34 at budget 0 0.459 vs 0.500 (-8 %).
Not modelled: the host's own work where the GPU's is small (512 px without step graphs: Z-Image 0.077 vs
0.132 measured), and how well the copies overlap the recompute. Untested: that a consumer card reaches the
H200's share of its dense rate (GDDR feeds the memory-bound kernels more slowly; smaller GPUs fill their SMs
more easily) and moves the practical host rates below; each figure is a prediction until a card is measured.
Klein 9B and Flux2 Dev have no H200 row; their predictions rest on the same two constants.
"""

from __future__ import annotations

from typing import NamedTuple

from ..archs.layout import ModelDims
from .common import GIB, arch_of, get_dims, image_token_count, latent_frames, layout_of, lora_shapes
from .torch_advice import fewest_streamed
from .torch_step import AUTO_SAFETY, block_weight_bytes, budget_on, estimate, runs_in, streamed_bytes

EFFICIENCY = 0.54  # share of the dense tensor rate a step reaches (calibrated above)
HOST_OVERHEAD_S = 0.016  # per step, beside the GPU's work (calibrated above)


class Card(NamedTuple):
    """One GPU's facts: memory in GiB as nvidia-smi shows it; dense tensor rates (no sparsity; bf16 with fp32
    accumulate) in TFLOP/s (int8 in TOP/s; 0 where the card has none); memory bandwidth and the practical
    pinned host→GPU rate of its link, in GB/s."""

    name: str
    memory_gib: float
    bf16: float
    fp8: float
    int8: float
    bandwidth: float
    link: str
    host_gbps: float


# Rates: NVIDIA's architecture whitepapers (Ampere GA102, Ada Lovelace, RTX Blackwell) and product spec pages.
# Per SM and clock, GeForce tensor cores do 512 bf16 FLOPs with fp32 accumulate (half their fp16-accumulate
# rate), 1024 fp8 (Ada, Blackwell) and 2048 int8 ops; the rate is that x SMs x boost clock (RTX 4090: 128 SMs
# at 2.52 GHz = 165.2 bf16, 330.3 fp8, 660.6 int8, as the Ada whitepaper lists; RTX 3090: 82 at 1.695 GHz = 71.2
# bf16, 284.7 int8, as the GA102 whitepaper lists; RTX 5090: 170 at 2.41 GHz = 209.5, half of its 419 fp16 dense).
# H200 SXM: NVIDIA's H200 spec page (989 dense bf16, 1979 fp8 and int8). Host links: PCIe 4.0 x16 ~25 GB/s,
# 5.0 x16 ~50, 4.0 x8 ~12.5 in practice; the H200's is the 55.5 GB/s measured (bench/RESULTS.md).
CARDS: dict[str, Card] = {
    card.name: card
    for card in (
        Card("RTX 3060 12GB", 12, 25.5, 0, 101.9, 360, "PCIe 4.0 x16", 25),
        Card("RTX 3080 10GB", 10, 59.5, 0, 238.1, 760, "PCIe 4.0 x16", 25),
        Card("RTX 3080 12GB", 12, 61.3, 0, 245.1, 912, "PCIe 4.0 x16", 25),
        Card("RTX 3090", 24, 71.2, 0, 284.7, 936, "PCIe 4.0 x16", 25),
        Card("RTX 4060 Ti 16GB", 16, 44.1, 88.3, 176.5, 288, "PCIe 4.0 x8", 12.5),
        Card("RTX 4070 Ti Super", 16, 88.2, 176.4, 352.8, 672, "PCIe 4.0 x16", 25),
        Card("RTX 4080", 16, 97.5, 194.9, 389.9, 717, "PCIe 4.0 x16", 25),
        Card("RTX 4090", 24, 165.2, 330.3, 660.6, 1008, "PCIe 4.0 x16", 25),
        Card("RTX 5070 Ti", 16, 87.9, 175.7, 351.5, 896, "PCIe 5.0 x16", 50),
        Card("RTX 5080", 16, 112.6, 225.1, 450.2, 960, "PCIe 5.0 x16", 50),
        Card("RTX 5090", 32, 209.5, 419.0, 838.0, 1792, "PCIe 5.0 x16", 50),
        Card("H200 (reference)", 140, 989.0, 1979.0, 1979.0, 4800, "PCIe 5.0 x16", 55.5),
    )
}
NEAR = 0.2  # cards whose memory is within this share of --memory-gb


def near(memory_gib: float, every: bool = False) -> list[Card]:
    """The cards of about `memory_gib` (within NEAR), or every card."""
    return [c for c in CARDS.values() if every or abs(c.memory_gib - memory_gib) <= NEAR * memory_gib]


def rate(card: Card, base_dtype: str, fp8_compute: bool) -> float:
    """TFLOP/s of the base's matmuls on `card`: fp8 or int8 where the base computes in them and the card has them."""
    kind = "int8" if base_dtype == "int8" else "fp8" if base_dtype == "fp8" or fp8_compute else "bf16"
    return getattr(card, kind) or card.bf16


def step_flops(
    dims: ModelDims,
    resolution: int,
    *,
    rank: int = 32,
    recompute: float = 1.0,
    batch: int = 1,
    text: int = 0,
    targets: tuple[str, ...] | None = None,
    frames: int = 1,
) -> float:
    """FLOPs of one LoRA step on a frozen base (module docstring); `recompute`: the share checkpointing reruns;
    `text`: text tokens (default the estimate's, an upper bound for Z-Image's captions); `frames`: a clip's."""
    arch = arch_of(dims)
    image = image_token_count(dims, resolution, arch.latent_downscale * arch.patch) * latent_frames(dims, frames)
    text = text or dims.context_tokens
    groups = layout_of(dims).blocks(dims, image, text)
    tokens = [g.tokens for g in groups for _ in range(g.count)]  # per block, in block order
    per_block = [size // 2 for size in block_weight_bytes(dims, "bf16")]  # Linear weights per block
    passes = [p / 2 if index < dims.double_blocks else p for index, p in enumerate(per_block)]  # two streams
    linear = sum(2 * p * t for p, t in zip(passes, tokens))
    attention = sum(4 * t * t * dims.hidden for t in tokens)
    lora = 2 * rank * sum(i + o for i, o in lora_shapes(dims, targets)) * (image + text)
    return batch * ((2 + recompute) * linear + (3 + recompute) * (attention + lora))


class Prediction(NamedTuple):
    seconds: float
    bound: str  # "compute" or "copy"


def predict(card: Card, flops: float, copied_bytes: float, base_dtype: str = "bf16", fp8_compute: bool = False):
    """The predicted step time on `card` (module docstring) and what bounds it."""
    compute = flops / (rate(card, base_dtype, fp8_compute) * 1e12 * EFFICIENCY)
    copy = copied_bytes / (card.host_gbps * 1e9)
    return Prediction(max(compute, copy) + HOST_OVERHEAD_S, "copy" if copy > compute else "compute")


class CardPlan(NamedTuple):
    """What a run on `memory_gib` would do: blocks streamed (None: nothing fits), of how many, the bytes in
    pinned host memory, checkpoint_budget, the step's estimate."""

    streamed: int | None
    blocks: int
    host_bytes: int
    budget: float
    total: int


def card_plan(settings: dict, memory_gib: float, budget: float | str = "auto") -> CardPlan:
    """The fewest blocks streamed for the step of `settings` (estimate()'s arguments) to fit as a run's
    stream_blocks auto takes it (runs_in: the safety factor and margin), at plain checkpointing, then
    checkpoint_budget auto as a run picks it beside them."""
    memory = int(memory_gib * GIB)
    fixed = budget != "auto"
    base = {**settings, "checkpoint_budget": float(budget) if fixed else 0.0}
    dims, dtype = get_dims(settings["variant"]), settings["base_dtype"]
    blocks, count = len(block_weight_bytes(dims, dtype)), base.get("stream_blocks", 0)
    step = estimate(**base)
    if not runs_in(step, memory):  # as a run's stream_blocks auto decides (memory_plan.py)
        found = fewest_streamed(base, memory, runs_in)
        if found is None:
            return CardPlan(None, blocks, 0, 0.0, step.total)
        count, step = found
    chosen = base["checkpoint_budget"]
    if not fixed and settings["gradient_checkpointing"]:
        planned = {**base, "stream_blocks": count}
        chosen = budget_on(lambda b: estimate(**{**planned, "checkpoint_budget": b}), memory)
        step = estimate(**{**planned, "checkpoint_budget": chosen})
    host = streamed_bytes(dims, dtype, count)[0] if count else 0
    return CardPlan(count, blocks, host, chosen, step.total)


def predict_plan(card: Card, settings: dict, plan: CardPlan) -> Prediction:
    """The predicted step time of `plan` on `card` (module docstring)."""
    recompute = (1.0 - plan.budget) if settings["gradient_checkpointing"] else 0.0
    flops = step_flops(
        get_dims(settings["variant"]),
        settings["resolution"],
        rank=settings["rank"],
        recompute=recompute,
        targets=settings.get("targets"),
        batch=settings["batch_size"] * (2 if settings.get("preservation") else 1),
        frames=settings.get("frames", 1),
    )
    copied = 2 * plan.host_bytes
    if (shards := settings.get("shards", 1)) > 1:  # each GPU copies its own shards, and gathers the others' blocks
        base = sum(block_weight_bytes(get_dims(settings["variant"]), settings["base_dtype"]))
        copied = (copied + 2 * base * (shards - 1)) // shards  # over the card's link: no NVLink on consumer cards
    return predict(card, flops, copied, settings["base_dtype"], bool(settings.get("fp8_compute")))


def _streams(plan: CardPlan) -> str:
    if plan.streamed is None:
        return "does not fit"
    return f"{plan.streamed} of {plan.blocks} blocks" if plan.streamed else "nothing"


def _on_host(plan: CardPlan, shards: int) -> str:
    """What of the base `plan` keeps in host memory: streamed blocks, or under sharding shard their shards."""
    if not plan.streamed:
        return "nothing streams (the whole base on the GPU)"
    if shards == 1:
        return (
            f"stream_blocks {plan.streamed} ({_streams(plan)}; {plan.host_bytes / GIB:.1f} GiB of pinned host RAM, "
            f"{2 * plan.host_bytes / 1e9:.1f} GB copied host→GPU a step)"
        )
    return (
        f"stream_blocks auto → {plan.streamed} of {plan.blocks} blocks' shards in pinned host memory "
        f"({plan.host_bytes / GIB:.1f} GiB of RAM over the {shards} ranks, {2 * plan.host_bytes / shards / 1e9:.1f} "
        "GB copied host→GPU a step on each GPU)"
    )


def plan_lines(settings: dict, memory_gib: float, budget: float | str = "auto", every: bool = False) -> list[str]:
    """The plan on a `memory_gib` card and the predicted step time on the named cards of about that memory."""
    plan = card_plan(settings, memory_gib, budget)
    where = (
        f"the plan on a {memory_gib:g} GiB card as a run's auto makes it (the step x {AUTO_SAFETY:g} and a margin "
        f"beside the weights; {settings['resolution']} px, the settings above): "
    )
    if plan.streamed is None:
        lines = [where + f"does not fit even with every block streamed ({plan.total / GIB:.1f} GiB)"]
    else:
        streams = _on_host(plan, settings.get("shards", 1))
        lines = [where + f"{streams}, checkpoint_budget {plan.budget:g}: {plan.total / GIB:.1f} GiB"]
    cards = near(memory_gib, every)
    which = "every named card" if every else f"cards with about {memory_gib:g} GiB"
    lines.append(
        f"predicted (not measured) step time on {which}: max(compute at {EFFICIENCY:.0%} of the card's dense rate, "
        f"streamed bytes / host link) + {HOST_OVERHEAD_S * 1e3:.0f} ms, calibrated on H200 rows "
        "(trainer/estimate/cards.py)"
    )
    if not cards:
        return lines + ["  no named card of about that memory (--cards all lists every one)"]
    lines.append(f"  {'card':<19}{'memory':>8}  {'link':<13} {'streams':<18}{'predicted s/step':>17}  bound")
    for card in cards:
        there = card_plan(settings, card.memory_gib, budget)
        seconds, bound = predict_plan(card, settings, there) if there.streamed is not None else (None, "")
        shown = f"{seconds:.2f} predicted" if seconds is not None else "—"
        lines.append(
            f"  {card.name:<19}{card.memory_gib:>4g} GiB  {card.link:<13} {_streams(there):<18}{shown:>17}  {bound}"
        )
    return lines
