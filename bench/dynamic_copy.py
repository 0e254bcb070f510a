"""Host RAM when Kiln trains a model ComfyUI runs with dynamic VRAM (issue 44: "take the weights from where they lie
without a second host copy when RAM is short").

ComfyUI >= 0.17 on NVIDIA (comfy-aimdo) loads a diffusion-model file as a dynamic patcher whose weights are the
file's memory map (page cache, which the kernel gives back under pressure). Kiln trains on ComfyUI's own escape
hatch, the non-dynamic delegate (nodes/comfy/session.py `trainable`), which loads the file again into ordinary
weights. This script measures what each stage holds, in this process (/proc/self/status RssAnon: private memory,
RssFile: mapped file pages) and on the machine (MemAvailable):

  1. the file written (a random-weight model built with ComfyUI's classes, bench/gpu_train.py), the build freed;
  2. comfy.sd.load_diffusion_model with aimdo on (ComfyUI's loader, as UNETLoader calls it);
  3. Kiln's `trainable` (the delegate);
  4. Kiln's training session on it with a step room that leaves part of the model on the host (ComfyUI's partial
     load, as on a small card: --room-gb), the weights Kiln would stream pinned where they lie.

    bash bench/gpu_env.sh python bench/dynamic_copy.py --model klein4b --room-gb 131 --out $OUT/dynamic.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _folder in (ROOT, ROOT / "tests", ROOT / "bench"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

GIB = 2**30


def memory() -> dict:
    """This process's private and file-mapped resident memory and the machine's available memory, in GiB."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = round(int(value.split()[0]) * 1024 / GIB, 2)
    with open("/proc/meminfo") as info:
        for line in info:
            if line.startswith("MemAvailable:"):
                out["MemAvailable"] = round(int(line.split()[1]) * 1024 / GIB, 2)
    return out


def dynamic_vram_on() -> bool:
    """comfy-aimdo started as ComfyUI's main.py starts it (before CUDA is touched); False where it cannot run."""
    import comfy_aimdo.control

    comfy_aimdo.control.init()
    import comfy.memory_management
    import comfy.model_management as mm
    import comfy.model_patcher

    if not comfy_aimdo.control.init_devices(d.index for d in mm.get_all_torch_devices()):
        return False
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="klein4b", help="a bench/gpu_train.py model: zimage, klein4b, ...")
    parser.add_argument(
        "--room-gb", type=float, default=130.0, help="the GPU room the session keeps free (an H200 has ~139 GiB)"
    )
    parser.add_argument("--file", default="", help="default: /tmp/kiln_dynamic_<model>.safetensors")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    args.file = args.file or f"/tmp/kiln_dynamic_{args.model}.safetensors"
    import gpu_train

    gpu_train.prepare_comfy("cuda")
    on = dynamic_vram_on()
    import comfy.sd
    import comfy.utils
    import torch

    from trainer.estimate.common import get_dims

    stages = {"start": memory()}
    dims = get_dims(gpu_train.ARCH_VARIANTS[args.model])
    if not Path(args.file).exists():
        patcher, _ = gpu_train.build_model(dims, torch.device("cuda"), torch.bfloat16, host=True)
        comfy.utils.save_torch_file(patcher.model.diffusion_model.state_dict(), args.file)
        del patcher
        gc.collect()
    stages["file written"] = {**memory(), "file_gib": round(os.path.getsize(args.file) / GIB, 2)}
    model = comfy.sd.load_diffusion_model(args.file)
    stages["loaded (ComfyUI)"] = {**memory(), "dynamic": model.is_dynamic()}
    from helpers import comfy_env

    bridge = comfy_env.import_pack("nodes.comfy.bridge")
    delegate = bridge.trainable(model)
    stages["delegate (Kiln's trainable)"] = {**memory(), "dynamic": delegate.is_dynamic()}
    room = int(args.room_gb * GIB)
    with bridge.training_session(delegate, step_room=lambda total: room) as (dm, _device):
        on_host = sum(p.numel() * p.element_size() for p in dm.parameters() if p.device.type == "cpu")
        stages["training session"] = {**memory(), "weights_left_on_host_gib": round(on_host / GIB, 2)}
    record = {"aimdo": on, "model": args.model, "room_gb": args.room_gb, "stages": stages}
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
