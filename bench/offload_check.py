"""Does ComfyUI's own low-VRAM loading stream a frozen base fast enough to train on a small card? (issue 44.1)

    bash bench/gpu_env.sh python bench/offload_check.py [--arch zimage] [--res 1024] [--gpu-gb 4] [--out FILE]

On a full-size model with random weights (bench/gpu_train.py's builder, ComfyUI's own classes), times
the diffusion model's forward, and forward + backward to its input (the frozen base's share of a LoRA step:
the backward needs every weight again), median of --iters after 2 warm-ups, by CUDA events:

- `resident`: every weight on the GPU (a big card);
- `comfy_lowvram`: ComfyUI's ModelPatcher.load(lowvram_model_memory=G GiB) from a CPU offload device, as
  ComfyUI runs a model larger than the card: G GiB of modules stay, the rest are cast to the GPU in each
  module's forward (comfy.ops, pinned and on its offload streams where ComfyUI enables them);
- the pinned host→GPU copy rate (2 GiB), and from it the floor of streaming the off-GPU bytes once
  (forward) and twice (forward + backward).

Prints one JSON record per mode; appends them to --out when given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_train

GIB = 2**30


def copy_rate(device: torch.device, gib: float = 2.0) -> float:
    """Pinned host → GPU copy rate in GB/s (10^9), best of 5."""
    host = torch.empty(int(gib * GIB), dtype=torch.uint8).pin_memory()
    dest = torch.empty_like(host, device=device)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dest.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return host.numel() / best / 1e9


def timed(fn, iters: int) -> float:
    """Median seconds of fn() over iters calls after 2 warm-ups, by CUDA events."""
    times = []
    for i in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def passes(patcher, inputs, device: torch.device):
    """(forward, forward + backward) closures through BaseModel.apply_model, as a sampler or a trainer calls it."""
    model = patcher.model
    x = torch.from_numpy(inputs.latents[0])[None].to(device)
    context = torch.from_numpy(inputs.contexts[0])[None].to(device, torch.bfloat16)
    t = torch.tensor([0.5], device=device)
    extra = {"num_tokens": inputs.contexts[0].shape[0]} if inputs.contexts[0].shape[1] == 2560 else {}  # Z-Image

    def forward():
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
            model.apply_model(x, t, c_crossattn=context, **extra)

    def forward_backward():
        xg = x.clone().requires_grad_(True)
        with torch.autocast("cuda", torch.bfloat16):
            out = model.apply_model(xg, t, c_crossattn=context, **extra)
        out.float().square().mean().backward()

    return forward, forward_backward


def measure(mode: str, patcher, inputs, device, iters: int, extra: dict) -> dict:
    forward, forward_backward = passes(patcher, inputs, device)
    torch.cuda.reset_peak_memory_stats(device)
    record = {"mode": mode, "forward_s": round(timed(forward, iters), 4)}
    try:
        record["forward_backward_s"] = round(timed(forward_backward, iters), 4)
    except RuntimeError as error:  # what a trainer would meet: recorded, not hidden
        record["forward_backward_error"] = str(error).split("Hint")[0].strip()
    record.update(peak_alloc_gb=round(torch.cuda.max_memory_allocated(device) / GIB, 2), **extra)
    print(json.dumps(record), flush=True)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="zimage", choices=list(gpu_train.ARCH_VARIANTS))
    parser.add_argument("--res", type=int, default=1024)
    parser.add_argument("--gpu-gb", type=float, default=4.0, help="weights ComfyUI keeps on the GPU (lowvram)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    gpu_train.prepare_comfy("cuda")
    import comfy.model_management as mm
    from comfyui_version import __version__ as comfy_version

    device = torch.device("cuda")
    mm.in_training = True  # as a training session sets it: ComfyUI's attention then keeps autograd formulas
    dims = gpu_train.VARIANTS[gpu_train.ARCH_VARIANTS[args.arch]]
    text = gpu_train.FLUX2_TEXT_TOKENS if args.arch != "zimage" else 256
    inputs = gpu_train.make_inputs(dims, args.res, 1, text)
    patcher, info = gpu_train.build_model(dims, device, torch.bfloat16)
    rate = copy_rate(device)
    common = {
        "arch": args.arch,
        "resolution": args.res,
        "weights_gb": info["weights_gb"],
        "h2d_gbps": round(rate, 1),
        "comfyui": comfy_version,
        "commit": gpu_train.git_commit(),
        "device": torch.cuda.get_device_name(device),
        "date": time.strftime("%Y-%m-%d"),
    }
    records = [measure("resident", patcher, inputs, device, args.iters, common)]

    patcher.model.to("cpu")
    torch.cuda.empty_cache()
    patcher.offload_device = torch.device("cpu")
    patcher.model.device = device
    budget = int(args.gpu_gb * GIB)
    patcher.load(device, lowvram_model_memory=budget)
    on_gpu = sum(p.numel() * p.element_size() for p in patcher.model.parameters() if p.device.type == "cuda") / GIB
    streamed = info["weights_gb"] * GIB / 1e9 - on_gpu * GIB / 1e9
    floor = {"floor_forward_s": round(streamed / rate, 4), "floor_forward_backward_s": round(2 * streamed / rate, 4)}
    extra = {"weights_on_gpu_gb": round(on_gpu, 2), "num_streams": mm.NUM_STREAMS, **floor}
    records.append(measure("comfy_lowvram", patcher, inputs, device, args.iters, {**common, **extra}))
    if args.out:
        path = Path(args.out)
        old = json.loads(path.read_text()) if path.is_file() else []
        path.write_text(json.dumps(old + records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
