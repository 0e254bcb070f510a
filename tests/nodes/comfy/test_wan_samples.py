"""Validation samples of a video model (Wan): a clip of Validation Settings' `frames` frames from ComfyUI's sampler
on the empty latent ComfyUI's own video nodes make, decoded by ComfyUI's Wan VAE, saved as an animated WebP where an
image model's PNG goes (the run folder's samples/, the dashboard's temp/kiln/); an image model's samples unchanged."""

from __future__ import annotations

from helpers import comfy_env
import pytest

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()  # skips this whole module without COMFYUI_PATH

from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from helpers import tiny_comfy as tc  # noqa: E402
from helpers.node_runs import out  # noqa: E402
from helpers.tiny_wan import caption, cond, load, tiny_wan_vae, write_wan_file  # noqa: E402
from PIL import Image  # noqa: E402
import torch  # noqa: E402

import kiln_pack.nodes.comfy.bridge as bridge
from kiln_pack.nodes.comfy import ui
import kiln_pack.nodes.train_nodes as tn
from kiln_pack.trainer.samples.grid import SampleGrid

SETTINGS = dict(seed=3, steps=2, cfg=1.0, sampler_name="euler", scheduler="simple")


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return load(write_wan_file(tmp_path_factory.mktemp("wan") / "t2v.safetensors"))


@pytest.fixture(scope="module")
def wan_vae():
    return tiny_wan_vae()


def webp_frames(path) -> tuple[int, tuple[int, int], str]:
    with Image.open(path) as clip:
        return clip.n_frames, clip.size, clip.format


def test_validation_settings_takes_frames_then_start_latent_last_with_tooltips():
    inputs = tn.KilnValidationSettings.define_schema().inputs
    assert inputs[-2].id == "frames" and inputs[-2].tooltip and inputs[-2].default == 33
    assert inputs[-1].id == "start_latent" and inputs[-1].optional and "Wan22ImageToVideoLatent" in inputs[-1].tooltip
    assert [i.id for i in inputs[-4:-2]] == ["every", "validation"]  # the shipped inputs keep their places


def test_a_wan_runs_validation_sample_is_an_animated_webp_of_the_frame_count(wan, wan_vae, tmp_path):
    chain = out(
        tn.KilnValidationSettings.execute(
            positive=cond(caption(7, 1)),
            negative=cond(caption(0, 2)),
            vae=wan_vae,
            **SETTINGS,
            width=48,
            height=32,
            every=1,
            frames=9,
        )
    )
    grid = SampleGrid(tmp_path, chain.prompts)
    drawn = []

    def on_sample(step, index, images):
        drawn.append(images)
        grid.save_sample(step, index, images.float().cpu().numpy())
        grid.add(step, index, images.float().cpu().numpy())

    sinks = bridge.validation(SimpleNamespace(backend="torch", arch="wan21_t2v"), wan, chain.samples, on_sample)(5)
    (images,) = drawn
    assert tuple(images.shape) == (9, 32, 48, 3)  # [T,H,W,C]: 9 frames = 3 latent frames through the Wan VAE
    assert len(sinks) == 1 and sinks[0].shape == (32, 48, 3)  # the sinks log a clip's first frame
    path = tmp_path / "samples" / "step-000005-p0.webp"
    assert webp_frames(path) == (9, (48, 32), "WEBP")
    assert not list((tmp_path / "samples").glob("*.png"))
    grid.write()
    assert SampleGrid(tmp_path, chain.prompts).load_existing().cells.keys() == {5}  # a resumed run reads the clip


def test_the_empty_latent_is_comfys_video_latent_for_wan_2_1_and_2_2_5b(wan, wan_vae, tmp_path):
    assert tuple(ui.empty_latent(wan, wan_vae, 48, 32, 33).shape) == (1, 16, 9, 4, 6)  # EmptyHunyuanLatentVideo
    ti2v = load(write_wan_file(tmp_path / "ti2v.safetensors", in_dim=48, out_dim=48))
    assert tuple(ui.empty_latent(ti2v, wan_vae, 64, 32, 33).shape) == (1, 48, 9, 2, 4)  # Wan22ImageToVideoLatent


def test_the_dashboard_gets_the_clip_as_an_animated_webp(comfy_dirs, tmp_path):
    from kiln_pack.nodes import dashboard, live

    tracker = live.Tracker(
        SimpleNamespace(steps=4, arch="wan21_t2v"),
        tmp_path / "run",
        SimpleNamespace(buckets={}),
        prompts=["p"],
        registry=dashboard.Registry(),
    )
    tracker.on_sample(2, torch.rand(5, 32, 48, 3), 0)
    (sample,) = tracker.run.samples
    shown = Path(bridge.folders()["temp"]) / sample["image"]["subfolder"] / sample["image"]["filename"]
    assert shown.suffix == ".webp" and webp_frames(shown)[0] == 5
    assert webp_frames(tmp_path / "run" / "samples" / "step-000002-p0.webp") == (5, (48, 32), "WEBP")


def test_an_image_models_sample_ignores_frames(tmp_path):
    model, vae, clip = tc.tiny_zimage(), tc.tiny_vae(flux2=False), tc.tiny_zimage_clip()
    positive = tc.conditioning(clip, "kiln")
    one = bridge.sample(model, positive, positive, vae, **SETTINGS, width=32, height=32)
    many = bridge.sample(model, positive, positive, vae, **SETTINGS, width=32, height=32, frames=33)
    assert tuple(one.shape) == (1, 32, 32, 3) and torch.equal(one, many)
    grid = SampleGrid(tmp_path, ["kiln"])
    assert grid.save_sample(1, 0, one[0].numpy()).suffix == ".png"


def test_a_5b_sample_starts_from_wan22imagetovideolatents_latent_as_ksampler_does(tmp_path):
    """Validation Settings' start_latent: Wan 2.2 TI2V 5B's image-to-video latent (the start image encoded in the
    first frame, a noise_mask keeping it) sampled as ComfyUI's own KSampler samples it, bit for bit; without it the
    sample is the prompt's alone."""
    import nodes as comfy_nodes
    from comfy_extras.nodes_wan import Wan22ImageToVideoLatent
    from helpers.tiny_encoders import tiny_wan22_vae

    ti2v, vae = load(write_wan_file(tmp_path / "ti2v.safetensors", in_dim=48, out_dim=48)), tiny_wan22_vae()
    positive, negative = cond(caption(7, 1)), cond(caption(0, 2))
    with torch.inference_mode():
        made = Wan22ImageToVideoLatent.execute(vae, 64, 32, 9, 1, start_image=torch.rand(1, 32, 64, 3))
    (latent,) = made.result if hasattr(made, "result") else made
    assert "noise_mask" in latent
    chain = out(
        tn.KilnValidationSettings.execute(
            positive=positive,
            negative=negative,
            vae=vae,
            **SETTINGS,
            width=512,
            height=512,
            every=1,
            frames=33,
            start_latent=latent,
        )
    )
    drawn = []
    validate = bridge.validation(
        SimpleNamespace(backend="torch", arch="wan22_ti2v_5b"), ti2v, chain.samples, lambda *a: drawn.append(a[2])
    )
    validate(1)
    (ours,) = drawn
    s = SETTINGS
    with torch.inference_mode():
        (theirs,) = comfy_nodes.common_ksampler(
            ti2v, s["seed"], s["steps"], s["cfg"], s["sampler_name"], s["scheduler"], positive, negative, latent
        )
        decoded = vae.decode(theirs["samples"])
    assert tuple(ours.shape) == (9, 32, 64, 3)  # the latent's size, not the widgets' 512x512 x 33
    assert torch.equal(ours, decoded.reshape(-1, *decoded.shape[-3:])[..., :3])
    plain = bridge.sample(ti2v, positive, negative, vae, **SETTINGS, width=64, height=32, frames=9)
    assert not torch.equal(plain, ours)  # the start image counts
