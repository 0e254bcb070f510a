"""Bucket sizes keep aspect, cap area, never upscale, align to the divisor; crops fit; plans are stable."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.data.buckets import Entry, bucket_size, cover, crop_offset, plan_buckets


@settings(max_examples=300, deadline=None)
@given(
    st.integers(64, 8192), st.integers(64, 8192), st.sampled_from([256, 512, 768, 1024]), st.sampled_from([8, 16, 32])
)
def test_bucket_rules(width, height, resolution, divisor):
    bw, bh = bucket_size(width, height, resolution, divisor)
    assert bw % divisor == 0 and bh % divisor == 0
    assert bw * bh <= max(resolution * resolution, divisor * max(width, height) + divisor * divisor)
    if width >= divisor and height >= divisor:
        assert bw <= width and bh <= height  # never upscaled
    rw, rh = cover(width, height, (bw, bh))
    assert rw >= bw and rh >= bh
    assert abs(rw / rh - width / height) / (width / height) < 0.05 + 2 / min(rw, rh)  # aspect kept by the resize


def test_known_sizes():
    assert bucket_size(1024, 1024, 512, 16) == (512, 512)
    assert bucket_size(4000, 3000, 1024, 16) == (1168, 880)  # 4:3 → area ≤ 1024²
    assert bucket_size(600, 400, 1024, 16) == (592, 400)  # smaller than the bucket: not upscaled
    assert math.isclose(1168 / 880, 4 / 3, rel_tol=0.01)


def test_center_and_random_crop():
    assert crop_offset((700, 512), (512, 512), "center") == (94, 0)
    rng = np.random.default_rng(0)
    offsets = {crop_offset((700, 512), (512, 512), "random", rng) for _ in range(50)}
    assert all(0 <= x <= 188 and y == 0 for x, y in offsets) and len(offsets) > 10


def test_plan_dedupes_resolutions_and_is_seeded():
    sizes = [(2048, 1536), (600, 600), (1024, 512)]
    plan = plan_buckets(sizes, [512, 768, 1024], 16)
    per_item = [sum(1 for e in plan.entries if e.item == i) for i in range(3)]
    assert per_item == [3, 2, 2]  # 600²: 512 and its own size; 1024×512: 512 and its own size
    report = plan.report()
    assert sum(report.values()) == len(plan.entries)
    assert "512x512" in plan.format_report()
    hashes = ["ab" * 32, "cd" * 32, "ef" * 32]
    a = plan_buckets(sizes, [512], 16, crop="random", seed=3, hashes=hashes)
    b = plan_buckets(sizes[::-1], [512], 16, crop="random", seed=3, hashes=hashes[::-1])
    assert a.entries[0].offset == b.entries[2].offset  # crop follows the image, not its position
    buckets = a.buckets(repeats=[2, 1, 3])
    assert {k: len(v) for k, v in buckets.items()} == {"576x432": 2, "512x512": 1, "720x352": 3}


def test_entry_key():
    assert Entry(0, 512, (512, 384), (512, 384), (0, 0)).key == "512x384"
