"""Folder → Dataset → cached latents and embeddings → TrainingData, through stand-in encoders."""

import json

import numpy as np
import pytest
from PIL import Image

from trainer.data.captions import CaptionSettings
from trainer.data.dataset import Dataset, DatasetError, DataSettings
from trainer.data.sampler import BucketSampler


class Counting:
    """A stand-in encoder that counts its calls (cache hits must not call it)."""

    def __init__(self, kind):
        self.kind, self.calls = kind, 0

    def __call__(self, x):
        self.calls += 1
        if self.kind == "vae":
            b, h, w, _ = x.shape
            assert x.dtype == np.float32 and 0.0 <= x.min() and x.max() <= 1.0
            return x.reshape(b, h // 8, 8, w // 8, 8, 3).mean(axis=(2, 4)).transpose(0, 3, 1, 2)
        return np.full((len(x.split()) + 1, 4), len(x), dtype=np.float32)


def make(folder, name, size, caption=None, colour=(200, 30, 30)):
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "ds"
    make(root, "a.png", (256, 256), "a red square")
    make(root, "b.jpg", (320, 240), "{trigger} on a table", colour=(10, 200, 10))
    make(root, "3_extra/c.png", (240, 320), None, colour=(10, 10, 200))
    (root / "dataset.json").write_text(json.dumps({"trigger_word": "kiln", "default_caption": "a photo of {trigger}"}))
    return root


def encoded(root, **kw):
    vae, text = Counting("vae"), Counting("text")
    settings = DataSettings(resolutions=(128, 256), **kw)
    ds = Dataset.load(root, settings).encode_images(vae, "vae-1").encode_captions(text, "te-1")
    return ds, vae, text


def test_end_to_end_and_cache_reuse(folder):
    ds, vae, text = encoded(folder)
    data = ds.training_data()
    captions = {item.path: c for item, c in zip(ds.report.items, ds.captions)}
    assert captions == {
        "a.png": ("kiln, a red square",),
        "b.jpg": ("kiln on a table",),
        "3_extra/c.png": ("a photo of kiln",),
    }
    assert "256x256" in data.buckets and "128x128" in data.buckets
    counts = {k: len(v) for k, v in data.buckets.items()}
    assert sum(counts.values()) == 2 * (1 + 1 + 3)  # 2 resolutions; c.png repeats 3 (kohya folder)
    for key, indices in data.buckets.items():
        width, height = map(int, key.split("x"))
        assert data.latent(indices[0]).shape == (3, height // 8, width // 8)
    assert data.empty_context().shape == (1, 4) and data.context(0).shape[1] == 4
    assert (
        {data.name(i) for v in data.buckets.values() for i in v} == set(captions) and vae.calls >= 1 and text.calls == 4
    )  # "", and three captions
    again, vae2, text2 = encoded(folder)
    assert vae2.calls == 0 and text2.calls == 0  # everything came from the cache
    np.testing.assert_array_equal(again.training_data().latent(0), data.latent(0))
    batch = BucketSampler(data.buckets, 2, 0).next()
    assert len({data.latent(i).shape for i in batch}) == 1  # one bucket per batch


def test_changes_invalidate_only_what_changed(folder):
    encoded(folder)
    (folder / "a.txt").write_text("a blue square", encoding="utf-8")
    _, vae, text = encoded(folder)
    assert vae.calls == 0 and text.calls == 1
    make(folder, "a.png", (256, 256), None, colour=(0, 0, 0))
    _, vae, text = encoded(folder)
    assert vae.calls == 2 and text.calls == 0  # two resolutions of the changed image
    ds = Dataset.load(folder, DataSettings(resolutions=(128, 256)))
    fresh = Counting("vae")
    ds.encode_images(fresh, "vae-2")
    assert fresh.calls > 0  # another VAE: nothing reused


def test_decode_failure_at_encode_time_is_skipped_and_named(folder):
    ds = Dataset.load(folder, DataSettings(resolutions=(128,)))
    (folder / "b.jpg").write_bytes((folder / "b.jpg").read_bytes()[:200])  # broken after the scan
    ds = ds.encode_images(Counting("vae"), "vae-1").encode_captions(Counting("text"), "te-1")
    assert [p.file for p in ds.skipped] == ["b.jpg"]
    data = ds.training_data()
    assert "b.jpg" not in {data.name(i) for v in data.buckets.values() for i in v}
    assert "b.jpg" in ds.summary()


def test_errors_name_the_fix(tmp_path, folder):
    with pytest.raises(DatasetError, match="nothing to train on"):
        Dataset.load(tmp_path / "missing")
    ds = Dataset.load(folder)
    with pytest.raises(DatasetError, match="Encode Images and Encode Captions"):
        ds.training_data()


def test_shuffle_variants_are_cached_and_drawn(folder):
    (folder / "a.txt").write_text("red, square, flat, simple", encoding="utf-8")
    caps = CaptionSettings(shuffle_tags=True, keep_tags=1, variants=3)
    ds, _, text = encoded(folder, captions=caps)
    data = ds.training_data()
    item = next(n for n, i in enumerate(ds.report.items) if i.path == "a.png")
    index = next(n for n, e in enumerate(ds.plan.entries) if e.item == item)
    assert data.variants(index) == 3
    assert [data.caption(index, v) for v in range(3)][0] == "kiln, red, square, flat, simple"
    assert all(data.caption(index, v).startswith("kiln, red, ") for v in range(3))


def test_folder_fingerprint_follows_edits(folder):
    from trainer.data.dataset import folder_fingerprint

    first = folder_fingerprint(folder)
    assert folder_fingerprint(folder) == first
    (folder / "a.txt").write_text("changed caption text", encoding="utf-8")
    second = folder_fingerprint(folder)
    assert second != first
    (folder / ".kiln_cache").mkdir(exist_ok=True)
    (folder / ".kiln_cache" / "x").write_text("cache files do not count")
    assert folder_fingerprint(folder) == second


def pooled_encoder(text):
    """An encoder that gives conditioning beside the embedding, as SD 3.5's does (its pooled CLIP vector)."""
    return {
        "context": np.full((len(text.split()) + 1, 4), len(text), np.float32),
        "pooled_output": np.full(3, len(text) + 0.5, np.float32),
    }


def test_conditioning_beside_the_embedding_is_cached_and_batched(folder):
    from trainer.archs import get_arch
    from trainer.objective.flow import ObjectiveSettings
    from trainer.run import holdout
    from trainer.run.loop import build_batch

    ds = Dataset.load(folder, DataSettings(resolutions=(128,))).encode_images(Counting("vae"), "vae-1")
    data = ds.encode_captions(pooled_encoder, "te-pooled").training_data()
    index = data.buckets["128x128"][0]
    assert list(data.conds(index)) == ["pooled_output"]
    assert data.conds(index)["pooled_output"][0] == len(data.caption(index)) + 0.5
    assert np.array_equal(data.context(index), pooled_encoder(data.caption(index))["context"])
    assert data.empty_conds()["pooled_output"].tolist() == [0.5] * 3
    # One row per caption, the dropped captions' from the empty caption (caption dropout drops both).
    rows = [index, index]
    arch, settings = get_arch("generic"), ObjectiveSettings()
    kept = build_batch(data, rows, np.random.default_rng(0), settings, arch, 0.0)
    assert kept.extras["pooled_output"].shape == (2, 3)
    assert kept.extras["pooled_output"][:, 0].tolist() == [len(data.caption(index)) + 0.5] * 2
    dropped = build_batch(data, rows, np.random.default_rng(0), settings, arch, 1.0)
    assert dropped.extras["pooled_output"].tolist() == [[0.5] * 3] * 2
    # The held-out loss's rows carry the caption's too.
    config = type("Config", (), {"seed": 0, "holdout_sigmas": 2, "batch_size": 2, "unmasked_weight": 1.0})
    (held,) = holdout.batches(data, [index], config, arch)
    assert held.extras["pooled_output"][:, 0].tolist() == [len(data.caption(index)) + 0.5] * 2
    # An embedding-only encoder's cache gives none, and its batches no extra.
    plain = ds.encode_captions(Counting("text"), "te-1").training_data()
    assert (
        plain.conds(index) == {}
        and build_batch(plain, rows, np.random.default_rng(0), settings, arch, 0.0).extras == {}
    )
