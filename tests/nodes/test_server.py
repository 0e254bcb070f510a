"""The pack inside a real ComfyUI server (COMFYUI_PATH), driven over HTTP as a user's frontend would.

One server per module, on a temporary base directory (`--base-directory`), started through
tests/helpers/comfy_server.py (ComfyUI's own main.py, CPU, with comfy_env's torchvision workaround):

  custom_nodes/kiln               → this repository (a symlink), imported by ComfyUI as any pack
  custom_nodes/kiln_test_nodes    → tests/nodes/server_nodes: test-only nodes with tiny models (below)
  models/diffusion_models/        tiny Flux2 Klein, Wan 2.1 T2V / I2V and Wan 2.2 TI2V 5B files (tiny_comfy, tiny_wan):
                                  UNETLoader detects them from their shapes like real ones
  models/vae/                     tiny Flux2, Flux and Wan 2.1 VAE files: VAELoader detects them
  input/                          generated images, edit pairs and clips (PyAV) with captions

Some models ComfyUI cannot load tiny from a file: CLIPLoader recognises a text encoder (Qwen3-4B, umT5-XXL,
Qwen2.5-VL) by its keys and builds it at full size from a fixed config, UNETLoader detects Z-Image and Qwen-Image
only at full size, VAELoader builds the Wan 2.2 VAE at full size, CLIPVisionLoader builds CLIP vision at full size.
So the test workflows take those from test-only nodes (KilnTestTinyCLIP, KilnTestTinyZImage, KilnTestTinyQwenImage,
KilnTestTinyWan22VAE, KilnTestTinyCLIPVision), which return ComfyUI's own classes at a tiny size; everything else goes
through ComfyUI's own loaders.

Checks: the pack imports with no failure; every Kiln node is in GET /object_info with a tooltip on
every input; the example workflows are served as templates and are valid against the live node
definitions (API and UI files, and ComfyUI's own /prompt validation finds nothing but the missing model
files); an API prompt trains a LoRA (Load Dataset → Encode Images → Encode Captions → Train LoRA 20
steps → Save LoRA) and a second prompt loads it with ComfyUI's LoraLoaderModelOnly and samples with it,
with no "lora key not loaded" in the log; every example workflow runs through comfy-cli on the tiny models.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

from helpers import comfy_env  # noqa: E402
from helpers.node_ids import KILN_NODE_IDS  # noqa: E402

pytestmark = pytest.mark.comfyui  # --comfyui only|without selects on it
COMFY = comfy_env.require_comfy()  # skips the module without COMFYUI_PATH

from helpers.comfy_server import TINY_FILES, make_workflows, running, tiny_base  # noqa: E402

mw = make_workflows()
WORKFLOWS = HERE / "workflows"
EXAMPLES = sorted((REPO / "example_workflows" / "api").glob("*.json"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    assert mw.TINY["unet"] == TINY_FILES["flux2_unet"] and mw.TINY["vae"] == TINY_FILES["flux2_vae"]
    with running(COMFY, tiny_base(tmp_path_factory.mktemp("comfy_base"))) as comfy:
        yield comfy


@pytest.fixture(scope="module")
def object_info(server):
    return server.get("/object_info", timeout=60)


def test_pack_imports_without_failure(server):
    lines = server.log().splitlines()
    failed = [
        line
        for line in lines
        if ("IMPORT FAILED" in line or "Cannot import" in line or "comfy_entrypoint" in line) and "kiln" in line
    ]
    assert not failed, "\n".join(failed) + "\n" + server.log_tail()
    loaded = [line for line in lines if line.rstrip().endswith(("custom_nodes/kiln", "custom_nodes/kiln_test_nodes"))]
    assert len(loaded) == 2, server.log_tail()  # ComfyUI's "Import times for custom nodes" lines


def test_every_kiln_node_is_served_with_tooltips(object_info):
    served = {name for name, info in object_info.items() if info.get("python_module") == "custom_nodes.kiln"}
    assert served == KILN_NODE_IDS
    for name in KILN_NODE_IDS:
        info = object_info[name]
        assert info["category"].startswith("Kiln"), name
        assert info["description"], name
        for group in ("required", "optional"):
            for input_name, spec in info["input"].get(group, {}).items():
                options = spec[1] if len(spec) > 1 else {}
                assert options.get("tooltip"), f"{name}.{input_name} has no tooltip"


def test_example_workflows_are_served_as_templates(server):
    templates = server.get("/workflow_templates")
    names = {path.stem for path in EXAMPLES}
    assert set(templates.get("kiln", [])) == names == set(mw.TEMPLATE_TITLES.values())
    for name in names:
        served = server.get(f"/api/workflow_templates/kiln/{urllib.parse.quote(name)}.json")
        assert served == json.loads((REPO / "example_workflows" / f"{name}.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_workflow_matches_the_node_definitions(object_info, path):
    """The API file against the live definitions, and the UI file against the API file: same nodes, links
    and types, and widgets_values in each node's widget order (the frontend reads them by position)."""
    api = json.loads(path.read_text(encoding="utf-8"))
    assert mw.validate(api, object_info) == []
    ui = json.loads((path.parent.parent / path.name).read_text(encoding="utf-8"))
    assert ui["version"] == 0.4 and ui["last_node_id"] == max(n["id"] for n in ui["nodes"])
    assert ui["last_link_id"] == len(ui["links"])
    nodes = {str(n["id"]): n for n in ui["nodes"] if n["type"] not in ("MarkdownNote", "Note")}
    assert set(nodes) == set(api)
    links = {link[0]: link for link in ui["links"]}
    for node_id, node in nodes.items():
        info = object_info[node["type"]]
        assert node["type"] == api[node_id]["class_type"]
        expected_values, linked = [], {}
        for name in mw.ordered_inputs(info):
            kind, options, _ = mw.input_spec(info, name)
            value = api[node_id]["inputs"].get(name)
            if mw.is_widget(kind, options):
                expected_values.append(value)
                if mw.has_control_widget(name, kind, options):
                    expected_values.append("fixed")
            elif isinstance(value, list):
                linked[name] = value
        assert node["widgets_values"] == expected_values, f"{path.stem}: node {node_id} {node['type']}"
        for slot, entry in enumerate(node["inputs"]):
            if entry["link"] is None:
                assert entry["name"] not in linked, f"{path.stem}: {node['type']}.{entry['name']} not linked"
                continue
            link_id, origin, origin_slot, target, target_slot, kind = links[entry["link"]]
            assert (target, target_slot) == (int(node_id), slot)
            assert [str(origin), origin_slot] == linked.pop(entry["name"])
            assert link_id in nodes[str(origin)]["outputs"][origin_slot]["links"]
            assert kind == object_info[nodes[str(origin)]["type"]]["output"][origin_slot]
        assert not linked, f"{path.stem}: node {node_id} links missing in the UI file: {linked}"


# The user's own data a shipped workflow names, which Kiln's validate_inputs look for before anything loads.
USER_DATA = {("KilnLoadDataset", "folder"), ("KilnCaptionImages", "folder"), ("KilnLoadRun", "run_folder")}


def _only_missing_files(node_errors: dict) -> list[str]:
    """Errors other than a model file that is not installed (value_not_in_list on a file input), or the user's
    own dataset or run folder (Kiln's custom validation)."""
    other = []
    for node_id, entry in node_errors.items():
        for error in entry["errors"]:
            name = error.get("extra_info", {}).get("input_name")
            if error["type"] == "custom_validation_failed" and (entry["class_type"], name) in USER_DATA:
                continue
            missing = error["type"] == "value_not_in_list" or (  # LoadImage checks its file itself
                entry["class_type"] == "LoadImage"
                and "Invalid image file" in error.get("message", "") + error.get("details", "")
            )
            if not (missing and mw.is_file_input(name or "")):
                other.append(f"{node_id} {entry['class_type']}: {error['type']} {error['message']} {error['details']}")
    return other


def test_train_save_then_load_with_comfys_lora_loader(server):
    train = json.loads((WORKFLOWS / "tiny_flux2_api.json").read_text(encoding="utf-8"))
    if comfy_env.gpu():  # the device checks: Kiln's defaults on the GPU
        for node in train.values():
            if node["class_type"] == "KilnTrainingOptions":
                node["inputs"].update(device="auto", mixed_precision="bf16")
    started = time.monotonic()
    entry = server.run(train, timeout=150)
    train_s = time.monotonic() - started
    lora = server.base / "models" / "loras" / f"{mw.TINY['lora']}.safetensors"
    assert lora.is_file(), server.log_tail()
    texts = json.dumps(entry["outputs"])
    assert "trained to step 20/20" in texts and "saved" in texts, texts[:2000]
    from safetensors import safe_open

    with safe_open(str(lora), "pt") as f:
        keys = list(f.keys())
        metadata = f.metadata()
    assert keys and all(k.startswith("diffusion_model.") for k in keys), keys[:5]
    assert any(k.endswith(".lora_A.weight") for k in keys) and metadata

    log_before = len(server.log())
    sample = json.loads((WORKFLOWS / "tiny_flux2_lora_api.json").read_text(encoding="utf-8"))
    server.run(sample, timeout=120)
    log = server.log()[log_before:]
    assert "lora key not loaded" not in log, log
    images = list((server.base / "output" / "kiln_test").glob("tiny*.png"))
    assert images, server.log_tail()
    print(f"\nserver start {server.startup_s:.1f} s, train prompt {train_s:.1f} s")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_workflow_passes_comfys_validation(server, path):
    """POST /prompt runs ComfyUI's own validation. With none of the real model files and none of the user's
    datasets or runs here, the only errors allowed are those (so nothing runs): in resume_from_run_folder
    even Load Run → Apply EMA → Save LoRA, which needs no model file, is refused before it runs."""
    api = json.loads(path.read_text(encoding="utf-8"))
    status, answer = server.post("/prompt", {"prompt": api, "client_id": "kiln-test"})
    assert _only_missing_files(answer.get("node_errors", {})) == []
    assert status == 400 and answer["error"]["type"] == "prompt_outputs_failed_validation", answer
    if path.stem == "resume_from_run_folder":
        load_run = [e for e in answer["node_errors"].values() if e["class_type"] == "KilnLoadRun"]
        assert load_run and "does not exist; runs under output/kiln/" in json.dumps(load_run), answer


def _refusals(answer: dict) -> dict[str, str]:
    """class_type → the details of its custom_validation_failed errors, from a refused POST /prompt."""
    return {
        entry["class_type"]: " ".join(e["details"] for e in entry["errors"] if e["type"] == "custom_validation_failed")
        for entry in answer.get("node_errors", {}).values()
    }


def test_mistyped_names_are_refused_before_anything_loads(server):
    """Kiln's validate_inputs: ComfyUI refuses the prompt (HTTP 400, nothing queued, no model loaded) with the
    message on the node and the closest names; a wired folder is checked when it runs."""
    prompt = json.loads((WORKFLOWS / "tiny_flux2_api.json").read_text(encoding="utf-8"))
    kinds = {node["class_type"]: node for node in prompt.values()}
    kinds["KilnLoadDataset"]["inputs"]["folder"] = "kiln_tiny_datset"
    kinds["KilnSaveLoRA"]["inputs"]["name"] = "../outside"
    kinds["KilnTrainingOptions"]["inputs"]["run_name"] = "a/b"
    history_before = server.get("/history")
    status, answer = server.post("/prompt", {"prompt": prompt, "client_id": "kiln-test"})
    assert status == 400 and answer["error"]["type"] == "prompt_outputs_failed_validation", answer
    refused = _refusals(answer)
    assert "did you mean 'kiln_tiny_dataset'" in refused["KilnLoadDataset"], refused
    assert refused["KilnLoadDataset"].startswith("folder - Kiln Load Dataset:"), refused
    assert "name - Kiln Save LoRA: name: '../outside' has an empty, '.', '..'" in refused["KilnSaveLoRA"], refused
    assert "run_name - Kiln Training Options: run_name: 'a/b' has a path separator" in refused["KilnTrainingOptions"]
    assert server.get("/history") == history_before  # nothing ran

    load_run = {
        "1": {"class_type": "KilnLoadRun", "inputs": {"run_folder": "no-such-run"}},
        "2": {"class_type": "KilnApplyEMA", "inputs": {"state": ["1", 0]}},
        "3": {
            "class_type": "KilnSaveLoRA",
            "inputs": {"lora": ["2", 0], "name": "x", "format": "comfy", "dtype": "bf16"},
        },
    }
    status, answer = server.post("/prompt", {"prompt": load_run, "client_id": "kiln-test"})
    assert status == 400 and "run_folder - Kiln Load Run:" in _refusals(answer)["KilnLoadRun"], answer


# ---------------------------------------------------------------- the example workflows through comfy-cli


# An example's family (its CLIPLoader's type; Wan 2.2 5B and Wan 2.1 I2V by their model files) → its loaders on the
# tiny models: UNETLoader's file or the test node built in its place, KilnTestTinyCLIP's family, VAELoader's file or
# test node; and the arch its LoRAs name. A test node stands in where ComfyUI builds the model at full size whatever
# the file holds (CLIP Vision Loader: always KilnTestTinyCLIPVision).
def _node(class_type: str) -> dict:
    return {"class_type": class_type, "inputs": {"seed": 0}}


TINY_MODELS = {
    "lumina2": (_node("KilnTestTinyZImage"), "zimage", TINY_FILES["flux_vae"], "zimage_turbo"),
    "flux2": (TINY_FILES["flux2_unet"], "flux2_klein", TINY_FILES["flux2_vae"], "flux2_klein"),
    "wan": (TINY_FILES["wan21_unet"], "wan", TINY_FILES["wan21_vae"], "wan21_t2v"),
    "wan22": (TINY_FILES["wan22_unet"], "wan", _node("KilnTestTinyWan22VAE"), "wan22_ti2v_5b"),
    "wan21_i2v": (TINY_FILES["wan21_i2v_unet"], "wan", TINY_FILES["wan21_vae"], "wan21_i2v"),
    "qwen_image": (_node("KilnTestTinyQwenImage"), "qwen_image", TINY_FILES["wan21_vae"], "qwen_image"),
}
VIDEO_FRAMES = 5  # Wan's 4k+1: two latent frames
# Examples whose validation samples take WanImageToVideo's conds (a start image, CLIP vision): Kiln must not warn.
START_IMAGE_SAMPLES = {"wan21_i2v_lora"}


WAN_FILES = {"ti2v": "wan22", "i2v": "wan21_i2v"}  # a word of the Wan model file's name → its family


def family(api: dict) -> str:
    (clip_type,) = {n["inputs"]["type"] for n in api.values() if n["class_type"] == "CLIPLoader"}
    if clip_type != "wan":
        return clip_type
    files = [n["inputs"].get("unet_name", "") for n in api.values()]
    return next((kind for word, kind in WAN_FILES.items() if any(f"_{word}_" in name for name in files)), "wan")


def _loader(node: dict, tiny, file_input: str) -> None:
    node.update(tiny) if isinstance(tiny, dict) else node["inputs"].update({file_input: tiny})


def tiny_example(api: dict, name: str, run_folder: str | None = None) -> dict:
    """An example API workflow on the tiny models (TINY_MODELS: the loaders become tiny files or the test nodes that
    build tiny models); 64 px, 5-frame clips, a few steps (steps / 250, so chained and resumed runs keep their order),
    on the CPU (with KILN_COMFY_GPU=1 on the GPU, with the workflow's own device and precision).
    Every Kiln node and every link stays as shipped."""
    api, kind_of = json.loads(json.dumps(api)), family(api)
    unet, clip, vae, _arch = TINY_MODELS[kind_of]
    video = kind_of in ("wan", "wan22", "wan21_i2v")
    edit = not video and any(n["class_type"] == "LoadImage" for n in api.values())  # the edit workflows' reference
    dataset = TINY_FILES["clip_dataset" if video else "edit_dataset" if edit else "dataset"]
    clip_length = {"frames": VIDEO_FRAMES} if video else {}
    for node in api.values():
        kind, inputs = node["class_type"], node["inputs"]
        if kind == "UNETLoader":
            _loader(node, unet, "unet_name")
        elif kind == "CLIPLoader":
            node.update(class_type="KilnTestTinyCLIP", inputs={"family": clip, "seed": 0})
        elif kind == "CLIPVisionLoader":
            node.update(_node("KilnTestTinyCLIPVision"))
        elif kind == "VAELoader":
            _loader(node, vae, "vae_name")
        elif kind == "KilnLoadDataset":
            inputs.update(folder=dataset, resolutions="64", **clip_length)
        elif kind == "LoadImage":
            inputs.update(image=TINY_FILES["reference"])
        elif kind == "KilnTrainingOptions":
            # on the GPU (KILN_COMFY_GPU=1) the shipped device and precision stay: Kiln's defaults as users get them
            inputs.update(checkpoint_every=2, log_every=1)
            if not comfy_env.gpu():
                inputs.update(device="cpu", mixed_precision="no")
        elif kind == "KilnTrainLoRA":
            inputs.update(steps=max(2, inputs["steps"] // 250), rank=4, alpha=4.0)
            if inputs.get("training_adapter", "none") != "none":
                inputs["training_adapter"] = TINY_FILES["zimage_adapter"]
        elif kind == "KilnValidationSettings":
            # every 4: the 8-step runs sample twice, each chained stage once (a sample costs more than a step)
            inputs.update(steps=2, width=64, height=64, every=4, **clip_length)
        elif kind == "KSampler":
            inputs.update(steps=2)
        elif kind.startswith("Empty") and kind.endswith("LatentImage"):
            inputs.update(width=64, height=64)
        elif kind in ("EmptyHunyuanLatentVideo", "Wan22ImageToVideoLatent", "WanImageToVideo"):
            inputs.update(width=64, height=64, length=VIDEO_FRAMES)
        elif kind == "KilnSaveLoRA":
            inputs.update(name=f"kiln_cli/{name}_{inputs['name'].rsplit('/', 1)[-1]}", overwrite=True)
        elif kind in ("SaveImage", "SaveWEBM"):
            inputs.update(filename_prefix=f"kiln_cli/{name}")
        elif kind == "KilnLoadRun":
            inputs.update(run_folder=run_folder)
    return api


def comfy_run(server, workflow: Path) -> subprocess.CompletedProcess:
    command = [
        shutil.which("comfy") or "comfy",
        "run",
        "--workflow",
        str(workflow),
        "--wait",
        "--host",
        "127.0.0.1",
        "--port",
        str(server.port),
        "--timeout",
        "600",
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=900, env={**os.environ, "DO_NOT_TRACK": "1"})


def test_example_workflows_run_through_comfy_cli(server, tmp_path):
    """`comfy run --workflow FILE --wait` (comfy-cli, the client users script ComfyUI with) runs each example
    workflow on the tiny models against the live server (the Wan ones on a clip dataset, Wan 2.1 I2V with a tiny CLIP
    vision model, Qwen-Image-Edit on control → target pairs): LoRAs saved with ComfyUI keys and the right arch, images
    and clips saved as the workflow's save nodes say, and the resume workflow continues the Z-Image run the first
    workflow left."""
    if shutil.which("comfy") is None:
        pytest.fail("comfy-cli is not installed: pip install -e '.[test]' installs it", pytrace=False)
    from safetensors import safe_open

    from trainer.lora import files as lora_format

    loras, images = server.base / "models" / "loras" / "kiln_cli", server.base / "output" / "kiln_cli"
    order = [
        "zimage_turbo_character_lora",
        "flux2_klein_style_lora",
        "chained_training",
        "flux2_klein_edit_lora",
        "resume_from_run_folder",
        "wan21_t2v_lora",
        "wan22_ti2v_5b_lora",
        "wan21_i2v_lora",
        "qwen_image_edit_lora",
    ]  # the graphs' names; their files are named by their titles
    assert sorted(order) == sorted(mw.TEMPLATE_TITLES)
    kiln_runs = server.base / "output" / "kiln"  # runs of the module's earlier tests are not these workflows'
    runs: set[Path] = {p for p in kiln_runs.iterdir() if p.is_dir()} if kiln_runs.is_dir() else set()
    made: dict[str, set[Path]] = {}
    seconds: dict[str, float] = {}
    for name in order:
        api = json.loads(
            (REPO / "example_workflows" / "api" / f"{mw.TEMPLATE_TITLES[name]}.json").read_text(encoding="utf-8")
        )
        run_folder = None
        if name == "resume_from_run_folder":  # the Z-Image Turbo run the character workflow left
            (character,) = made["zimage_turbo_character_lora"]
            run_folder = character.name
        workflow = tmp_path / f"{name}.json"
        workflow.write_text(json.dumps(tiny_example(api, name, run_folder)), encoding="utf-8")
        started, log_before = time.monotonic(), len(server.log())
        done = comfy_run(server, workflow)
        seconds[name] = round(time.monotonic() - started, 1)
        assert done.returncode == 0, f"{name}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{server.log_tail(60)}"
        if name in START_IMAGE_SAMPLES:  # Kiln warns when an image-to-video model's samples carry no start image
            assert "samples have no start image" not in server.log()[log_before:], server.log()[log_before:]
        saved = sorted(loras.glob(f"{name}_*.safetensors"))
        assert len(saved) == sum(n["class_type"] == "KilnSaveLoRA" for n in api.values()), (name, saved)
        arch = TINY_MODELS[family(api)][3]
        for path in saved:
            weights, metadata = lora_format.load_lora(path)
            with safe_open(str(path), "pt") as f:
                keys = list(f.keys())
            assert weights and all(k.startswith("diffusion_model.") for k in keys), (path.name, keys[:3])
            assert metadata["kiln.arch"] == arch, (path.name, metadata["kiln.arch"])
        for save, suffix in (("SaveImage", "png"), ("SaveWEBM", "webm")):
            wanted = sum(n["class_type"] == save for n in api.values())
            assert len(list(images.glob(f"{name}_*.{suffix}"))) == wanted, (name, save)
        new_runs = {p for p in (server.base / "output" / "kiln").iterdir() if p.is_dir()} - runs
        runs |= new_runs
        made[name] = new_runs
    # Resuming from a loaded run trains on in a run folder of its own (its identity names where it started):
    # steps 9-12 after the character run's 8, with the loss history carried over.
    (resumed_dir,) = made["resume_from_run_folder"]
    resumed = json.loads(sorted(resumed_dir.glob("step-*/run.json"))[-1].read_text(encoding="utf-8"))
    (character,) = made["zimage_turbo_character_lora"]
    first = json.loads(sorted(character.glob("step-*/run.json"))[-1].read_text(encoding="utf-8"))
    assert (first["step"], resumed["step"]) == (8, 12)  # 2000 // 250, then 3000 // 250
    assert resumed["history"]["loss"][:8] == first["history"]["loss"] and len(resumed["history"]["loss"]) == 12
    assert "lora key not loaded" not in server.log()
    print(f"\ncomfy run seconds: {seconds}")
