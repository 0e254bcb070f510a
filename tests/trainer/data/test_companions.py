"""Masks and control images follow their image: scan → crop/bucket → latent cache → TrainingData,
and check-dataset names a bad mask or a missing control."""

import numpy as np
import pytest
from PIL import Image

from trainer.data import companions
from trainer.data.dataset import Dataset, DataSettings
from trainer.data.folder.scan import scan


def vae(x):
    """A stand-in VAE: 8×8 average pooling, channels first [B,3,H/8,W/8]."""
    b, h, w, _ = x.shape
    return x.reshape(b, h // 8, 8, w // 8, 8, 3).mean(axis=(2, 4)).transpose(0, 3, 1, 2)


def text(caption):
    return np.full((2, 4), len(caption), np.float32)


def left_half_white(size):
    mask = np.zeros((size[1], size[0]), np.uint8)
    mask[:, : size[0] // 2] = 255
    return Image.fromarray(mask, "L")


def gradient_image(size, tint=0):
    """Pixels that differ across the image, so a crop in the wrong place shows (tint: a distinct copy)."""
    w, h = size
    x = np.linspace(0, 255, w, dtype=np.float32)[None, :].repeat(h, 0)
    y = np.linspace(0, 255, h, dtype=np.float32)[:, None].repeat(w, 1)
    return Image.fromarray(np.stack([x, y, np.full_like(x, tint)], -1).astype(np.uint8), "RGB")


def encode(root, **kw):
    settings = DataSettings(resolutions=kw.pop("resolutions", (128,)), **kw)
    return Dataset.load(root, settings).encode_images(vae, "vae").encode_captions(text, "te")


def expected_mask(mask_image, entry):
    """The closed form: the full mask resized (the image's Lanczos, in float) and cropped as the image,
    then area-averaged 8×8 (the stand-in VAE's grid)."""
    source = Image.fromarray(np.asarray(mask_image, np.float32) / 255, "F")
    full = np.asarray(source.resize(entry.resized, Image.Resampling.LANCZOS), np.float32)
    x, y = entry.offset
    crop = np.clip(full[y : y + entry.bucket[1], x : x + entry.bucket[0]], 0, 1)
    return crop.reshape(crop.shape[0] // 8, 8, crop.shape[1] // 8, 8).mean(axis=(1, 3))


def test_mask_file_is_cropped_like_its_image_and_cached_on_the_latent_grid(tmp_path):
    root = tmp_path / "ds"
    root.mkdir()
    gradient_image((256, 128)).save(root / "wide.png")  # 2:1, trains at 176×80 (area ≤ 128²) → crop
    left_half_white((256, 128)).save(root / "wide.mask.png")
    (root / "wide.txt").write_text("a wide thing")
    ds = encode(root)
    assert [item.path for item in ds.report.items] == ["wide.png"]  # the mask is no training image
    assert ds.report.items[0].mask_file == "wide.mask.png"
    data = ds.training_data()
    (index,) = [i for indices in data.buckets.values() for i in indices]
    latent, mask = data.latent(index), data.mask(index)
    assert mask.shape == (1, *latent.shape[-2:])
    np.testing.assert_allclose(mask[0], expected_mask(left_half_white((256, 128)), ds.plan.entries[index]), atol=1e-5)
    assert mask[0, :, 0].min() == pytest.approx(1.0) and mask[0, :, -1].max() == pytest.approx(0.0)


def test_random_crop_moves_the_mask_with_the_image(tmp_path):
    root = tmp_path / "ds"
    root.mkdir()
    top_half = left_half_white((128, 400)).transpose(Image.Transpose.ROTATE_270)  # 400×128, left half white
    gradient_image((400, 128)).save(root / "long.png")
    top_half.save(root / "long.mask.png")
    offsets = set()
    for seed in range(6):
        ds = encode(root, crop="random", seed=seed)
        data = ds.training_data()
        (index,) = [i for indices in data.buckets.values() for i in indices]
        entry = ds.plan.entries[index]
        offsets.add(entry.offset)
        np.testing.assert_allclose(data.mask(index)[0], expected_mask(top_half, entry), atol=1e-5)
    assert len(offsets) > 1  # the crops differ, and each mask followed its image's


def test_alpha_is_the_mask_when_no_mask_file_exists_and_a_file_wins(tmp_path):
    root = tmp_path / "ds"
    root.mkdir()
    rgba = np.zeros((128, 128, 4), np.uint8)
    rgba[..., :3], rgba[:64, :, 3] = 200, 255  # top half opaque
    Image.fromarray(rgba, "RGBA").save(root / "cut.png")
    rgba[..., 0] = 100
    Image.fromarray(rgba, "RGBA").save(root / "both.png")
    left_half_white((128, 128)).save(root / "both.mask.png")
    gradient_image((128, 128), 7).save(root / "plain.png")
    ds = encode(root)
    data = ds.training_data()
    masks = {data.name(i): data.mask(i) for indices in data.buckets.values() for i in indices}
    assert masks["plain.png"] is None
    np.testing.assert_allclose(masks["cut.png"][0].mean(axis=1), [1] * 8 + [0] * 8, atol=1e-6)  # rows
    np.testing.assert_allclose(masks["both.png"][0].mean(axis=0), [1] * 8 + [0] * 8, atol=1e-6)  # columns


def test_editing_a_mask_changes_the_cache_key(tmp_path):
    root = tmp_path / "ds"
    root.mkdir()
    gradient_image((128, 128)).save(root / "a.png")
    left_half_white((128, 128)).save(root / "a.mask.png")
    before = encode(root).training_data()
    Image.new("L", (128, 128), 255).save(root / "a.mask.png")
    after = encode(root).training_data()
    assert before.mask(0).min() == 0.0 and after.mask(0).min() == 1.0


def test_check_dataset_names_bad_masks_with_a_fix(tmp_path):
    root = tmp_path / "ds"
    root.mkdir()
    for tint, name in enumerate(("ok", "small", "black", "broken")):
        gradient_image((128, 128), tint).save(root / f"{name}.png")
    left_half_white((128, 128)).save(root / "ok.mask.png")
    left_half_white((64, 64)).save(root / "small.mask.png")
    Image.new("L", (128, 128), 0).save(root / "black.mask.png")
    (root / "broken.mask.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    Image.new("L", (128, 128), 255).save(root / "nobody.mask.png")
    report = scan(root)
    problems = {p.file: p for p in report.problems}
    assert problems["small.mask.png"].code == "mask_size" and problems["small.mask.png"].severity == "skipped"
    assert "small.png is 128×128" in problems["small.mask.png"].message
    assert "128×128" in problems["small.mask.png"].fix
    assert problems["black.mask.png"].code == "mask_empty" and problems["black.mask.png"].severity == "warning"
    assert problems["broken.mask.png"].code == "mask_unreadable"
    assert problems["nobody.mask.png"].code == "companion_orphan"
    assert sorted(item.path for item in report.items) == ["black.png", "ok.png"]


# ---------------------------------------------------------------- edit datasets (control/ folders)


def edit_folder(tmp_path, second=False):
    root = tmp_path / "ds"
    for tint, name in enumerate(("a", "b")):
        (root / "control").mkdir(parents=True, exist_ok=True)
        gradient_image((128, 128), tint).save(root / f"{name}.png")
        (root / f"{name}.txt").write_text(f"make {name} blue")
        Image.new("RGB", (128, 128), (0, 0, 200)).save(root / "control" / f"{name}.jpg")
        if second:
            (root / "control_2").mkdir(exist_ok=True)
            Image.new("RGB", (256, 128), (200, 0, 0)).save(root / "control_2" / f"{name}.png")
    return root


def test_control_latents_are_cached_with_their_target(tmp_path):
    root = edit_folder(tmp_path, second=True)
    ds = encode(root)
    assert [i.controls for i in ds.report.items] == [
        ("control/a.jpg", "control_2/a.png"),
        ("control/b.jpg", "control_2/b.png"),
    ]
    data = ds.training_data()
    controls = data.controls(0)
    assert len(controls) == 2 and controls[0].shape == data.latent(0).shape == controls[1].shape
    np.testing.assert_allclose(controls[0][:, 0, 0], np.array([0, 0, 200]) / 255, atol=0.02)  # blue
    np.testing.assert_allclose(controls[1][:, 0, 0], np.array([200, 0, 0]) / 255, atol=0.02)  # red, covered
    assert data.mask(0) is None


def test_check_dataset_names_a_missing_control(tmp_path):
    root = edit_folder(tmp_path)
    (root / "control" / "b.jpg").unlink()
    (root / "control" / "z.png").write_bytes((root / "a.png").read_bytes())
    report = scan(root)
    problems = {p.file: p for p in report.problems}
    assert problems["b.png"].code == "control_missing" and "control/b" in problems["b.png"].message
    assert problems["b.png"].severity == "skipped"
    assert problems["control/z.png"].code == "companion_orphan"
    assert [item.path for item in report.items] == ["a.png"]


def test_companion_names():
    assert companions.is_mask("x/photo.mask.png") and companions.is_mask("photo.MASK.jpg")
    assert not companions.is_mask("mask.png") and not companions.is_mask("photo.mask.txt")
    assert companions.control_slot("control/x.png") == 0 and companions.control_slot("control_3/a/x.png") == 2
    assert companions.control_slot("controls/x.png") is None and companions.control_slot("control") is None


def test_the_dataset_picker_counts_no_masks_or_controls(tmp_path):
    from trainer.data.folder.scan import list_datasets

    edit_folder(tmp_path, second=True)
    gradient_image((128, 128)).save(tmp_path / "ds" / "a.mask.png")
    (summary,) = list_datasets(tmp_path)
    assert (summary.name, summary.images, summary.captions) == ("ds", 2, 2)
