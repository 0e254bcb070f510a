"""What a folder's images are worth, as check-dataset prints it and the dataset editor shows it: the scan,
the bucket plan at each resolution, the quality pass (cached in the folder's .kiln_cache/quality.json) and
one verdict per image (quality.verdicts)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .report import ScanReport


@dataclass
class Review:
    report: ScanReport
    buckets: list[dict] | None  # describe_plan's list, when there are resolutions
    verdicts: list[dict] | None  # quality.verdicts', when the quality pass ran


def review(
    folder: str | Path,
    *,
    resolutions=None,
    arch: str = "",
    deep: bool = False,
    quality: bool = True,
    default_resolutions=None,
    frames=None,
) -> Review:
    """Scan `folder`, plan its buckets at `resolutions` (else dataset.json's, else default_resolutions; none:
    no plan) and, with `quality`, run the quality pass with the captions each image trains with, against
    `arch`'s caption token limit (every family's when empty). frames: how clips train (a FrameSettings; those
    at their defaults take dataset.json's)."""
    from ...archs import ARCHS, dataset_divisor, get_arch
    from ..captions import caption_variants
    from ..dataset import CACHE_FOLDER, DataSettings, describe_plan, plan_for
    from ..frames import FrameSettings
    from . import quality as quality_pass
    from .scan import scan

    frames = frames or FrameSettings()
    report = scan(folder, deep=deep, resolutions=resolutions, frames=frames)
    resolutions = resolutions or report.meta.resolutions or default_resolutions
    buckets = verdicts = None
    if resolutions and report.items:
        settings = DataSettings(resolutions=tuple(resolutions), divisor=dataset_divisor(), frames=frames)
        plan = plan_for(report.items, settings.with_meta(report.meta))
        buckets = describe_plan(plan, report.items, resolutions)
    if quality and report.items:
        captions = DataSettings().with_meta(report.meta).captions  # the text each image trains with
        texts = [caption_variants(i.caption, captions, seed=0, key=i.sha256)[0] for i in report.items]
        archs = [get_arch(arch)] if arch else ARCHS.values()
        quality_pass.assess(
            report,
            texts,
            quality_pass.token_limits(archs),
            cache_file=Path(folder) / CACHE_FOLDER / quality_pass.CACHE_FILE,
        )
        verdicts = quality_pass.verdicts(report, buckets)
    return Review(report, buckets, verdicts)
