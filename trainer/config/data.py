"""The settings of what a run reads: the dataset folder, its captions and cache, and the preservation of the
base model (differential output preservation and regularisation images). In a graph the dataset nodes give
these (node="dataset"), except the loss weights, which are Training Options'."""

from __future__ import annotations

from dataclasses import dataclass

from .declaration import setting

__all__ = ["DataFields", "PreservationFields"]


@dataclass
class DataFields:
    dataset_dir: str = setting("", "folder of images + same-stem .txt captions", "data", identity=False, node="dataset")
    resolutions: list[int] = setting(
        [512], "bucket resolutions (area cap res²)", "data", bounds=(64, 4096), node="dataset"
    )
    repeats: int = setting(1, "times each image is seen per epoch", "data", bounds=(1, 1000), node="dataset")
    caption_dropout: float = setting(
        0.05, "probability of training on the empty caption", "data", bounds=(0.0, 1.0), node="dataset"
    )
    trigger_word: str = setting("", "replaces {trigger} in captions, else prepended", "data", node="dataset")
    caption_prefix: str = setting("", "put before every caption (after the trigger word)", "data", node="dataset")
    caption_suffix: str = setting("", "put after every caption", "data", node="dataset")
    default_caption: str = setting(
        "", "for images without a .txt (else the trigger word alone)", "data", node="dataset"
    )
    shuffle_tags: bool = setting(
        False, "shuffle comma-separated tags (seeded variants, each encoded once)", "data", node="dataset"
    )
    keep_tags: int = setting(0, "leading tags that shuffling keeps in place", "data", bounds=(0, 100), node="dataset")
    caption_variants: int = setting(
        4, "shuffled variants cached per caption when shuffle_tags is on", "data", bounds=(1, 64), node="dataset"
    )
    crop: str = setting(
        "center",
        "center or random (seeded, fixed per image so latents stay cached)",
        "data",
        choices=("center", "random"),
        node="dataset",
    )
    cache_dir: str = setting(
        "", "latent/text cache; empty = <dataset_dir>/.kiln_cache", "data", identity=False, node="dataset"
    )
    cache_max_gb: float = setting(
        0.0,
        "prune other entries (least recently used) above this size; 0 = no limit",
        "data",
        bounds=(0.0, 1e6),
        identity=False,
        node="dataset",
    )
    # Clips only (trainer/data/frames.py). Not in the run identity: the dataset's identity holds every clip
    # entry's frames, so an image-only run keeps the identity it had before these existed.
    frames: int = setting(
        33,
        "frames each clip trains with, snapped down to Wan's 4k+1 (1, 5, 9, … 33, … 81); a shorter clip trains "
        "the most it has (as 4k+1). Images ignore it",
        "data",
        bounds=(1, 1025),
        identity=False,
        node="dataset",
    )
    fps: float = setting(
        16.0,
        "resample clips to this frame rate before taking frames (Wan 2.1: 16, Wan 2.2 5B: 24); 0 = each clip's own",
        "data",
        bounds=(0.0, 240.0),
        identity=False,
        node="dataset",
    )
    frame_extraction: str = setting(
        "head",
        "which frames of a clip train: head (the first frames), uniform (spread over the whole clip), windows "
        "(frame_windows runs of frames, evenly spread: several entries per clip)",
        "data",
        choices=("head", "uniform", "windows"),
        identity=False,
        node="dataset",
    )
    frame_windows: int = setting(
        3, "windows per clip when frame_extraction is windows", "data", bounds=(1, 64), identity=False, node="dataset"
    )


@dataclass
class PreservationFields:
    preservation_class: str = setting(
        "",
        "differential output preservation (DOP): the class word that replaces the trigger word in every caption "
        "(e.g. person); those captions are encoded and cached beside the others",
        "data",
        node="dataset",
    )
    preservation_weight: float = setting(
        0.0,
        "DOP: weight of the loss that holds the LoRA's prediction on the class-word caption to the base model's "
        "(ai-toolkit's diff_output_preservation_multiplier; 1.0 is usual); 0 = off. Costs one more forward "
        "without grad a step, and the forward with grad runs twice the batch (slower steps, more activation "
        "memory)",
        "objective",
        bounds=(0.0, 100.0),
    )
    reg_dataset_dir: str = setting(
        "",
        "regularisation images (prior preservation): a folder of class images with their own captions; each "
        "epoch draws them, in batches of their own, beside the training images; empty = none",
        "data",
        identity=False,
        node="dataset",
    )
    reg_repeats: int = setting(
        1, "times each regularisation image is seen per epoch", "data", bounds=(1, 1000), node="dataset"
    )
    reg_weight: float = setting(
        1.0,
        "loss weight of the regularisation batches (kohya's prior_loss_weight)",
        "objective",
        bounds=(0.0, 100.0),
    )
