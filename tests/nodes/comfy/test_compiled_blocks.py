"""Compiled blocks (compile_blocks) on ComfyUI's own models, through trainer.run.loop as the node runs it.

torch.compile runs with the "aot_eager" backend (the graphs inductor would compile, no C++/Triton build), so
what is checked is dynamo's side: how many graphs a run with two bucket shapes compiles, and that the
compiled run trains what the eager run trains. Skipped without COMFYUI_PATH.
"""

from __future__ import annotations

from helpers import comfy_env
import numpy as np
import pytest

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()

import comfy.model_management as mm  # noqa: E402
from helpers import tiny_comfy as tc  # noqa: E402
import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.trainer.config as config
import kiln_pack.trainer.data as data_module
import kiln_pack.trainer.run.loop as loop
import kiln_pack.trainer.backends.torch_backend.checkpointing as checkpointing


def _two_bucket_data(model, vae, clip):
    """Two images at 32 px and two at 96 px: 4 and 36 image tokens, which Z-Image pads to 32 and 64."""
    encode_image, _ = bridge.vae_encoder(vae)
    encode, _ = bridge.text_encoder(clip)
    encode_text = lambda text: encode(text)["context"]  # these encoders give no other conditioning
    rng = np.random.default_rng(0)
    latents = [
        latent
        for size in (32, 96)
        for latent in bridge.latents_in(model, encode_image(rng.random((2, size, size, 3), dtype=np.float32)))
    ]
    texts = ["a cat", "moss on a stone", "a dog", "a red kite over a hill"]
    return data_module.InMemoryData.from_arrays(
        latents, [encode_text(t) for t in texts], [f"img{i}.png" for i in range(4)], encode_text("")
    )


def _train(model, data, tmp_path, *, compile: bool):
    """Six steps of batch 1 (seed 1: a 32 px image first); each step's latent width and the compiled graphs
    counted after its forward."""
    device = "auto" if comfy_env.gpu() else "cpu"
    cfg = config.from_dict(
        dict(
            arch="zimage",
            device=device,
            mixed_precision="no",
            steps=6,
            batch_size=1,
            rank=4,
            alpha=4.0,
            learning_rate=1e-3,
            checkpoint_every=0,
            keep_checkpoints=1,
            log_every=1,
            resolutions=[64],
            caption_dropout=0.0,
            gradient_checkpointing=True,
            seed=1,
            compile_blocks=compile,
            checkpoint_budget=1.0 if compile else 0.0,
        )
    )
    forward, seen = bridge.make_forward(model, "zimage"), []

    def counted(module, x_t, *rest):
        out = forward(module, x_t, *rest)
        seen.append((x_t.shape[-1], counters["stats"]["unique_graphs"]))
        return out

    torch._dynamo.reset()
    counters.clear()
    with bridge.training_session(model) as (dm, _):
        result = loop.train(cfg, dm, data, run_dir=tmp_path / f"run_{compile}", forward=counted)
    return result.history.loss, seen


@pytest.mark.parametrize("mark", [True, False], ids=["token-dims-marked", "dynamo-default"])
def test_comfy_zimage_compiles_once_for_two_buckets_and_trains_as_eager(mark, tmp_path, monkeypatch):
    """ComfyUI's Z-Image (context refiner without modulation, noise refiner and main layers with), compiled as
    Kiln's defaults compile it on a GPU (budget 1): whole blocks without graph breaks; with MARK_TOKEN_DIMS
    (the default) one graph per block kind and first-block-or-not, and none more for the second latent size.
    Left to dynamo, the first shape compiles static where caption and image token counts agree (32 px: 32
    and 32 after padding) and the second bucket compiles again (19-27 s of a first run on an H100). Either
    way the compiled run's losses are the eager run's."""
    monkeypatch.setattr(checkpointing, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(checkpointing, "MARK_TOKEN_DIMS", mark)
    # ComfyUI's CPU attention (sub-quadratic) asks psutil for the free memory, which dynamo cannot trace
    # (a graph break per block); on a GPU the blocks run SDPA and never ask.
    monkeypatch.setattr(
        mm, "get_free_memory", lambda dev=None, torch_free_too=False: (8 << 30, 8 << 30) if torch_free_too else 8 << 30
    )
    model = tc.tiny_zimage()
    data = _two_bucket_data(model, tc.tiny_vae(flux2=False), tc.tiny_zimage_clip())
    losses, seen = _train(model, data, tmp_path, compile=True)
    assert counters["graph_break"] == {}  # whole blocks, no pieces
    widths = [width for width, _ in seen]
    assert widths[0] == 4 and 12 in widths  # 32 px first, then 96 px
    first, last = seen[0][1], seen[-1][1]
    if mark:
        # 2 block kinds × the first block of a list (its input without grad) and the others; the noise
        # refiner and the main layers (more tokens) share theirs.
        assert first == last == 4
    else:
        assert (first, last) == (5, 6)
    eager, _ = _train(model, data, tmp_path, compile=False)
    np.testing.assert_allclose(losses, eager, rtol=1e-4)
