"""ComfyUI's VAE and CLIP as the dataset's encoders, with stable identities for the latent caches."""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def vae_encoder(vae):
    """(encode, identity): encode(pixels [B,H,W,3] float32 in [0,1]) -> raw VAE latents [B,C,h,w]
    float32, exactly VAEEncode's output (no process_in: caches stay model-independent). Clips
    [B,T,H,W,3] -> [B,C,t,h,w] (a video VAE, Wan's: t = (T-1)/4+1), each clip one VAE call as VAEEncode's."""
    ratio = vae.downscale_ratio

    def encode(pixels: np.ndarray) -> np.ndarray:
        pixels = np.asarray(pixels, dtype=np.float32)
        if pixels.ndim not in (4, 5) or pixels.shape[-1] < 3:
            raise ValueError(f"expected images [B,H,W,3] or clips [B,T,H,W,3], got {list(pixels.shape)}")
        if isinstance(ratio, int) and (pixels.shape[-3] % ratio or pixels.shape[-2] % ratio):
            raise ValueError(
                f"image {pixels.shape[-2]}x{pixels.shape[-3]} is not a multiple of the VAE's {ratio} px; "
                "ComfyUI would crop it, so the bucket plan would not match"
            )
        # A video VAE reads a batch of images as the frames of one clip: each image (or clip) is its own call.
        one_by_one = pixels.ndim == 5 or getattr(vae, "latent_dim", 2) == 3
        batches = [pixels[n : n + 1] if pixels.ndim == 4 else pixels[n] for n in range(len(pixels))]
        with torch.inference_mode():
            parts = [_vae_encode(vae, part) for part in (batches if one_by_one else [pixels])]
        latents = torch.cat(parts)
        if pixels.ndim == 4 and latents.ndim == 5 and latents.shape[2] == 1:  # a video VAE's one frame: an image
            latents = latents[:, :, 0]
        return latents.float().cpu().numpy()

    identity = _remembered(
        vae,
        lambda: _identity(
            "vae",
            type(vae.first_stage_model).__name__,
            vae.latent_channels,
            ratio,
            vae.vae_dtype,
            tensors=_weights(vae.patcher),
            patches=vae.patcher.patches,
        ),
    )
    return encode, identity


def _vae_encode(vae, pixels: np.ndarray):
    return vae.encode(torch.from_numpy(np.ascontiguousarray(pixels[..., :3])))


def clip_vision_encoder(clip_vision):
    """(encode, identity): encode(images [B,H,W,3] float32 in [0,1]) -> [B,T,D] float32, each image's
    penultimate_hidden_states as CLIPVisionEncode gives them with crop "none" (the crop of ComfyUI's Wan
    image-to-video templates, and what WAN21.extra_conds feeds as clip_fea). Each image is its own call, as the
    node encodes the one start image a workflow gives it (a batch could round otherwise)."""

    def encode(images: np.ndarray) -> np.ndarray:
        images = np.asarray(images, dtype=np.float32)
        if images.ndim != 4 or images.shape[-1] < 3:
            raise ValueError(f"expected images [B,H,W,3], got {list(images.shape)}")
        with torch.inference_mode():
            parts = [
                clip_vision.encode_image(torch.from_numpy(np.ascontiguousarray(image[None, ..., :3])), crop=False)
                for image in images
            ]
        return torch.cat([part.penultimate_hidden_states for part in parts]).float().cpu().numpy()

    identity = _remembered(
        clip_vision,
        lambda: _identity(
            "clip_vision",
            type(clip_vision.model).__name__,
            getattr(clip_vision, "model_type", ""),
            clip_vision.image_size,
            "crop none",
            tensors=_weights(clip_vision.patcher),
            patches=clip_vision.patcher.patches,
        ),
    )
    return encode, identity


def text_encoder(clip):
    """(encode, identity): encode(text) -> {"context": [T,D], key: array}, float32: CLIPTextEncode's cond tensor
    for that text and every other tensor of its conditioning (SD 3.5's and HiDream's pooled_output [P], HiDream's
    conditioning_llama3 [L,T',D]), each without its batch axis of one. The model's extra_conds reads them.

    Left out: None values (pooled_output of the Qwen/Mistral encoders) and attention_mask (Flux2 reads it only
    with attention_mask_img_shape; one Z-Image or Qwen-Image prompt's is all ones, so its length, kept in the
    context's tokens, says everything ComfyUI takes from it).
    """

    def encode(text: str) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            conds = clip.encode_from_tokens_scheduled(clip.tokenize(text))
        if len(conds) != 1:
            raise ValueError(f"this CLIP gives {len(conds)} scheduled conds (CLIP hooks); Kiln caches one per caption")
        cond, others = conds[0]
        out = {"context": cond[0].float().cpu().numpy()}
        for key, value in others.items():
            if torch.is_tensor(value) and key not in NOT_CACHED:
                out[key] = value[0].float().cpu().numpy()
        return out

    def facts() -> tuple:
        # The names of the conditioning it gives beside the embedding are part of an encoder's identity where it
        # gives any: caption caches written before Kiln kept them (SD 3.5's came without its pooled output) are
        # then never read, and encoded again; an encoder of the embedding alone keeps the identity it had.
        extra = sorted(set(encode("")) - {"context"})
        return (
            type(clip.cond_stage_model).__name__,
            type(clip.tokenizer).__name__,
            clip.layer_idx,
            sorted(getattr(clip, "tokenizer_options", {}).items()),
            *([("conditioning", extra)] if extra else []),
        )

    identity = _remembered(
        clip, lambda: _identity("clip", *facts(), tensors=_weights(clip.patcher), patches=clip.patcher.patches)
    )
    return encode, identity


# Conditioning keys the caption cache leaves out (why: text_encoder's docstring).
NOT_CACHED = frozenset({"attention_mask"})


def conditioning(clip, text: str):
    """CONDITIONING for a prompt, as CLIPTextEncode makes it (every key kept: it goes to the sampler)."""
    with torch.inference_mode():
        return clip.encode_from_tokens_scheduled(clip.tokenize(text))


def _remembered(owner, compute) -> str:
    """An encoder's identity, computed once per VAE/CLIP object: ComfyUI may cast an encoder's weights
    when it moves them to the GPU (seen on an H200 with an fp32 text encoder), and a later hash of
    the cast weights would miss the cache. Patching a VAE/CLIP (LoRA on CLIP) clones the object,
    so a changed encoder still gets a new identity."""
    cached = getattr(owner, "_kiln_identity", None)
    if cached is None:
        cached = compute()
        try:
            owner._kiln_identity = cached
        except AttributeError:  # an object that takes no attributes: recompute each time
            pass
    return cached


def _weights(patcher):
    """The model's own weights, with in-place-patched ones swapped back for their originals."""
    sd = patcher.model.state_dict()
    for key, backup in getattr(patcher, "backup", {}).items():
        if key in sd:
            sd[key] = backup.weight
    return sd


def _identity(kind: str, *facts, tensors: dict, patches: dict) -> str:
    """A stable cache key: facts, every tensor's name/shape/dtype and a strided sample of its values."""
    digest = hashlib.sha256(repr((kind, facts)).encode())

    def feed(name: str, value) -> None:
        if not torch.is_tensor(value):
            digest.update(f"{name}={value!r};".encode())
            return
        digest.update(f"{name}:{tuple(value.shape)}:{value.dtype};".encode())
        try:
            flat = value.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 64)][:64].float().cpu().numpy()
            digest.update(sample.tobytes())
        except Exception:  # noqa: BLE001  (quantized or meta tensors: shape and dtype only)
            pass

    for key in sorted(tensors):
        feed(key, tensors[key])
    for key in sorted(patches):
        for number, patch in enumerate(patches[key]):
            strength, data, strength_model = patch[0], patch[1], patch[2]
            feed(f"{key}#{number}", (strength, strength_model, type(data).__name__))
            for index, value in enumerate(getattr(data, "weights", data if isinstance(data, tuple) else ())):
                feed(f"{key}#{number}.{index}", value if torch.is_tensor(value) else repr(value)[:64])
    return f"{kind}-{digest.hexdigest()[:24]}"
