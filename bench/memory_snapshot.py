"""Where a bench row's peak GPU memory goes: bench/gpu_train.py's row run under torch's allocator history, the
live allocations at the peak summed by the Python frame that made them.

    bash bench/gpu_env.sh python bench/memory_snapshot.py --rows zimage:1024:1:on:default:stream_blocks=34 \
        --steps 6 --warmup 2 [--top 25] [any other gpu_train.py argument]

Prints the peak and its largest allocation sites (file:line function, GiB, count); the allocator's trace is
replayed from torch.cuda.memory._snapshot() (alloc and free events of the device's history).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_train

GIB = 2**30


def site(frames: list[dict]) -> str:
    """The first frame in Kiln, ComfyUI or the bench (skipping torch's own), as file:line function."""
    for frame in frames:
        name = frame.get("filename", "")
        if name.endswith(".py") and "/torch/" not in name:
            return f"{'/'.join(name.split('/')[-3:])}:{frame.get('line')} {frame.get('name')}"
    return "torch internals"


def peak_sites(snapshot: dict, top: int) -> tuple[float, list[tuple[str, float, int]]]:
    """(peak GiB, [(site, GiB, allocations)]) of the live set when the replayed trace peaks."""
    live: dict[int, tuple[int, str]] = {}
    for segment in snapshot["segments"]:  # what was live before the history began: counted, site unknown
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and not block.get("frames"):
                live[segment["address"] + block.get("offset", 0)] = (block["size"], "before the history")
    total = sum(size for size, _ in live.values())
    best, best_live = total, dict(live)
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], site(event.get("frames", [])))
            total += event["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    by_site, counts = Counter(), Counter()
    for size, where in best_live.values():
        by_site[where] += size
        counts[where] += 1
    return best / GIB, [(where, size / GIB, counts[where]) for where, size in by_site.most_common(top)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--top", type=int, default=25)
    args, rest = parser.parse_known_args(argv)
    torch.cuda.memory._record_memory_history(max_entries=500_000)
    gpu_train.main(rest)
    peak, sites = peak_sites(torch.cuda.memory._snapshot(), args.top)
    print(f"[memory] peak of the replayed trace: {peak:.2f} GiB")
    for where, gib, count in sites:
        print(f"[memory] {gib:8.3f} GiB  {count:5d}x  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
