"""Saved folders of every model type load with stock transformers and trust_remote_code=True in a fresh process
where `import kimi_hf` is impossible (auto_map + the exported code), also by repo id from an offline Hugging Face
cache; each folder holds exactly the import closure of its auto_map modules, flattened (transformers' own
relative-import walk over the saved files finds the same set); the exporter's refusals; the model card."""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoProcessor
from transformers.dynamic_module_utils import get_imports, get_relative_import_files

from kimi_hf import (
    KimiHybridForCausalLM,
    KimiHybridForConditionalGeneration,
    KimiHybridVisionConfig,
    KimiHybridVisionModel,
    KimiK3Config,
    KimiK3ForCausalLM,
    KimiK3ForConditionalGeneration,
    KimiK3VisionModel,
)
from kimi_hf.models import hub_kimi

from .kimi_hybrid.helpers import TINY_VISION, tiny_config, tiny_multimodal_config, tiny_processor
from .kimi_k3.release_format import (
    tiny_k3_chat_config,
    tiny_k3_config,
    write_k3_checkpoint,
    write_k3_preprocessor_config,
    write_k3_tokenizer_files,
)


WORKER = Path(__file__).with_name("remote_load_worker.py")
IDS = torch.tensor([[1, 5, 9, 14, 3]])


def rgb(h, w, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))  # HWC uint8


def generated(model, inputs):
    with torch.no_grad():
        logits = model(**inputs).logits
    return dict(logits=logits, generated=model.generate(**inputs, max_new_tokens=4, do_sample=False))


def with_image(model, proc, path, seed):
    """Saves the processor beside the model; the expected ids and outputs of one image question."""
    proc.save_pretrained(path)
    image = rgb(56, 84, seed)
    text = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "count"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    inputs = proc(images=[image], text=text)
    return dict(image=image, text=text, input_ids=inputs["input_ids"], **generated(model, inputs))


def save_multimodal(path):
    torch.manual_seed(0)
    model = KimiHybridForConditionalGeneration(tiny_multimodal_config()).eval()
    model.save_pretrained(path)
    return dict(kind="multimodal", base_class="KimiHybridModel", **with_image(model, tiny_processor(), path, 0))


def save_text(path):
    torch.manual_seed(1)
    model = KimiHybridForCausalLM(tiny_config()).eval()
    model.save_pretrained(path)
    return dict(kind="text", input_ids=IDS, **generated(model, {"input_ids": IDS}))


def save_vision(path, model):
    """A vision tower alone: its merged patch features of one 56 x 84 image."""
    model.eval().save_pretrained(path)
    p = model.config.patch_size
    grid = torch.tensor([[1, 56 // p, 84 // p]])
    pixels = torch.randn(int(grid.prod()), 3, p, p, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        features = model(pixel_values=pixels, grid_thw=grid).last_hidden_state
    return {
        "kind": "vision",
        "class": type(model).__name__,
        "pixel_values": pixels,
        "image_grid_thw": grid,
        "features": features,
    }


def save_k3(path, source):
    """A tiny Kimi K3 folder in the released layout (MXFP4 experts, the release's tokenizer and image-processor
    files), loaded and saved again by our classes."""
    write_k3_checkpoint(source, tiny_k3_chat_config(), seed=3, dtype="float32")
    write_k3_tokenizer_files(source)
    write_k3_preprocessor_config(source)
    model = KimiK3ForConditionalGeneration.from_pretrained(source).eval()
    model.save_pretrained(path)
    proc = AutoProcessor.from_pretrained(source)
    return dict(kind="k3", base_class="KimiK3Model", **with_image(model, proc, path, 1))


def save_k3_text(path):
    torch.manual_seed(4)
    model = KimiK3ForCausalLM(KimiK3Config(**tiny_k3_config()).text_config).eval()
    model.save_pretrained(path)
    return dict(kind="text", input_ids=IDS, **generated(model, {"input_ids": IDS}))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{model_type: saved folder} for every model type of hub_kimi.AUTO_MAPS, and what each must compute."""
    root = tmp_path_factory.mktemp("saved")
    torch.manual_seed(5)
    k3_tower = KimiK3VisionModel(KimiK3Config(**tiny_k3_config()).vision_config)
    torch.manual_seed(6)
    builders = {
        "kimi_hybrid_text": save_text,
        "kimi_hybrid_vision": lambda p: save_vision(p, KimiHybridVisionModel(KimiHybridVisionConfig(**TINY_VISION))),
        "kimi_hybrid": save_multimodal,
        "kimi_k3_text": save_k3_text,
        "kimi_k3_vision": lambda p: save_vision(p, k3_tower),
        "kimi_k3": lambda p: save_k3(p, root / "k3_release"),
    }
    assert set(builders) == set(hub_kimi.AUTO_MAPS)
    folders, expected = {}, {}
    for model_type, build in builders.items():
        folders[model_type] = root / model_type
        expected[str(folders[model_type])] = build(folders[model_type])
    return root, folders, expected


def auto_map_modules(folder) -> set[str]:
    """The modules the folder's JSON files name in their auto_map (nested ones included)."""
    found = set()

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "auto_map":
                    refs = value.values() if isinstance(value, dict) else value
                    for ref in refs:
                        for r in ref if isinstance(ref, list) else [ref]:
                            if r:
                                found.add(r.rpartition("--")[2].partition(".")[0])
                else:
                    walk(value)

    for name in os.listdir(folder):
        if name.endswith(".json"):
            walk(json.loads((Path(folder) / name).read_text()))
    return found


def test_each_saved_folder_holds_exactly_its_import_closure(saved):
    _, folders, _ = saved
    for model_type, folder in folders.items():
        config = json.loads((folder / "config.json").read_text())
        assert config["auto_map"] == {
            k: v for k, v in hub_kimi.AUTO_MAPS[model_type].items() if k not in hub_kimi.PROCESSOR_AUTO_CLASSES
        }
        entries = auto_map_modules(folder)
        closure = set()
        for module in entries:  # transformers' walk (single-dot sibling imports) over the saved files
            closure |= {module + ".py"} | {
                os.path.basename(f) for f in get_relative_import_files(folder / f"{module}.py")
            }
        code = {f for f in os.listdir(folder) if f.endswith(".py")}
        assert code == closure, (model_type, sorted(code ^ closure))
        assert code == set(hub_kimi.import_closure(entries)), model_type
        for name in code:
            text = (folder / name).read_text()
            assert not re.search(r"^\s*from\s+\.\.", text, re.MULTILINE), (model_type, name)  # flattened
            assert not any(i.split(".")[0] in ("kimi_hf", "kimi_hf_kernels") for i in get_imports(folder / name))
        if model_type.startswith("kimi_hybrid"):  # Kimi Linear and K2.5 folders ship no K3 code
            assert not [f for f in code if "k3" in f], (model_type, sorted(code))
    assert "processing_kimi_k3.py" in os.listdir(folders["kimi_k3"])
    assert "modeling_kimi_hybrid_multimodal.py" not in os.listdir(folders["kimi_hybrid_text"])


def test_remote_code_loads_every_model_type_without_kimi_hf_and_by_repo_id_offline(saved):
    root, folders, expected = saved
    mm = folders["kimi_hybrid"]
    cache = root / "hub_cache"
    offline_cache(cache, "local/tiny-kimi", mm)
    expected = dict(expected, **{"local/tiny-kimi": expected[str(mm)]})
    torch.save(expected, root / "expected.pt")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_MODULES_CACHE=str(root / "modules"))
    env.pop("PYTHONPATH", None)
    out = subprocess.run(
        [sys.executable, str(WORKER), str(root / "expected.pt"), *expected],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=root,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split() == [w for source in expected for w in ("ok", source)]


def test_a_save_over_an_older_kimi_hf_folder_leaves_only_current_code(tmp_path):
    """A folder saved by kimi_hf before K3 got its own folder held hub_kimi_hybrid.py and mxfp4_kimi_hybrid.py;
    saving into it again removes them (and leaves a user's own files alone)."""
    for name in (*hub_kimi.FORMER_CODE_FILES, "my_script.py"):
        (tmp_path / name).write_text("# old\n")
    KimiHybridForCausalLM(tiny_config()).save_pretrained(tmp_path)
    code = {f for f in os.listdir(tmp_path) if f.endswith(".py")}
    assert code == set(hub_kimi.import_closure(hub_kimi.model_modules("kimi_hybrid_text"))) | {"my_script.py"}


def test_the_exporter_refuses_what_a_flat_folder_cannot_hold(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    (pkg / "a" / "x.py").write_text("from ..b.y import f\n")
    (pkg / "b" / "y.py").write_text("def f():\n    from . import z\n")
    with pytest.raises(ValueError, match=r"from \. import.*does not name a module file"):
        hub_kimi.import_closure_of_files([pkg / "a" / "x.py"])
    (pkg / "b" / "y.py").write_text("def f():\n    from .x import g\n")  # b/x.py does not exist
    with pytest.raises(ValueError, match="does not name a module file"):
        hub_kimi.import_closure_of_files([pkg / "a" / "x.py"])
    (pkg / "b" / "x.py").write_text("g = 1\n")  # two x.py: one name in the flat folder
    with pytest.raises(ValueError, match="would both be x.py"):
        hub_kimi.import_closure_of_files([pkg / "a" / "x.py"])
    (pkg / "b" / "y.py").write_text("import .z\n")
    with pytest.raises(ValueError, match="import .x"):
        hub_kimi.import_closure_of_files([pkg / "a" / "x.py"])
    assert hub_kimi.flatten_imports("    from ...ops.kda import chunk_kda\nfrom .x import y\n") == (
        "    from .kda import chunk_kda\nfrom .x import y\n"
    )


def offline_cache(cache, repo_id, folder):
    """The Hugging Face cache layout of a downloaded repo: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


def test_model_card_describes_the_model(tmp_path):
    torch.manual_seed(0)
    KimiHybridForCausalLM(tiny_config()).save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "pipeline_tag: text-generation" in card and "| 3 | MLA | MoE |" in card
    assert "trust_remote_code=True" in card and "4 layers (3 KDA, 1 MLA)" in card
    (tmp_path / "README.md").write_text("my own card")
    KimiHybridForCausalLM(tiny_config()).save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == "my own card"  # never overwritten


def test_push_to_hub_uploads_weights_code_and_our_card(tmp_path, monkeypatch):
    """The Hub cannot be reached here: the two HfApi calls that would touch the network record what
    they are given instead; everything before them (saving, code, card) runs for real."""
    from huggingface_hub import HfApi

    uploaded = {}

    class Repo:
        repo_id = "me/tiny-kimi"

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: Repo())
    monkeypatch.setattr(
        HfApi,
        "upload_folder",
        lambda self, repo_id, folder_path, **kw: uploaded.update(
            repo_id=repo_id,
            files=sorted(os.listdir(folder_path)),
            card=open(os.path.join(folder_path, "README.md")).read(),
        ),
    )
    torch.manual_seed(0)
    KimiHybridForCausalLM(tiny_config()).push_to_hub("me/tiny-kimi")
    assert uploaded["repo_id"] == "me/tiny-kimi"
    assert {"config.json", "model.safetensors", "modeling_kimi_hybrid.py", "kda.py", "README.md"} <= set(
        uploaded["files"]
    )
    assert "| 3 | MLA | MoE |" in uploaded["card"]
    uploaded.clear()
    KimiHybridForCausalLM(tiny_config()).save_pretrained(tmp_path / "x", push_to_hub=True, repo_id="me/tiny-kimi")
    assert "kda.py" in uploaded["files"] and "| 3 | MLA | MoE |" in uploaded["card"]


def test_saved_code_and_card_get_normal_permissions(tmp_path):
    """The copied code files and the model card are written atomically (mkstemp: 0600) but end up
    0644 under umask 022, as config.json and the weights do."""
    old = os.umask(0o022)
    try:
        KimiHybridForCausalLM(tiny_config()).save_pretrained(tmp_path / "saved")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "saved").iterdir()}
    assert "kda.py" in modes and "README.md" in modes and "config.json" in modes
    assert modes == dict.fromkeys(modes, 0o644), modes  # no temp file left either: every name is a real file
