"""The Kiln nodes in a real ComfyUI (COMFYUI_PATH), in process, on tiny Flux2 and Z-Image models.

Generated images → Load Dataset → Encode Images → Encode Captions → Train LoRA (20 steps) → Save
LoRA in each format → ComfyUI's own LoRA loader matches every key and the LoRA changes the output.
Also: the model is unchanged after training, re-queueing reuses a finished run, a stopped run
resumes to the same weights, validation samples come out, the training adapter is never saved.
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers import comfy_env
from helpers.node_ids import KILN_NODE_IDS
import numpy as np
import pytest

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
comfy_env.require_comfy()

from helpers import tiny_comfy as tc
import torch

import kiln_pack.nodes.extension as pack
import kiln_pack.nodes.comfy.bridge as bridge
import kiln_pack.nodes.dataset_nodes as dn
import kiln_pack.nodes.train_nodes as tn
import kiln_pack.nodes.option_nodes as on
import kiln_pack.nodes.lora_nodes as ln
import kiln_pack.nodes.run as run
import kiln_pack.trainer.safetensors_io as safetensors_io
import kiln_pack.trainer.lora.files as lora_format
from helpers.node_runs import encoded_dataset, make_dataset, out, train


def prediction(model, x, sigma, context, **extras):
    with torch.no_grad():
        return bridge.diffusion_model(model)(x, sigma, context, **extras)


def _output(model):
    """The model's prediction through ComfyUI's own apply_model on fixed inputs (LoRA patches loaded), under
    inference mode as ComfyUI runs a prompt: a model a prompt loaded holds inference tensors (on a GPU its forward
    then refuses to run outside inference mode: "Inference tensors do not track version counter")."""
    import comfy.model_management as mm

    mm.load_models_gpu([model])
    torch.manual_seed(0)
    fmt = model.get_model_object("latent_format")
    x = torch.randn(1, fmt.latent_channels, 4, 4).to(model.load_device)
    base = model.model
    context = torch.randn(
        1,
        8,
        base.diffusion_model.txt_in.in_features
        if hasattr(base.diffusion_model, "txt_in")
        else base.diffusion_model.cap_embedder[1].in_features,
    )
    extra = {"num_tokens": 8} if hasattr(base.diffusion_model, "cap_embedder") else {}
    with torch.inference_mode():
        return (
            base.apply_model(x, torch.tensor([0.5], device=x.device), c_crossattn=context.to(x.device), **extra)
            .clone()
            .float()
            .cpu()
        )


def test_every_node_is_registered():
    ids = {n.define_schema().node_id for n in pack.NODES}
    assert ids == KILN_NODE_IDS
    for node in pack.NODES:
        schema = node.define_schema()
        assert schema.category.startswith("Kiln")
        for i in schema.inputs:  # a tooltip that only repeats the input's name (the old fallback) says nothing
            assert i.tooltip and i.tooltip.lower() not in (i.id, i.id.replace("_", " ")), f"{node.__name__}.{i.id}"


def test_the_preset_tooltip_gives_each_presets_reason():
    inputs = {i.id: i for i in tn.KilnTrainLoRA.define_schema().inputs}
    preset = inputs["preset"]
    assert preset.options == ["none", *tn.cfg_module.PRESETS]
    for name, line in tn.cfg_module.PRESET_LINES.items():
        assert f"\n{name}: {line}" in preset.tooltip
    assert "lion" in inputs["optimizer"].tooltip and "3-10x smaller" in inputs["learning_rate"].tooltip


def test_load_dataset_shows_the_bucket_plan_on_the_node(comfy_dirs):
    """The node's text is check-dataset's report with the buckets: per resolution, each bucket with its
    images and the crop an image gets."""
    make_dataset(comfy_dirs / "input" / "buckets_shown", count=4)
    loaded = dn.KilnLoadDataset.execute("buckets_shown", "kiln", "", "", "64, 80", 1, 0.0)
    text = "".join(loaded.ui.as_dict()["text"])
    assert "Buckets at 64 px (centre crop, sides multiples of 16): 4 images in 2 buckets" in text, text
    assert "Buckets at 80 px" in text and "img0.png" in text and "img1.png" in text
    assert "OK: ready to train" in text


def test_load_dataset_shows_quality_and_a_verdict_per_image(comfy_dirs):
    """The quality pass on the node: a re-encoded copy is named as a near-duplicate, a blurred image as
    blurry, and every image gets a verdict line with its buckets."""
    from PIL import Image, ImageFilter

    folder = comfy_dirs / "input" / "quality_shown"
    make_dataset(folder, count=3)
    with Image.open(folder / "img0.png") as image:
        image.save(folder / "img0_copy.jpg", quality=85)  # a re-encoded copy
    with Image.open(folder / "img1.png") as image:
        image.filter(ImageFilter.GaussianBlur(6)).save(folder / "soft.png")  # a blurred one
    loaded = dn.KilnLoadDataset.execute("quality_shown", "kiln", "", "", "64", 1, 0.0)
    text = "".join(loaded.ui.as_dict()["text"])
    near = [line for line in text.splitlines() if "[near_duplicate]" in line]
    assert len(near) == 1 and "img0.png" in near[0] and "img0_copy.jpg" in near[0], text  # the sharper one stays
    assert "[blurry] soft.png" in text, text
    assert "Per image (" in text and "of 5 ok):" in text
    verdicts = text.split("Per image")[1]
    assert all(f"img{n}.png" in verdicts for n in range(3)) and "img0_copy.jpg" in verdicts


@pytest.mark.parametrize("family", ["flux2", "zimage"])
def test_train_save_and_load_through_comfy(comfy_dirs, tmp_path_factory, family):
    if family == "flux2":
        model, vae, clip = tc.tiny_flux2(tmp_path_factory.mktemp("f")), tc.tiny_vae(flux2=True), tc.tiny_klein_clip()
    else:
        model, vae, clip = tc.tiny_zimage(), tc.tiny_vae(flux2=False), tc.tiny_zimage_clip()
    ds = encoded_dataset(comfy_dirs, vae, clip, f"ds_{family}")
    dm = bridge.diffusion_model(model)
    before = {k: v.detach().cpu().clone() for k, v in dm.state_dict().items()}

    result = train(model, ds, options={"ema": True, "ema_decay": 0.9})
    trained, lora, state, loss_map, images = result.result
    assert state.step == 20 and len(loss_map["loss"]) == 20 and images.ndim == 4
    after = {k: v.detach().cpu() for k, v in dm.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before)  # the model is as it was

    reference = _output(model)
    for fmt in ("comfy", "diffusers", "kohya"):
        path = Path(out(ln.KilnSaveLoRA.execute(lora, f"kiln/{family}_{fmt}", fmt, "bf16", "kiln", "", False, state)))
        assert path.is_file() and path.parent.parent == comfy_dirs / "loras"
        loaded = bridge.load_lora_file(path)
        assert bridge.unmatched_lora_keys(model, loaded) == []
        assert not torch.allclose(_output(bridge.apply_lora(model, loaded, 1.0)), reference)  # the LoRA does something
    assert f"kiln/{family}_comfy.safetensors" in bridge.lora_names()
    with pytest.raises(ValueError, match="exists"):
        ln.KilnSaveLoRA.execute(lora, f"kiln/{family}_comfy", "comfy", "bf16")
    with pytest.raises(ValueError, match="loras folder|outside"):
        ln.KilnSaveLoRA.execute(lora, "../escape", "comfy", "bf16")

    # Re-queueing the same graph reuses the finished run instead of training again.
    again = train(model, ds, options={"ema": True, "ema_decay": 0.9})
    assert "already trained" in again.ui.value and again.result[2].checkpoint == state.checkpoint


def test_stop_then_resume_equals_an_uninterrupted_run(comfy_dirs, tmp_path_factory, monkeypatch, same_kernels):
    """Bit for bit, on the CPU and (KILN_COMFY_GPU=1) on the GPU with Kiln's defaults: compiled blocks, step
    graphs, bf16 (deterministic kernels there: the same_kernels fixture)."""
    model, vae, clip = tc.tiny_flux2(tmp_path_factory.mktemp("r")), tc.tiny_vae(flux2=True), tc.tiny_klein_clip()
    ds = encoded_dataset(comfy_dirs, vae, clip, "ds_resume")
    straight = train(model, ds, steps=8, options={"run_name": "straight", **same_kernels}).result[2]

    calls = {"n": 0}
    real = bridge.Progress.update

    def stop_at_5(self, step, *a, **k):
        calls["n"] += 1
        if step == 5:
            raise bridge.Interrupted()
        return real(self, step, *a, **k)

    monkeypatch.setattr(bridge.Progress, "update", stop_at_5)
    with pytest.raises(bridge.Interrupted):
        train(model, ds, steps=8, options={"run_name": "stopped", **same_kernels})
    monkeypatch.setattr(bridge.Progress, "update", real)
    resumed = train(model, ds, steps=8, options={"run_name": "stopped", **same_kernels}).result[2]  # resumes at 5
    assert resumed.step == 8
    assert resumed.history.loss == straight.history.loss
    for path, w in straight.lora.items():
        np.testing.assert_array_equal(w.A, resumed.lora[path].A)
        np.testing.assert_array_equal(w.B, resumed.lora[path].B)


def _adapter_and_validation(comfy_dirs, model, ds, vae, clip, name="adapter"):
    """A "training adapter" (a small LoRA on the same modules, saved under loras/ as <name>.safetensors) and
    Validation Settings that sample every 3 steps."""
    trained = out(train(model, ds, steps=2, options={"run_name": name}), 1)
    adapter_weights = dict(bridge.lora_weights_from(trained).items())
    for w in adapter_weights.values():
        w.B[:] = 0.01
    adapter = bridge.lora_model_from(adapter_weights, "zimage")
    safetensors_io.write(comfy_dirs / "loras" / f"{name}.safetensors", {k: v.numpy() for k, v in adapter.items()})
    bridge.refresh_loras()
    return out(
        tn.KilnValidationSettings.execute(
            positive=tc.conditioning(clip, "kiln"),
            negative=tc.conditioning(clip, ""),
            vae=vae,
            seed=0,
            steps=2,
            cfg=1.0,
            sampler_name="euler",
            scheduler="simple",
            width=32,
            height=32,
            every=3,
        )
    )


def test_validation_samples_and_adapter_never_saved(comfy_dirs):
    model, vae, clip = tc.tiny_zimage(), tc.tiny_vae(flux2=False), tc.tiny_zimage_clip()
    ds = encoded_dataset(comfy_dirs, vae, clip, "ds_val")
    validation = _adapter_and_validation(comfy_dirs, model, ds, vae, clip)
    result = train(
        model, ds, steps=6, training_adapter="adapter.safetensors", validation=validation, options={"run_name": "val"}
    )
    trained, lora, state, loss_map, images = result.result
    assert state.arch == "zimage_turbo" and images.shape[0] == 2  # steps 3 and 6
    # The outputs hold the trained branches only: the LORA_MODEL is the run's own LoRA exactly, and
    # the MODEL carries one patch per key (the LoRA), none from the adapter.
    expected = bridge.lora_model_from(state.best_lora(), state.arch)
    assert set(lora) == set(expected) and all(torch.equal(lora[k], expected[k]) for k in lora)
    assert all(len(patches) == 1 for patches in trained.patches.values())
    saved = Path(out(ln.KilnSaveLoRA.execute(lora, "kiln/turbo", "comfy", "fp32", "", "", False, state)))
    on_disk = bridge.load_lora_file(saved)
    assert all(torch.equal(on_disk[k].float().reshape(-1), lora[k].float().reshape(-1)) for k in lora)
    # No trigger word typed on Save LoRA: the run's own (Load Dataset's) goes into the metadata.
    metadata = lora_format.load_lora(saved)[1]
    assert state.config["trigger_word"] == "kiln" and json.loads(metadata["kiln.trigger_words"]) == ["kiln"]
    assert metadata["modelspec.trigger_phrase"] == "kiln"


def test_validation_samples_while_the_base_streams(comfy_dirs):
    """stream_blocks with a training adapter and validation samples mid-run: the base blocks stream through the
    ring while ComfyUI's sampler draws the samples without the adapter: the streamed run trains the resident
    run's LoRA bit for bit and samples its images (up to the rounding of the merged adapter), and the model
    ComfyUI gave comes back as it was."""
    model, vae, clip = tc.tiny_zimage(), tc.tiny_vae(flux2=False), tc.tiny_zimage_clip()
    ds = encoded_dataset(comfy_dirs, vae, clip, "ds_stream_val")
    validation = _adapter_and_validation(comfy_dirs, model, ds, vae, clip, name="stream_adapter")
    reference = _output(model)
    runs = {}
    for blocks in (0, 2):
        options = {"run_name": f"stream{blocks}", "stream_blocks": blocks, "gradient_checkpointing": True}
        result = train(
            model, ds, steps=6, training_adapter="stream_adapter.safetensors", validation=validation, options=options
        )
        runs[blocks] = result.result
        assert torch.equal(_output(model), reference), blocks  # the model ComfyUI gave comes back as it was
    (_, resident, _, _, resident_images), (_, streamed, state, _, streamed_images) = runs[0], runs[2]
    assert set(resident) == set(streamed) and all(torch.equal(resident[k], streamed[k]) for k in resident)
    assert any(float(v.abs().sum()) > 0 for v in streamed.values())
    # the samples without the adapter: the resident run's, up to the merged weights' rounding (live −ΔW branches)
    assert streamed_images.shape[0] == 2
    torch.testing.assert_close(streamed_images, resident_images, atol=2e-3, rtol=0)


def option_node(node_id: str):
    return next(node for node in on.NODES if node.define_schema().node_id == node_id)


def widget_defaults(node) -> dict:
    return {i.id: i.default for i in node.define_schema().inputs if i.id != "options"}


def test_a_value_set_on_a_connected_option_node_wins_over_the_preset(comfy_dirs, tmp_path_factory):
    """No hidden rule: Training Options connected sets every value it holds, its defaults too (loss_weighting
    none under preset character trains none); a smaller option node sets only its own, so Kiln EMA & Held-out
    alone keeps the preset's bell. Where each setting came from is in the resolution's lines."""
    model = tc.tiny_flux2(tmp_path_factory.mktemp("p"))
    folder = make_dataset(comfy_dirs / "input" / "ds_preset")
    ds = out(dn.KilnLoadDataset.execute(str(folder), "kiln", "", "", "64", 1, 0.0))
    widgets = dict(steps=50, learning_rate=1e-4, rank=8, alpha=8.0, optimizer="adamw", backend="torch", seed=3)
    everything = out(tn.KilnTrainingOptions.execute(**widget_defaults(tn.KilnTrainingOptions)))
    assert everything["loss_weighting"] == "none"
    cfg = tn.build_config(model, ds, widgets, "character", everything, adapter=False).config
    assert cfg.loss_weighting == "none" and cfg.weight_decay == 1e-4 and cfg.steps == 50 and cfg.arch == "flux2_klein"
    ema = option_node("KilnEMAHoldoutOptions")
    ema_on = out(ema.execute(**{**widget_defaults(ema), "ema": True}))
    resolved = tn.build_config(model, ds, widgets, "character", ema_on, adapter=False)
    assert resolved.config.ema is True and resolved.config.loss_weighting == "bell"
    lines = resolved.lines()
    assert {
        "ema = True (options)",
        "loss_weighting = bell (preset character)",
        "arch = flux2_klein (model)",
        "steps = 50 (Train LoRA; preset character: 3000)",
        "trigger_word = kiln (dataset)",
        "resolutions = [64] (dataset; preset character: [512, 768, 1024])",
    } <= set(lines), lines
    plain = tn.build_config(model, ds, widgets, "none", everything, adapter=False).config
    assert plain.loss_weighting == "none" and plain.resolutions == [64]


def test_option_nodes_chain_and_the_node_nearer_train_lora_wins():
    optimizer, noise = option_node("KilnOptimizerOptions"), option_node("KilnNoiseLossOptions")
    first = out(
        tn.KilnTrainingOptions.execute(
            **{**widget_defaults(tn.KilnTrainingOptions), "loss_weighting": "bell", "weight_decay": 0.01}
        )
    )
    second = out(optimizer.execute(options=first, **{**widget_defaults(optimizer), "weight_decay": 0.05}))
    assert second["weight_decay"] == 0.05 and second["loss_weighting"] == "bell" and second.keys() == first.keys()
    third = out(noise.execute(options=second, **{**widget_defaults(noise), "loss_weighting": "none"}))
    assert third["loss_weighting"] == "none" and third["weight_decay"] == 0.05
    alone = out(noise.execute(**widget_defaults(noise)))  # unchained: its own group's settings only
    assert list(alone) == list(on.group_fields("objective")) and alone["content_or_style"] == "balanced"
    adapter = option_node("KilnAdapterOptions")
    assert out(adapter.execute(**{**widget_defaults(adapter), "targets": "a.b, c"}))["targets"] == ["a.b", "c"]
    speed = option_node("KilnSpeedMemoryOptions")
    assert out(speed.execute(**widget_defaults(speed)))["compile_blocks"] == "auto"


def test_option_nodes_split_training_options_by_group_with_the_same_widgets():
    """Every Training Options setting is on exactly one smaller node, grouped as config.py declares, with the
    same widget (bounds, step, default, tooltip, advanced); the shipped order of each node leads it."""
    full = {i.id: i.as_dict() for i in tn.KilnTrainingOptions.define_schema().inputs}
    seen = []
    for node in on.NODES:
        schema = node.define_schema()
        chain, *widgets = schema.inputs
        assert chain.id == "options" and chain.optional and schema.category == "Kiln/train/options"
        assert "wins over" in schema.description and schema.outputs[0].io_type == "KILN_TRAIN_OPTIONS"
        groups = {tn.cfg_module.GROUP[w.id] for w in widgets}
        assert len(groups) == 1, (schema.node_id, groups)
        group = groups.pop()
        assert [w.id for w in widgets] == list(on.group_fields(group))
        assert list(on.group_fields(group)[: len(on.SHIPPED_GROUP_ORDER[group])]) == list(on.SHIPPED_GROUP_ORDER[group])
        assert all(w.as_dict() == full[w.id] for w in widgets)
        seen += [w.id for w in widgets]
    assert sorted(seen) == sorted(tn.OPTION_FIELDS) and len(seen) == len(set(seen))
    hidden = {name for name, spec in full.items() if spec.get("advanced")}
    assert hidden == set(tn.OPTION_FIELDS) & tn.cfg_module.ADVANCED and {"adam_eps", "cuda_graphs"} <= hidden


def test_train_lora_reports_the_resolved_settings(comfy_dirs, tmp_path_factory):
    model = tc.tiny_flux2(tmp_path_factory.mktemp("rep"))
    ds = encoded_dataset(comfy_dirs, tc.tiny_vae(flux2=True), tc.tiny_klein_clip(), "ds_report")
    options = {"device": "cpu", "mixed_precision": "no", "checkpoint_every": 0, "ema": True, "run_name": "report"}
    result = tn.KilnTrainLoRA.execute(
        model,
        ds,
        steps=2,
        learning_rate=1e-3,
        rank=4,
        alpha=4.0,
        optimizer="adamw",
        preset="character",
        backend="torch",
        seed=1,
        options=options,
    )
    text = "".join(result.ui.as_dict()["text"])
    assert "settings (defaults < preset character < options < Train LoRA < dataset < model; later wins):" in text
    for line in (
        "loss_weighting = bell (preset character)",
        "ema = True (options)",
        "run_name = report (options)",
        "steps = 2 (Train LoRA; preset character: 3000)",
        "rank = 4 (Train LoRA; preset character: 32)",
        "mixed_precision = no (options; preset character: bf16)",
        "trigger_word = kiln (dataset)",
    ):
        assert f"  {line}\n" in text + "\n", (line, text)
    assert result.result[2].config["loss_weighting"] == "bell"


def test_training_options_default_to_the_auto_levers_and_keep_saved_values():
    """compile_blocks and checkpoint_budget default to auto; the widgets keep the types saved workflows hold
    (a boolean, a number): on = auto, -1 = auto; a saved off / 0.0 stays off / 0.0."""
    inputs = {i.id: i for i in tn.KilnTrainingOptions.define_schema().inputs}
    assert inputs["compile_blocks"].default is True and "where it pays" in inputs["compile_blocks"].tooltip
    assert inputs["checkpoint_budget"].default == -1.0 and inputs["checkpoint_budget"].min == -1.0
    values = {i.id: i.default for i in inputs.values()}
    fresh = out(tn.KilnTrainingOptions.execute(**values))
    assert fresh["compile_blocks"] == "auto" and fresh["checkpoint_budget"] == "auto"
    saved = out(tn.KilnTrainingOptions.execute(**{**values, "compile_blocks": False, "checkpoint_budget": 0.0}))
    assert saved["compile_blocks"] is False and saved["checkpoint_budget"] == 0.0
    # stream_blocks, added later, the same way: an int whose -1 means auto; 0 keeps every block on the GPU
    assert inputs["stream_blocks"].default == -1 and inputs["stream_blocks"].min == -1
    assert "Memory section" in inputs["stream_blocks"].tooltip and fresh["stream_blocks"] == "auto"
    assert out(tn.KilnTrainingOptions.execute(**{**values, "stream_blocks": 0}))["stream_blocks"] == 0
    assert (
        tn.cfg_module.from_dict({k: v for k, v in fresh.items() if k in tn.cfg_module.FIELDS}).compile_blocks == "auto"
    )


@pytest.mark.parametrize("name", ["fp8_compute", "step_graphs", "offload_activations"])
def test_auto_levers_are_three_way_choices_defaulting_to_auto(name):
    """fp8_compute auto (on for a base stored in fp8 on a capable GPU), on (also a bf16 base, with its fp8
    copies), off; step_graphs likewise (auto: on for one process on a CUDA GPU where their memory fits): combos
    whose words reach the config as "auto", True and False; the post-0.1 options keep their positions ahead
    of anything added later (cuda_graphs, step_graphs, stream_blocks, sigma_range, then offload_activations,
    last); offload_activations likewise (auto: only where the step fits no other way)."""
    inputs = {i.id: i for i in tn.KilnTrainingOptions.define_schema().inputs}
    assert inputs[name].options == ["auto", "on", "off"] and inputs[name].default == "auto"
    values = {i.id: i.default for i in inputs.values()}
    for word, expected in (("auto", "auto"), ("on", True), ("off", False)):
        assert out(tn.KilnTrainingOptions.execute(**{**values, name: word}))[name] == expected
    order = list(inputs)
    assert order.index("fp8_compute") < order.index("reg_weight") < order.index("cuda_graphs")
    assert order[-5:] == ["cuda_graphs", "step_graphs", "stream_blocks", "sigma_range", "offload_activations"]


def test_invert_adapter_and_loss_graph(comfy_dirs, tmp_path_factory):
    model = tc.tiny_flux2(tmp_path_factory.mktemp("inv"))
    ds = encoded_dataset(comfy_dirs, tc.tiny_vae(flux2=True), tc.tiny_klein_clip(), "ds_inv")
    trained, lora, state, loss_map, _ = train(model, ds, steps=3, options={"run_name": "inv"}).result
    reference = _output(model)
    with_adapter = bridge.apply_lora(model, lora, 1.0)
    assert not torch.allclose(_output(with_adapter), reference)
    removed, inverted = ln.KilnInvertAdapter.execute(with_adapter, "none", 1.0, adapter=lora).result
    torch.testing.assert_close(_output(removed), reference, atol=1e-4, rtol=1e-4)
    assert set(inverted) == set(lora)
    with pytest.raises(ValueError, match="adapter_file"):
        ln.KilnInvertAdapter.execute(model, "none", 1.0)
    for kwargs in ({"state": state}, {"loss_map": loss_map}):
        image = out(ln.KilnLossGraph.execute(**kwargs))
        assert image.ndim == 4 and image.shape[-1] == 3 and float(image.std()) > 0


def test_mlx_backend_matches_torch_through_the_node_and_saves_a_comfy_lora(comfy_dirs, tmp_path_factory):
    """backend "mlx" on the same ComfyUI model: Kiln's MLX port trains with the same draws as the torch
    path (loss curves within 1e-3 relative over 30 fp32 steps) and its LoRA loads in ComfyUI."""
    pytest.importorskip("mlx.core")
    model = tc.tiny_flux2(tmp_path_factory.mktemp("mlx"))
    ds = encoded_dataset(comfy_dirs, tc.tiny_vae(flux2=True), tc.tiny_klein_clip(), "ds_mlx")
    options = {"gradient_checkpointing": False, "device": "cpu", "mixed_precision": "no"}
    curves = {}
    for backend in ("torch", "mlx"):
        kwargs = dict(
            steps=30,
            learning_rate=1e-3,
            rank=4,
            alpha=4.0,
            optimizer="adamw",
            preset="none",
            backend=backend,
            seed=1,
            options={**options, "run_name": f"parity_{backend}", "checkpoint_every": 0},
        )
        trained, lora, state, loss_map, _ = tn.KilnTrainLoRA.execute(model, ds, **kwargs).result
        curves[backend] = np.array(state.history.loss)
        assert bridge.unmatched_lora_keys(model, lora) == []
    np.testing.assert_allclose(curves["mlx"], curves["torch"], rtol=1e-3)


def test_speed_levers_leave_the_run_identity_alone(comfy_dirs):
    """Turning compile_blocks, checkpoint_budget, checkpointing, the attention kernel, fp8 compute, CUDA graphs
    or step graphs on or off after a stop resumes the same run (a run.json of yesterday, fp8_compute false, resumes under
    today's auto); a setting that changes what is trained starts another."""
    folder = make_dataset(comfy_dirs / "input" / "ds_identity")
    ds = out(dn.KilnLoadDataset.execute(str(folder), "kiln", "", "", "64", 1, 0.0))
    base = tn.cfg_module.from_dict({"arch": "flux2_klein"})
    same = run.run_identity(base, ds, None)
    for change in (
        {"compile_blocks": False},
        {"checkpoint_budget": 0.3},
        {"gradient_checkpointing": False},
        {"skip_checkpoint_blocks": 2},
        {"attention": "math"},
        {"fp8_compute": False},
        {"fp8_compute": True},
        {"cuda_graphs": True},
        {"step_graphs": False},
        {"step_graphs": True},
    ):
        assert run.run_identity(tn.cfg_module.replace(base, **change), ds, None) == same, change
    assert run.run_identity(tn.cfg_module.replace(base, rank=8), ds, None) != same
