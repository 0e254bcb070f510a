"""The on-disk cache: keys change with their inputs; torn files are recomputed; pruning is LRU."""

import os
import time

import numpy as np

from trainer.data.cache import Cache, latent_key, text_key


def test_keys_follow_every_input():
    base = latent_key("aa", (512, 512), (600, 512), (44, 0), "vae1")
    assert base == latent_key("aa", (512, 512), (600, 512), (44, 0), "vae1")
    for other in (
        latent_key("ab", (512, 512), (600, 512), (44, 0), "vae1"),
        latent_key("aa", (512, 496), (600, 512), (44, 0), "vae1"),
        latent_key("aa", (512, 512), (600, 512), (43, 0), "vae1"),
        latent_key("aa", (512, 512), (600, 512), (44, 0), "vae2"),
    ):
        assert other != base
    assert text_key("a cat", "te1") != text_key("a cat ", "te1") != text_key("a cat", "te2")


def test_roundtrip_torn_file_and_prune(tmp_path):
    cache = Cache(tmp_path)
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    cache.put("latents", "ab" + "0" * 62, {"latent": a})
    np.testing.assert_array_equal(cache.get("latents", "ab" + "0" * 62)["latent"], a)
    torn = cache.put("text", "cd" + "1" * 62, {"context": a})
    torn.write_bytes(torn.read_bytes()[:20])
    assert cache.get("text", "cd" + "1" * 62) is None and not torn.exists()
    paths = [cache.put("latents", f"{i:02x}" + "2" * 62, {"latent": a}) for i in range(4)]
    now = time.time()
    for age, path in enumerate(reversed(paths)):
        os.utime(path, (now - 100 * age, now - 100 * age))
    size = paths[0].stat().st_size
    total = cache.usage().bytes
    removed = cache.prune(total - 2 * size, keep={paths[0]})
    assert removed.files == 2
    assert paths[0].exists() and paths[3].exists() and not paths[1].exists()
    cache.clear()
    assert cache.usage().files == 0


def test_dataset_prune_keeps_its_own_entries(tmp_path):
    from PIL import Image

    from trainer.data.dataset import Dataset, DataSettings

    root = tmp_path / "ds"
    root.mkdir()
    Image.new("RGB", (128, 128), (9, 9, 9)).save(root / "a.png")
    (root / "a.txt").write_text("x", encoding="utf-8")
    vae = lambda x: x[:, ::8, ::8, :].transpose(0, 3, 1, 2)  # noqa: E731
    old = Dataset.load(root, DataSettings(resolutions=(128,))).encode_images(vae, "old-vae")
    new = Dataset.load(root, DataSettings(resolutions=(128,))).encode_images(vae, "new-vae")
    new = new.encode_captions(lambda t: np.ones((2, 3), np.float32), "te")
    assert old.cache_paths() and new.cache_paths()
    new.prune_cache(1e-9)
    assert all(p.exists() for p in new.cache_paths())
    assert not any(p.exists() for p in old.cache_paths())
