"""The door's one surface: every name the nodes, the dashboard, headless training and the tests use
to reach ComfyUI's MODEL (ModelPatcher), CLIP, VAE, CONDITIONING, LORA_MODEL, LOSS_MAP, sampler,
progress bar, server and folders. The modules beside this one implement them; nothing outside
nodes/comfy/ imports ComfyUI (tests/test_imports.py holds that), and trainer/ never sees it.

    model.py     what a MODEL is (arch detection) and the training forward (ComfyUI's own conds)
    session.py   a training session: fully loaded, grad on, normal tensors, stop at step boundaries
    encoders.py  VAE, CLIP and CLIP vision as the dataset's encoders, with cache identities
    captioning.py  CLIP's generate as a captioner, models/LLM/ for transformers captioners
    lora.py      LoRAs in and out through ComfyUI's own loader, every key checked
    paths.py     which of ComfyUI's code paths training takes (attention, quantized matmuls)
    training.py  the one training sequence of the node and headless training, and their validation sampling
    ui.py        sampling, progress, server events, folders, blocked outputs
    weights.py   a MODEL's effective (patched) weights, one at a time, for extracting a LoRA; a full fine-tune's set
    loaders.py   headless: ComfyUI started as a library, models loaded from files
"""

from __future__ import annotations

from .captioning import (  # noqa: F401
    caption_model_folders,
    clip_captioner,
    clip_loader_choices,
    device_captioner,
)
from .encoders import clip_vision_encoder, conditioning, text_encoder, vae_encoder  # noqa: F401
from .lora import (  # noqa: F401
    apply_lora,
    load_lora_file,
    lora_arrays,
    lora_model_from,
    lora_weights_from,
    negate_lora,
    require_fit,
    training_adapter_merged,
    unmatched_lora_keys,
)
from .model import (  # noqa: F401
    detect_arch,
    diffusion_model,
    item_latent_in,
    latents_in,
    make_forward,
    matching_archs,
)
from .session import (  # noqa: F401
    Interrupted,
    free_memory,
    reload_for_training,
    trainable,
    training_session,
)
from .training import Sample, prompt_samples, step_room, train, validation  # noqa: F401
from .ui import (  # noqa: F401
    Progress,
    add_json_routes,
    add_routes,
    blocked,
    cat_images,
    check_sampling,
    comfyui_root,
    executing_node,
    folders,
    image_tensor,
    interrupt_requested,
    is_blocked,
    lora_names,
    lora_path,
    loss_map,
    model_names,
    model_path,
    progress,
    prompt_server,
    raise_if_interrupted,
    refresh_loras,
    refresh_models,
    sample,
    sampler_names,
    scheduler_names,
    send_event,
)
from .weights import EffectiveWeights, compute_device, with_weights  # noqa: F401
