"""Kiln's streamed frozen base on a GPU (issue 44.1): trainer/backends/torch_backend/streaming.py against the
resident base, on a full-size model with random weights (bench/gpu_train.py's builder, ComfyUI's own classes).

    bash bench/gpu_env.sh python bench/stream_check.py [--arch zimage] [--res 1024] [--slots 2,3,4] [--out FILE]

The diffusion model's forward + backward to its input under Kiln's per-block checkpointing (the frozen base's
share of a LoRA step: forward, recompute and backward), median of --iters after 2 warm-ups by CUDA events,
with every block of the arch's largest block list resident, then streamed through rings of --slots slots.
Records the time, the copy floor (the streamed bytes twice, forward and recompute, at the pinned rate measured
here), peak memory, and the input gradient's largest difference from the resident run's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_train
from offload_check import GIB, copy_rate, timed

from trainer.archs import get_arch
from trainer.backends.torch_backend.checkpointing import BlockCheckpointing, find_blocks
from trainer.backends.torch_backend.streaming import BlockStreamer, plan


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="zimage", choices=list(gpu_train.ARCH_VARIANTS))
    parser.add_argument("--res", type=int, default=1024)
    parser.add_argument("--slots", default="2,3,4")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    gpu_train.prepare_comfy("cuda")
    import comfy.model_management as mm

    mm.in_training = True
    device = torch.device("cuda")
    dims = gpu_train.VARIANTS[gpu_train.ARCH_VARIANTS[args.arch]]
    inputs = gpu_train.make_inputs(dims, args.res, 1, 256 if args.arch == "zimage" else gpu_train.FLUX2_TEXT_TOKENS)
    patcher, info = gpu_train.build_model(dims, device, torch.bfloat16)
    model, dm = patcher.model, patcher.model.diffusion_model
    arch = get_arch(dims.arch)
    largest = max(arch.block_lists, key=lambda name: len(getattr(dm, name)))
    ckpt = BlockCheckpointing(dm, arch.block_lists, recompute=True)
    x = torch.from_numpy(inputs.latents[0])[None].to(device)
    context = torch.from_numpy(inputs.contexts[0])[None].to(device, torch.bfloat16)
    extra = {"num_tokens": context.shape[1]} if args.arch == "zimage" else {}
    t = torch.tensor([0.5], device=device)
    grads = {}

    def step(name):
        def run():
            xg = x.clone().requires_grad_(True)
            with torch.autocast("cuda", torch.bfloat16):
                out = model.apply_model(xg, t, c_crossattn=context, **extra)
            out.float().square().mean().backward()
            grads[name] = xg.grad

        return run

    rate = copy_rate(device)
    common = {
        "arch": args.arch,
        "resolution": args.res,
        "weights_gb": info["weights_gb"],
        "h2d_gbps": round(rate, 1),
        "commit": gpu_train.git_commit(),
        "device": torch.cuda.get_device_name(device),
        "blocks": largest,
    }
    records = []

    def measure(mode, **more):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        seconds = timed(step(mode), args.iters)
        diff = (grads[mode] - grads["resident"]).abs().max().item() if "resident" in grads else 0.0
        scale = grads["resident"].abs().max().item() if "resident" in grads else 1.0
        record = {
            "mode": mode,
            "forward_backward_s": round(seconds, 4),
            "grad_max_rel_diff": diff / scale,
            "peak_alloc_gb": round(torch.cuda.max_memory_allocated(device) / GIB, 2),
            **common,
            **more,
        }
        print(json.dumps(record), flush=True)
        records.append(record)

    measure("resident")
    measure("resident_again")  # the yardstick: how far two resident runs differ
    blocks = find_blocks(dm, arch.block_lists)
    names = [b for b in find_blocks(dm, (largest,))]
    streamed = [i for i, b in enumerate(blocks) if any(b is n for n in names)]
    for slots in [int(s) for s in args.slots.split(",")]:
        stream_plan = plan(blocks, streamed, slots)
        streamer = BlockStreamer(blocks, stream_plan, device)
        torch.cuda.empty_cache()
        floor = 2 * stream_plan.streamed_bytes / 1e9 / rate
        measure(
            f"streamed_{slots}",
            slots=slots,
            streamed_gb=round(stream_plan.streamed_bytes / 1e9, 2),
            ring_gb=round(stream_plan.gpu_bytes() / 1e9, 2),
            floor_s=round(floor, 4),
        )
        streamer.remove()
    ckpt.remove()
    if args.out:
        path = Path(args.out)
        old = json.loads(path.read_text()) if path.is_file() else []
        path.write_text(json.dumps(old + records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
