"""ComfyUI's sampler, progress bar, server events and folders, as the nodes and the dashboard use them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import comfy.model_management as mm
import comfy.sample
import comfy.samplers
import comfy.utils
import folder_paths
import numpy as np
import torch
from comfy.cli_args import args
from comfy_execution.graph_utils import ExecutionBlocker
from PIL import Image

from . import paths as comfy_paths
from . import session


def loss_map(history_loss) -> dict:
    """LOSS_MAP as ComfyUI's LossGraph reads it: {'loss': [float, ...]} (non-finite values left out;
    LossGraph itself needs at least two distinct values)."""
    return {"loss": [float(v) for v in history_loss if np.isfinite(v)]}


# ---------------------------------------------------------------- sampling, progress, folders


def sample(
    model,
    positive,
    negative,
    vae,
    *,
    seed: int,
    steps: int,
    cfg: float,
    sampler_name: str,
    scheduler: str,
    width: int,
    height: int,
    frames: int = 1,
    reload_after=None,
    start_latent: dict | None = None,
) -> torch.Tensor:
    """One image through ComfyUI's own sampler (comfy.sample.sample) and vae.decode: IMAGE [1,H,W,3]; a video
    model's clip of `frames` frames (image models ignore it): IMAGE [T,H,W,3].

    Runs in session.sampling (no grad, in_training off, the stop button live; the training model
    loaded again afterwards) on ComfyUI's own code paths; LoRA side branches installed in the module
    forwards take part. `start_latent`: a LATENT to start from instead of the empty one, as KSampler takes it
    (Wan22ImageToVideoLatent's: the start image in the first frame, kept by its noise_mask); its size wins over
    width, height and frames."""
    latent, mask = empty_latent(model, vae, width, height, frames), None
    if start_latent is not None:
        latent = comfy.sample.fix_empty_latent_channels(model, start_latent["samples"][:1])
        mask = start_latent.get("noise_mask")
        mask = mask[:1] if mask is not None else None  # one sample per prompt, as the empty latent's batch of 1
    noise = comfy.sample.prepare_noise(latent, seed)
    with session.sampling(reload_after), comfy_paths.sampling(model):
        samples = comfy.sample.sample(
            model,
            noise,
            steps,
            cfg,
            sampler_name,
            scheduler,
            positive,
            negative,
            latent,
            denoise=1.0,
            noise_mask=mask,
            disable_pbar=True,
            seed=seed,
        )
        images = vae.decode(samples)
    return images.reshape(-1, *images.shape[-3:])[..., :3]


def empty_latent(model, vae, width: int, height: int, frames: int) -> torch.Tensor:
    """The empty latent ComfyUI's own nodes make for this model: EmptySD3LatentImage's [1,C,h,w] for an image
    model; for a video model (a 3-D latent format) EmptyHunyuanLatentVideo's / Wan22ImageToVideoLatent's
    [1,C,(T-1)/4+1,h,w] (48 channels at /16 for Wan 2.2 5B: the latent format says which)."""
    fmt = model.get_model_object("latent_format")
    down = getattr(fmt, "spacial_downscale_ratio", 8)
    if width % down or height % down:
        raise ValueError(f"sample size {width}x{height} must be a multiple of {down} px for this model")
    size = [height // down, width // down]
    if getattr(fmt, "latent_dimensions", 2) == 3:
        # 0.17's latent formats lack temporal_downscale_ratio; the VAE's own decode ratio says it there.
        ratio = getattr(fmt, "temporal_downscale_ratio", None) or vae.temporal_compression_decode() or 4
        size = [(max(frames, 1) - 1) // ratio + 1, *size]
    latent = torch.zeros([1, fmt.latent_channels, *size])
    return comfy.sample.fix_empty_latent_channels(model, latent)


def check_sampling(samplers, schedulers, what: str = "sample_") -> None:
    """Sampler and scheduler names this ComfyUI knows, or a ValueError naming the setting and the choices."""
    for kind, names, known in (("sampler", samplers, sampler_names()), ("scheduler", schedulers, scheduler_names())):
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise ValueError(f"{what}{kind} {unknown[0]!r} is not a {kind} of this ComfyUI; choose one of {known}")


def sampler_names() -> list[str]:
    return list(comfy.samplers.KSampler.SAMPLERS)


def scheduler_names() -> list[str]:
    return list(comfy.samplers.KSampler.SCHEDULERS)


def image_tensor(picture) -> torch.Tensor:
    """A PIL image → IMAGE [1,H,W,3] float in [0,1]."""
    return torch.from_numpy(np.asarray(picture.convert("RGB"), dtype=np.float32) / 255.0)[None]


def cat_images(images: list[torch.Tensor]) -> torch.Tensor:
    """IMAGE batches → one IMAGE batch; smaller images are padded (black) to the largest size."""
    height, width = max(i.shape[1] for i in images), max(i.shape[2] for i in images)
    return torch.cat(
        [torch.nn.functional.pad(i, (0, 0, 0, width - i.shape[2], 0, height - i.shape[1])) for i in images]
    )


class Progress:
    """Per-step progress on the node (comfy.utils.ProgressBar) that also honours the stop button."""

    def __init__(self, total: int):
        self.bar = comfy.utils.ProgressBar(total)

    def update(self, step: int, preview=None, *, preview_pil=None) -> None:
        """preview: a PIL image or an IMAGE tensor (its first image), shown on the node."""
        mm.throw_exception_if_processing_interrupted()  # raises Interrupted; the hook may be throttled
        picture = preview if preview is not None else preview_pil
        if torch.is_tensor(picture):
            picture = Image.fromarray(
                (picture.reshape(-1, *picture.shape[-3:])[0].clamp(0, 1) * 255).round().byte().cpu().numpy()
            )
        shown = None if picture is None else ("JPEG", picture, args.preview_size)
        self.bar.update_absolute(step, self.bar.total, shown)


def progress(total: int) -> Progress:
    return Progress(total)


def prompt_server():
    """ComfyUI's PromptServer.instance, or None when no server runs (tests, headless). Read through
    sys.modules: importing `server` would start building one."""
    return getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)


_ROUTES_ADDED: set[str] = set()


def add_routes(name: str, register) -> None:
    """register(routes) on ComfyUI's server route table, once per name; nothing when no server runs
    (tests, headless). ComfyUI also serves each route under /api."""
    server = prompt_server()
    if server is None or name in _ROUTES_ADDED:
        return
    register(server.routes)
    _ROUTES_ADDED.add(name)


def blocked(message: str | None = None):
    """An output ComfyUI does not pass on: the nodes that read it are skipped, without an error (ComfyUI's
    ExecutionBlocker with no message); with a message, a node that reads it fails with that message."""
    return ExecutionBlocker(message)


def is_blocked(value) -> bool:
    return isinstance(value, ExecutionBlocker)


def executing_node() -> tuple[str | None, str | None]:
    """(node id, prompt id) of the node ComfyUI is running now; (None, None) outside a prompt."""
    utils = sys.modules.get("comfy_execution.utils")
    context = utils.get_executing_context() if utils is not None else None
    return (str(context.node_id), context.prompt_id) if context is not None else (None, None)


def send_event(name: str, data) -> bool:
    """PromptServer.instance.send_sync(name, data) to every client; False when no server runs (tests)."""
    instance = prompt_server()
    if instance is None:
        return False
    instance.send_sync(name, data)
    return True


def folders() -> dict[str, str]:
    return {
        "input": folder_paths.get_input_directory(),
        "output": folder_paths.get_output_directory(),
        "temp": folder_paths.get_temp_directory(),
        "loras": folder_paths.get_folder_paths("loras")[0],
        "diffusion_models": _diffusion_models_folder(),
    }


def _diffusion_models_folder() -> str:
    """models/diffusion_models (ComfyUI lists models/unet first, its legacy name, under the same key)."""
    found = folder_paths.get_folder_paths("diffusion_models")
    return next((f for f in found if os.path.basename(f.rstrip("/\\")) == "diffusion_models"), found[0])


def lora_names() -> list[str]:
    """The files LoraLoader lists (relative names under every models/loras folder)."""
    return folder_paths.get_filename_list("loras")


def lora_path(name: str) -> str:
    """A LoraLoader name → its full path (raises if it is not there)."""
    return folder_paths.get_full_path_or_raise("loras", name)


def model_names(folder: str) -> list[str]:
    """The files ComfyUI lists in one of its model folders ("diffusion_models", "vae", "text_encoders")."""
    return folder_paths.get_filename_list(folder)


def model_path(folder: str, name: str) -> str:
    """A name from model_names(folder) → its full path (raises if it is not there)."""
    return folder_paths.get_full_path_or_raise(folder, name)


def comfyui_root() -> str:
    """ComfyUI's own folder (COMFYUI_PATH for a headless child run that loads models with its loaders)."""
    return str(Path(folder_paths.base_path))


def interrupt_requested() -> bool:
    """Whether the Stop button was pressed, without clearing the request (Progress.update raises it)."""
    return mm.processing_interrupted()


def raise_if_interrupted() -> None:
    """ComfyUI's stop button, as Progress.update honours it: raises Interrupted (clearing the request)."""
    mm.throw_exception_if_processing_interrupted()


def refresh_models(kind: str) -> None:
    """Forget the cached file list of a models folder (`kind`: diffusion_models, ...), as refresh_loras does."""
    folder_paths.filename_list_cache.pop(kind, None)
    helper = getattr(folder_paths, "cache_helper", None)
    if helper is not None:
        helper.cache.pop(kind, None)


def refresh_loras() -> None:
    """Forget the cached `loras` file list so LoraLoader's next listing (object_info) sees new files."""
    folder_paths.filename_list_cache.pop("loras", None)
    helper = getattr(folder_paths, "cache_helper", None)  # per-prompt cache, active while validating
    if helper is not None:
        helper.cache.pop("loras", None)


class _Call:
    """One HTTP request as Kiln's route handlers read it (no aiohttp types leave the door): `params`
    (the path's {names}), `headers`, `method`, `await json()`, and `files()`: each multipart file part
    as (file name, async iterator of byte chunks), streamed, never read whole into memory."""

    def __init__(self, request):
        self.request, self.params, self.headers, self.method = (
            request,
            dict(request.match_info),
            request.headers,
            request.method,
        )

    async def json(self):
        return await self.request.json()

    async def files(self):
        reader = await self.request.multipart()
        while (part := await reader.next()) is not None:
            if part.filename is None:
                await part.release()
                continue

            async def chunks(part=part):
                while chunk := await part.read_chunk(1 << 16):
                    yield chunk

            yield part.filename, chunks()


def add_json_routes(name: str, table) -> None:
    """Register [(method, path, handler)] once under `name`; handler(call) → (HTTP status, JSON body)."""
    from aiohttp import web

    def register(routes) -> None:
        for method, path, handler in table:

            async def serve(request, handler=handler):
                status, body = await handler(_Call(request))
                return web.json_response(body, status=status)

            routes.route(method, path)(serve)

    add_routes(name, register)
