"""A dataset from folder to training batches: scan → bucket plan → cached latents and embeddings.

`Dataset` is what the Load Dataset node hands on as KILN_DATASET (no pixels
yet); Encode Images and Encode Captions each return a new Dataset with their
cache filled, never mutating the one they were given (ComfyUI may reuse it).
The VAE and the text encoder come in as plain functions with an identity
string, so this layer never imports ComfyUI:

    encode_images(pixels [B,H,W,3] float32 in 0..1) -> latents [B,C,h,w]
    encode_text(caption: str) -> embedding [T,D], or {"context": [T,D], other conditioning} (text_conds.py)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from . import DatasetError  # noqa: F401  (raised here; callers import it from here too)
from . import text_conds
from .buckets import BucketPlan, Entry, plan_buckets
from .cache import Cache, latent_key, text_key
from .cached import CachedData
from .captions import CaptionSettings, caption_variants, class_caption
from .companions import companions_key
from .encoding import ImageEncoder, Progress, encode_latents
from .folder.report import DatasetMeta, Item, Problem, ScanReport, format_report
from .frames import FrameSettings, clip_windows
from .regularised import RegularisedData

TextEncoder = Callable[[str], np.ndarray | dict[str, np.ndarray]]

CACHE_FOLDER = ".kiln_cache"


@dataclass(frozen=True)
class DataSettings:
    resolutions: tuple[int, ...] = ()  # empty: dataset.json's, else 512
    divisor: int = 16
    crop: str = "center"  # "center" | "random" (seeded, fixed per image)
    repeats: int = 0  # times every image is seen per epoch (× kohya folder repeats); 0: dataset.json's, else 1
    captions: CaptionSettings = field(default_factory=CaptionSettings)
    seed: int = 0
    deep: bool = False  # decode every image while scanning
    caption_dropout: float = 0.05  # carried to training (the Load Dataset node sets it)
    quality: bool = False  # also look for near-duplicates, blur and long captions (quality.py)
    frames: FrameSettings = field(default_factory=FrameSettings)  # how clips train (frames.py)

    @classmethod
    def from_config(cls, cfg, divisor: int) -> "DataSettings":
        """A TrainConfig's data fields."""
        captions = CaptionSettings(
            trigger_word=cfg.trigger_word,
            prefix=cfg.caption_prefix,
            suffix=cfg.caption_suffix,
            default_caption=cfg.default_caption,
            shuffle_tags=cfg.shuffle_tags,
            keep_tags=cfg.keep_tags,
            variants=cfg.caption_variants,
        )
        return cls(
            resolutions=tuple(cfg.resolutions),
            divisor=divisor,
            crop=cfg.crop,
            repeats=cfg.repeats,
            captions=captions,
            seed=cfg.seed,
            caption_dropout=cfg.caption_dropout,
            frames=FrameSettings(cfg.frames, cfg.fps, cfg.frame_extraction, cfg.frame_windows),
        )

    def with_meta(self, meta: DatasetMeta) -> "DataSettings":
        """dataset.json fills the caption texts left empty here (the node or config wins)."""
        c = self.captions
        captions = dataclasses.replace(
            c,
            trigger_word=c.trigger_word or meta.trigger_word,
            prefix=c.prefix or meta.caption_prefix,
            suffix=c.suffix or meta.caption_suffix,
            default_caption=c.default_caption or meta.default_caption,
        )
        return dataclasses.replace(
            self,
            captions=captions,
            resolutions=self.resolutions or tuple(meta.resolutions or (512,)),
            repeats=self.repeats or meta.repeats or 1,
            frames=self.frames.with_meta(meta),
        )


@dataclass(frozen=True)
class Dataset:
    report: ScanReport
    settings: DataSettings
    plan: BucketPlan
    captions: tuple[tuple[str, ...], ...]  # per item: the caption variants to encode
    cache_dir: Path
    latent_identity: str | None = None
    text_identity: str | None = None
    failed_items: frozenset[int] = frozenset()  # items whose image failed to decode at encode time
    encode_problems: tuple[Problem, ...] = ()
    preservation_class: str = ""  # DOP: class word for the trigger word (with_preservation)
    regularisation: Dataset | None = None  # regularisation images trained beside (with_regularisation)
    start_images: bool = False  # clips' start images cached too (image-to-video: encode_images)
    vision_identity: str | None = None  # and their CLIP vision features, by this encoder (Wan 2.1 I2V)

    # --- building -------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        root: str | Path,
        settings: DataSettings = DataSettings(),
        *,
        cache_dir: str | Path | None = None,
        min_side: int = 64,
    ) -> "Dataset":
        from .folder.scan import scan

        report = scan(
            root,
            deep=settings.deep,
            resolutions=settings.resolutions or (512,),
            min_side=min_side,
            frames=settings.frames,
        )
        if not report.ok:
            raise DatasetError(describe_failure(report))
        items, settings = report.items, settings.with_meta(report.meta)
        plan = plan_for(items, settings)
        captions = tuple(
            tuple(caption_variants(i.caption, settings.captions, seed=settings.seed, key=i.sha256)) for i in items
        )
        cache = Path(cache_dir) if cache_dir else Path(report.root) / CACHE_FOLDER
        if settings.quality:
            from ..archs import ARCHS
            from .folder.quality import CACHE_FILE, assess, token_limits

            assess(
                report,
                [variants[0] for variants in captions],
                token_limits(ARCHS.values()),
                cache_file=cache / CACHE_FILE,
            )
        return cls(report, settings, plan, captions, cache)

    @property
    def cache(self) -> Cache:
        return Cache(self.cache_dir)

    def usable_entries(self) -> list[int]:
        return [n for n, e in enumerate(self.plan.entries) if e.item not in self.failed_items]

    def entry_key(self, entry: Entry) -> str:
        item = self.report.items[entry.item]
        return latent_key(
            item.sha256,
            entry.bucket,
            entry.resized,
            entry.offset,
            self.latent_identity or "",
            companions_key(item) + (self._start_key() if entry.frames else ""),
            entry.frames,
        )

    def _start_key(self) -> str:
        """A clip's key part for its start image and the CLIP vision model that encoded it (a change re-encodes)."""
        if not self.start_images:
            return ""
        return "|start" + (f"|clip_vision:{self.vision_identity}" if self.vision_identity else "")

    def texts(self) -> list[str]:
        """Every distinct text to encode, the empty caption (for caption dropout) first, then the class-word
        captions of differential output preservation (when on)."""
        class_texts = (c for variants in self.preservation_captions() for c in variants)
        return list(dict.fromkeys(["", *(c for variants in self.captions for c in variants), *class_texts]))

    def preservation_captions(self) -> tuple[tuple[str, ...], ...]:
        """Per item, its caption variants with the trigger word replaced by the class word; none when off."""
        if not self.preservation_class:
            return ()
        trigger = self.settings.captions.trigger_word
        return tuple(
            tuple(class_caption(c, trigger, self.preservation_class) for c in variants) for variants in self.captions
        )

    def with_preservation(self, class_word: str, where: str = "preservation_class") -> Dataset:
        """The dataset whose captions are also encoded with the trigger word replaced by `class_word` (DOP)."""
        class_word = class_word.strip()
        if class_word and not self.settings.captions.trigger_word.strip():
            raise DatasetError(
                f"{where} {class_word!r}: the dataset {self.report.root} has no trigger word to "
                "replace; set trigger_word (Load Dataset, the config or dataset.json), or leave "
                f"{where} empty"
            )
        return dataclasses.replace(self, preservation_class=class_word)

    def with_regularisation(self, reg: Dataset | None) -> Dataset:
        """The dataset that trains with `reg`'s images beside its own (prior preservation; regularised.py)."""
        return dataclasses.replace(self, regularisation=reg)

    def encode_images(
        self,
        encode: ImageEncoder,
        identity: str,
        *,
        batch_size: int = 4,
        progress: Progress | None = None,
        start_images: bool = False,
        clip_vision: tuple[ImageEncoder, str] | None = None,
    ) -> "Dataset":
        """Cache a latent per entry; images that fail to decode are skipped and named, not fatal. start_images:
        each clip's start image is encoded beside it (image-to-video; companions.start_pixels). clip_vision
        ((encode, identity): start images [B,H,W,3] → [B,T,D]): their CLIP vision features too (implies
        start_images: Wan 2.1 I2V reads both)."""
        vision, vision_identity = clip_vision if clip_vision is not None else (None, None)
        ds = dataclasses.replace(
            self,
            latent_identity=identity,
            start_images=start_images or vision is not None,
            vision_identity=vision_identity,
        )
        failed, problems = encode_latents(ds, encode, batch_size=batch_size, progress=progress, vision=vision)
        if len(failed) == len(self.report.items):
            raise DatasetError(
                f"{self.report.root}: no image could be decoded:\n" + "\n".join(p.line() for p in problems)
            )
        return dataclasses.replace(ds, failed_items=frozenset(failed), encode_problems=tuple(problems))

    def encode_captions(self, encode: TextEncoder, identity: str, *, progress: Progress | None = None) -> "Dataset":
        """Cache every text's entry: its embedding and the encoder's other conditioning (data/text_conds.py)."""
        ds = dataclasses.replace(self, text_identity=identity)
        cache, texts = ds.cache, self.texts()
        width, names = None, None
        for done, text in enumerate(texts, 1):
            key = text_key(text, identity)
            if not cache.has("text", key):
                tensors = text_conds.entry(encode(text))
                embedding = tensors[text_conds.CONTEXT]
                if embedding.ndim != 2 or (width is not None and embedding.shape[1] != width):
                    raise DatasetError(
                        f"the text encoder returned shape {embedding.shape} for {text!r}; "
                        "expected [tokens, dim] with one dim for every caption"
                    )
                if names is not None and set(tensors) != names:
                    raise DatasetError(
                        f"the text encoder gave {sorted(tensors)} for {text!r} but {sorted(names)} for another "
                        "caption; Kiln caches one kind of conditioning per encoder"
                    )
                width, names = embedding.shape[1], set(tensors)
                cache.put("text", key, tensors, {"text": text}, dtype="BF16")
            if progress is not None:
                progress(done, len(texts))
        return ds

    def cache_paths(self) -> set[Path]:
        """The cache files this dataset reads (kept when the cache is pruned)."""
        cache, out = self.cache, set()
        if self.latent_identity is not None:
            out |= {cache.path("latents", self.entry_key(self.plan.entries[n])) for n in self.usable_entries()}
        if self.text_identity is not None:
            out |= {cache.path("text", text_key(t, self.text_identity)) for t in self.texts()}
        if self.regularisation is not None:  # a shared cache folder keeps the regularisation set's entries too
            out |= self.regularisation.cache_paths()
        return out

    def prune_cache(self, max_gb: float):
        """Keep the cache under `max_gb` by deleting least recently used entries of other datasets/encoders."""
        return self.cache.prune(int(max_gb * 2**30), keep=self.cache_paths()) if max_gb > 0 else None

    # --- training ----------------------------------------------------------------
    def training_data(self, memory_budget: int = 2 << 30) -> CachedData:
        missing = [
            name
            for name, ident in (("Encode Images", self.latent_identity), ("Encode Captions", self.text_identity))
            if ident is None
        ]
        if missing:
            raise DatasetError(f"{self.report.root}: run {' and '.join(missing)} on this dataset before training")
        if self.regularisation is None:
            return CachedData(self, memory_budget)
        return RegularisedData.of(self, CachedData(self, memory_budget), memory_budget)

    @property
    def skipped(self) -> list[Problem]:
        """Files left out, by the scan or at encode time; the training log names them again."""
        return self.report.skipped + list(self.encode_problems)

    def report_text(self) -> str:
        """What Load Dataset shows on its node: check-dataset's report with the bucket plan (and, after the
        quality pass, a verdict line per image)."""
        from .folder.quality import verdict_line, verdicts

        buckets = describe_plan(self.plan, self.report.items, self.settings.resolutions)
        lines = [verdict_line(v) for v in verdicts(self.report, buckets)] if self.settings.quality else None
        return format_report(self.report, buckets, verdicts=lines)

    def summary(self) -> str:
        report = self.report
        lines = [
            f"{report.root}: {len(report.items) - len(self.failed_items)} usable images, "
            f"{len(self.skipped)} skipped, {len(report.warnings)} warnings",
            self.plan.format_report(),
        ]
        lines += [f"  skipped {p.line()}" for p in self.skipped]
        return "\n".join(lines)


def plan_for(items: list[Item], settings: DataSettings) -> BucketPlan:
    """The bucket plan of the usable items at settings' resolutions (training and check-dataset share it)."""
    return plan_buckets(
        [(i.width, i.height) for i in items],
        list(settings.resolutions),
        settings.divisor,
        crop=settings.crop,
        seed=settings.seed,
        hashes=[i.sha256 for i in items],
        windows=[clip_windows(i.frames, i.fps, settings.frames) if i.is_clip else [] for i in items],
    )


def describe_plan(plan: BucketPlan, items: list[Item], resolutions) -> list[dict]:
    """BucketPlan.describe() for scanned items: per resolution, each bucket with its images and their crops."""
    return plan.describe([i.path for i in items], [(i.width, i.height) for i in items], list(resolutions))


def describe_failure(report: ScanReport) -> str:
    lines = [f"dataset {report.root} has nothing to train on:"]
    lines += [f"  {p.line()}" for p in report.fatal + report.skipped]
    if not report.fatal and not report.skipped:
        lines.append("  no images found: add .png/.jpg/.webp files with same-name .txt captions")
    return "\n".join(lines)


def folder_fingerprint(root: str | Path) -> str:
    """Names, sizes and mtimes of every file below `root` (cache folder excluded): cheap, and it
    changes when an image or caption is added, removed or edited (ComfyUI re-runs Load Dataset then)."""
    import hashlib
    import os

    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            try:
                stat = os.stat(os.path.join(folder, name))
            except OSError:
                continue
            digest.update(
                f"{os.path.relpath(os.path.join(folder, name), root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode(
                    "utf-8", "surrogateescape"
                )
            )
    return digest.hexdigest()
