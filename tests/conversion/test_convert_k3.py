"""`kimi-hf convert k3` / `convert_k3`: a Kimi K3 folder as released (MXFP4 routed experts, compressed-tensors
mxfp4-pack-quantized) -> the same folder with plain experts, in the official K3 names.

The inputs are tiny checkpoints in the released layout written by tests/models/kimi_k3/release_format.py (its
own MXFP4 packer; `write_k3_checkpoint` returns the logical fp32 tensors by official name), so the dequantised
values are checked against values computed independently of kimi_hf's codec."""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kimi_hf import KimiK3ForConditionalGeneration
from kimi_hf.cli import main
from kimi_hf.conversion import convert_k3

from ..models.kimi_k3.release_format import k3_logical_specs, tiny_k3_config, write_k3_checkpoint


SCRIPT = Path(sys.executable).parent / "kimi-hf"
ROOT = Path(__file__).resolve().parents[2]
INDEX = "model.safetensors.index.json"
# the files of a release besides config.json and the weights (contents are arbitrary here)
SIDE_FILES = {
    "tokenizer_config.json": '{"tokenizer_class": "TikTokenTokenizer"}\n',
    "generation_config.json": '{"eos_token_id": 258}\n',
    "chat_template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}\n",
    "tokenization_kimi.py": "# remote code\n",
    "modeling_kimi_k3.py": "# remote code\n",
    "README.md": "# Kimi K3 (tiny)\n",
}
EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
# what the release stores in F32, by the test release's own account (not kimi_hf's list)
RELEASE_F32 = {name for name, _, _, keep_fp32 in k3_logical_specs(tiny_k3_config()) if keep_fp32}
# the tiny config: 7 layers, layer 0 dense, 6 MoE layers of 8 experts, w1 / w2 / w3 each
EXPERT_TENSORS = 6 * 8 * 3


def shell(*args, timeout=300):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def one_line_error(r) -> str:
    """The error of a failed command: exit status 1, exactly one line on stderr, no traceback."""
    lines = r.stderr.splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert lines[0].startswith("kimi-hf: error: "), lines[0]
    return lines[0]


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".convert-k3-") or ".old-" in p.name)


def index_of(folder: Path) -> dict:
    return json.loads((folder / INDEX).read_text())


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(set(index_of(folder)["weight_map"].values())):
        out.update(load_file(folder / file))
    return out


def text_ids(T=12):
    ids = torch.randint(0, 320, (2, T), generator=torch.Generator().manual_seed(0))
    return ids.masked_fill(ids == 277, 5)  # 277: the tiny media placeholder id


def logits(folder) -> torch.Tensor:
    model, info = KimiK3ForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True, experts_format="dense"
    )
    assert {k: list(v) for k, v in info.items()} == dict(
        missing_keys=[], unexpected_keys=[], mismatched_keys=[], error_msgs=[]
    )
    with torch.no_grad():
        return model.eval()(input_ids=text_ids(), use_cache=False).logits


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The tiny K3 release: bf16, MXFP4 experts, 3 shards (a layer straddles two), and the side files (one private)."""
    folder = tmp_path_factory.mktemp("k3_release")
    logical = write_k3_checkpoint(folder, tiny_k3_config(), seed=0, mxfp4=True, shards=3, dtype="bfloat16")
    for name, text in SIDE_FILES.items():
        (folder / name).write_text(text)
    os.chmod(folder / "tokenizer_config.json", 0o600)
    return folder, logical


@pytest.fixture(scope="module")
def converted(release, tmp_path_factory):
    src, _ = release
    dst = tmp_path_factory.mktemp("converted") / "k3_bf16"
    old = os.umask(0o022)
    try:
        report = convert_k3(src, dst, max_shard_size="1MB")
    finally:
        os.umask(old)
    return dst, report


@pytest.fixture(scope="module")
def release_logits(release):
    return logits(release[0])


def test_names_dtypes_and_values(release, converted):
    src, logical = release
    dst, report = converted
    source_names = index_of(src)["weight_map"]
    expected = {n.replace(".weight_packed", ".weight") for n in source_names if not n.endswith(".weight_scale")}
    out = tensors(dst)
    assert set(out) == expected == set(logical)
    for name, t in out.items():
        want = torch.float32 if name in RELEASE_F32 else torch.bfloat16
        assert t.dtype == want, name  # never uint8
        assert torch.equal(t.float(), logical[name]), name  # experts: dequantised exactly; the rest: copied
    assert sum(bool(EXPERT.search(n)) for n in out) == EXPERT_TENSORS
    assert report["experts_dequantised"] == EXPERT_TENSORS and report["tensors"] == len(expected)
    assert report["lossless"] and report["rounded_tensors"] == [] and report["dtype"] == "bfloat16"
    assert report["bytes"] == sum(t.numel() * t.element_size() for t in out.values())


def test_config_and_other_files(release, converted):
    src, _ = release
    dst, report = converted
    before, after = json.loads((src / "config.json").read_text()), json.loads((dst / "config.json").read_text())
    assert before["text_config"].pop("quantization_config")["format"] == "mxfp4-pack-quantized"
    assert after == before  # identical but for the quantization_config (the dtype fields already said bfloat16)
    for name, text in SIDE_FILES.items():
        assert (dst / name).read_text() == text, name
    assert sorted(report["copied_files"]) == sorted(SIDE_FILES)


def test_shards_index_and_file_modes(converted):
    dst, report = converted
    index = index_of(dst)
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n == report["shards"] > 2 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    total = 0
    for file in files:
        with safe_open(dst / file, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
            nbytes = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
            assert sorted(f.keys()) == sorted(k for k, v in index["weight_map"].items() if v == file)
        assert nbytes <= 10**6 or len(sizes) == 1, file  # cut at --max-shard-size (1MB = 10^6 bytes)
        total += nbytes
    assert index["metadata"]["total_size"] == total == report["bytes"]
    assert sorted(os.listdir(dst)) == sorted([*files, INDEX, "config.json", *SIDE_FILES])  # nothing else
    assert stat.S_IMODE(dst.stat().st_mode) == 0o755
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in dst.iterdir()}
    assert modes == dict.fromkeys(modes, 0o644), modes  # the private tokenizer_config.json too
    assert leftovers(dst.parent) == []


def test_output_loads_and_gives_the_same_logits(converted, release_logits):
    dst, _ = converted
    assert torch.equal(logits(dst), release_logits)


def test_float32_output_is_exact(release, release_logits, tmp_path):
    src, logical = release
    report = convert_k3(src, tmp_path / "fp32", dtype="float32")
    out = load_file(tmp_path / "fp32" / "model.safetensors")  # 5GB shards: one file, no index
    assert report["shards"] == 1 and all(t.dtype == torch.float32 for t in out.values())
    assert all(torch.equal(out[n], logical[n]) for n in logical)
    cfg = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert cfg["dtype"] == cfg["text_config"]["dtype"] == "float32" and "quantization_config" not in cfg["text_config"]
    assert (logits(tmp_path / "fp32") - release_logits).abs().max() <= 1e-6


def test_float32_release_rounds_to_bfloat16_and_says_so(tmp_path):
    src = tmp_path / "fp32_release"
    logical = write_k3_checkpoint(src, tiny_k3_config(), seed=1, mxfp4=True, shards=2, dtype="float32")
    report = convert_k3(src, tmp_path / "out", dtype="bfloat16")
    out = load_file(tmp_path / "out" / "model.safetensors")
    for name, t in out.items():
        if name in RELEASE_F32:
            assert t.dtype == torch.float32 and torch.equal(t, logical[name]), name
        else:  # experts exact, the float32 tensors rounded to bf16
            assert t.dtype == torch.bfloat16 and torch.equal(t, logical[name].to(torch.bfloat16)), name
    assert not report["lossless"] and report["rounded_tensors"]
    assert not any(n in RELEASE_F32 or EXPERT.search(n) for n in report["rounded_tensors"])


def test_a_release_with_plain_experts_is_copied(release, converted, tmp_path):
    """A folder already bf16 (experts as .weight, no quantization_config): copied, and the same as the MXFP4 one's."""
    src = tmp_path / "bf16_release"
    logical = write_k3_checkpoint(src, tiny_k3_config(), seed=0, mxfp4=False, shards=3, dtype="bfloat16")
    assert all(torch.equal(v, release[1][k]) for k, v in logical.items())  # same seed: same logical tensors
    report = convert_k3(src, tmp_path / "out", max_shard_size="1MB")
    assert report["experts_dequantised"] == 0 and report["lossless"]
    mxfp4_out, plain_out = tensors(converted[0]), tensors(tmp_path / "out")
    assert mxfp4_out.keys() == plain_out.keys()
    assert all(torch.equal(mxfp4_out[k], plain_out[k]) and mxfp4_out[k].dtype == plain_out[k].dtype for k in plain_out)


def test_cli_converts_and_verifies(release, tmp_path):
    src, _ = release
    dst = tmp_path / "k3_bf16"
    r = shell(str(SCRIPT), "convert", "k3", str(src), str(dst), "--max-shard-size", "1MB", "--verify", "--no-progress")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    wrote, verified = r.stdout.strip().splitlines()
    assert wrote.startswith(
        f"wrote {dst}: {len(index_of(dst)['weight_map'])} tensors ({EXPERT_TENSORS} MXFP4 expert weights dequantised)"
    )
    assert verified.startswith("verified: SRC and DST give the same logits (max |diff| 0, "), verified
    assert leftovers(tmp_path) == []


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensor(folder: Path, name: str, edit) -> str:
    """Replaces tensor `name` of a copied release by edit(tensor); returns its shard's file name."""
    file = index_of(folder)["weight_map"][name]
    state = load_file(folder / file)
    state[name] = edit(state[name]).contiguous()
    save_file(state, folder / file, metadata={"format": "pt"})
    return file


L2 = "language_model.model.layers.2.block_sparse_moe.experts.5"


def _missing_shard(folder):
    (folder / "model-00002-of-00003.safetensors").unlink()
    return r"names shards that do not exist: .*model-00002-of-00003\.safetensors"


def _truncated_expert(folder):
    file = _edit_tensor(folder, f"{L2}.w2.weight_packed", lambda t: t[:, :-1])  # w2: [64, 96] -> packed [64, 48]
    return rf"tensor {re.escape(L2)}\.w2\.weight_packed \(in .*{file}\) has shape \[64, 47\], the config implies \[64, 48\]"


def _wrong_scale_width(folder):
    file = _edit_tensor(folder, f"{L2}.w1.weight_scale", lambda t: torch.cat([t, t[:, :1]], 1))  # [96, 2] -> [96, 3]
    return (
        rf"tensor {re.escape(L2)}\.w1\.weight_scale \(in .*{file}\) has shape \[96, 3\], the config implies \[96, 2\]"
    )


def _not_k3(folder):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "kimi_linear"}))
    return r"config\.json: model_type is 'kimi_linear', expected 'kimi_k3': not a Kimi K3 folder"


def _truncated_file(folder):
    path = folder / "model-00003-of-00003.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    return r"cannot read .*model-00003-of-00003\.safetensors: truncated"


def _unpaired_scale(folder):
    file = index_of(folder)["weight_map"][f"{L2}.w3.weight_packed"]
    state = load_file(folder / file)
    del state[f"{L2}.w3.weight_packed"]
    save_file(state, folder / file, metadata={"format": "pt"})
    index = index_of(folder)
    del index["weight_map"][f"{L2}.w3.weight_packed"]
    (folder / INDEX).write_text(json.dumps(index))
    return rf"tensor {re.escape(L2)}\.w3\.weight_scale \(in .*\) has no weight_packed"


def _missing_expert(folder):
    file = index_of(folder)["weight_map"][f"{L2}.w1.weight_packed"]
    state = load_file(folder / file)
    del state[f"{L2}.w1.weight_packed"], state[f"{L2}.w1.weight_scale"]
    save_file(state, folder / file, metadata={"format": "pt"})
    index = index_of(folder)
    del index["weight_map"][f"{L2}.w1.weight_packed"], index["weight_map"][f"{L2}.w1.weight_scale"]
    (folder / INDEX).write_text(json.dumps(index))
    return rf"broken lacks 1 routed-expert tensor\(s\), e\.g\. {re.escape(L2)}\.w1\.weight_packed"


def _no_quantization_config(folder):
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["text_config"]["quantization_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    return r"config\.json has no text_config\.quantization_config, but tensor .*\.weight_packed is MXFP4-packed"


def _other_quantization(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["quantization_config"]["format"] = "nvfp4-pack-quantized"
    (folder / "config.json").write_text(json.dumps(cfg))
    return r"text_config\.quantization_config has quant_method 'compressed-tensors', format 'nvfp4-pack-quantized'"


@pytest.mark.parametrize(
    "break_it",
    [
        _missing_shard,
        _truncated_expert,
        _wrong_scale_width,
        _not_k3,
        _truncated_file,
        _unpaired_scale,
        _missing_expert,
        _no_quantization_config,
        _other_quantization,
    ],
)
def test_cli_errors_are_one_line_and_leave_nothing(release, tmp_path, break_it):
    """Each is found from config.json and the headers, before any tensor is read (and before torch is imported)."""
    src = _copy(release[0], tmp_path / "broken")
    pattern = break_it(src)
    r = shell(str(SCRIPT), "convert", "k3", str(src), str(tmp_path / "out"))
    assert re.search(pattern, one_line_error(r)), (pattern, r.stderr)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_cli_refuses_an_existing_dst(release, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    r = shell(str(SCRIPT), "convert", "k3", str(release[0]), str(dst))
    assert "exists and is not empty" in one_line_error(r) and "--overwrite" in r.stderr
    assert os.listdir(dst) == ["keep.txt"] and leftovers(tmp_path) == []


def test_a_failure_while_writing_leaves_nothing(release, tmp_path):
    """A defect only the data shows (the E8M0 NaN scale byte) in the last source shard: shards were already written."""
    src = _copy(release[0], tmp_path / "nan")
    name = "language_model.model.layers.6.block_sparse_moe.experts.7.w2.weight_scale"
    assert index_of(src)["weight_map"][name] == "model-00003-of-00003.safetensors"
    _edit_tensor(src, name, lambda t: t.clone().index_fill_(0, torch.tensor([0]), 255))
    dst = tmp_path / "out"
    dst.mkdir()  # an empty DST may exist; a failure leaves it as it was
    with pytest.raises(
        ValueError, match=rf"tensor {re.escape(name)} \(in .*model-00003-of-00003\.safetensors\) holds the E8M0 NaN"
    ):
        convert_k3(src, dst, max_shard_size="200KB")
    assert os.listdir(dst) == [] and leftovers(tmp_path) == []


def test_a_failed_verification_leaves_nothing(release, tmp_path, monkeypatch):
    """--verify runs on the finished temporary folder; only a verified folder is moved to DST."""
    import kimi_hf.conversion.k3 as k3

    def disagree(src, dst, layers, round_to):
        assert os.path.basename(dst).startswith(".convert-k3-") and os.path.exists(os.path.join(dst, "config.json"))
        raise ValueError("--verify: the logits differ")

    monkeypatch.setattr(k3, "verify_k3", disagree)
    with pytest.raises(ValueError, match="logits differ"):
        convert_k3(release[0], tmp_path / "out", verify=True)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_overwrite_replaces_dst_only_when_asked(release, converted, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        convert_k3(release[0], dst)
    convert_k3(release[0], dst, max_shard_size="1MB", overwrite=True)
    assert "old.txt" not in os.listdir(dst) and leftovers(tmp_path) == []
    assert tensors(dst).keys() == tensors(converted[0]).keys()
    with pytest.raises(ValueError, match="is SRC"):
        convert_k3(release[0], release[0], overwrite=True)


def test_help_names_the_options_and_does_not_import_torch(capsys):
    assert main(["convert", "k3", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kimi-hf convert k3 [-h] [--dtype {bfloat16,float16,float32}]")
    for option in ("--max-shard-size", "--verify", "--overwrite", "SRC", "DST"):
        assert option in out
    assert main(["convert", "--help"]) == 0 and "  k3 " in capsys.readouterr().out
    r = shell(sys.executable, "-X", "importtime", str(SCRIPT), "convert", "k3", "--help")
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert r.returncode == 0 and "kimi_hf.conversion.cli" in imported and "torch" not in imported
    r = shell(sys.executable, str(ROOT / "conversion" / "convert_k3.py"), "--help")  # as the other converters' scripts
    assert r.returncode == 0 and r.stdout.startswith("usage: convert_k3.py [-h] [--dtype {bfloat16,float16,float32}]")


def _big_release(folder: Path, shards: int = 2) -> list[int]:
    """A K3 release whose routed experts dominate (hidden = latent = moe_intermediate = 1024, 8 experts), written
    with random bytes (fast; the values do not matter here), in `shards` files of about equal size. Returns
    the shard file sizes."""
    config = tiny_k3_config(
        hidden_size=1024, routed_expert_hidden_size=1024, moe_intermediate_size=1024, num_experts=8
    )
    gen = torch.Generator().manual_seed(0)
    stored = {}
    for name, shape, init, keep_fp32 in k3_logical_specs(config):
        if init[0] == "mxfp4":
            base = name.removesuffix(".weight")
            out_f, in_f = shape
            stored[f"{base}.weight_packed"] = torch.randint(
                0, 256, (out_f, in_f // 2), generator=gen, dtype=torch.uint8
            )
            stored[f"{base}.weight_scale"] = torch.randint(120, 124, (out_f, in_f // 32), generator=gen).to(
                torch.uint8
            )
        else:
            stored[name] = (0.02 * torch.randn(shape, generator=gen)).to(
                torch.float32 if keep_fp32 else torch.bfloat16
            )
    total = sum(t.numel() * t.element_size() for t in stored.values())
    folder.mkdir()
    weight_map, chunk, size, k = {}, {}, 0, 0
    for i, (name, t) in enumerate(stored.items()):
        chunk[name], size = t, size + t.numel() * t.element_size()
        if size >= total * (k + 1) / shards or i == len(stored) - 1:
            file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            save_file(chunk, folder / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(chunk, file))
            chunk, k = {}, k + 1
    assert k == shards
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return [os.path.getsize(folder / f"model-{j + 1:05d}-of-{shards:05d}.safetensors") for j in range(shards)]


def test_streaming_peak_memory_is_far_below_one_shard(tmp_path, capsys):
    """The CLI in its own process on two ~90 MB MXFP4 shards that become one ~390 MB bf16 shard: its peak RSS
    (VmHWM; getrusage's ru_maxrss would include this test process's, from the fork) minus its RSS before it
    streams is a few tensors and the allocator's slack (~20 MB), not a shard in or out."""
    sizes = _big_release(tmp_path / "big")
    r = shell(str(SCRIPT), "convert", "k3", str(tmp_path / "big"), str(tmp_path / "out"), "--max-shard-size", "2GB")
    assert r.returncode == 0, r.stderr[-3000:]
    growth = float(re.search(r"\(\+(\d+) MB while converting\)", r.stdout).group(1))
    out_mb = os.path.getsize(tmp_path / "out" / "model.safetensors") / 2**20
    with capsys.disabled():
        print(
            f"\n[k3 streaming] source shards {[round(s / 2**20, 1) for s in sizes]} MB -> one {out_mb:.0f} MB bf16 "
            f"shard; peak RSS growth {growth:.0f} MB"
        )
    assert growth < 0.5 * min(sizes) / 2**20 and growth < 0.1 * out_mb, r.stdout


def test_the_tiktoken_tokenizer_becomes_a_fast_one_with_k3_chat(tmp_path):
    """A release with K3's tiktoken files and no generation_config.json: tokenizer.json with K3's template,
    AutoTokenizer without remote code, and a generation config that stops at <|end_of_msg|>, then [EOS]."""
    from transformers import AutoTokenizer, GenerationConfig

    from ..models.kimi_k3.release_format import tiny_k3_chat_config, write_k3_tokenizer_files

    src = tmp_path / "release"
    write_k3_checkpoint(src, tiny_k3_chat_config(), seed=0, mxfp4=True, shards=1, dtype="bfloat16")
    n = write_k3_tokenizer_files(src)
    report = convert_k3(src, tmp_path / "out")
    out = tmp_path / "out"
    assert report["tokenizer_converted"] and (out / "tokenizer.json").is_file() and (out / "tiktoken.model").is_file()
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("[BOS]", "[EOS]", "[PAD]")
    assert tok.convert_tokens_to_ids("<|end_of_msg|>") == n + 2
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, thinking_effort=None) == (
        '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'
    )
    assert GenerationConfig.from_pretrained(out).eos_token_id == [n + 2, n + 1]
    # a class transformers 4.x has too (test_tokenizer_transformers4.py loads the folder there); the release's
    # auto_map only stays where its remote code (tokenization_kimi.py) is in the folder, which this release lacks
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "auto_map" not in cfg


def test_a_release_with_remote_code_converts_without_a_prompt(tmp_path):
    """A release as published: tokenizer_config.json and config.json carry auto_maps to the folder's own .py files
    (tokenization_kimi.py, configuration_kimi_k3.py). `kimi-hf convert k3` never imports them and never asks:
    transformers' "Do you wish to run the custom code? [y/N]" (AutoTokenizer / AutoConfig with trust_remote_code
    unset) would wait on a terminal; here stdin is not one, and the conversion must finish without it, the remote
    code copied to DST unrun. The converter reads the vocabulary from tiktoken.model itself (tokenizer.py)."""
    from ..models.kimi_k3.release_format import tiny_k3_chat_config, write_k3_tokenizer_files

    src, dst, ran = tmp_path / "release", tmp_path / "out", tmp_path / "remote_code_ran"
    write_k3_checkpoint(src, tiny_k3_chat_config(), seed=0, mxfp4=True, shards=1, dtype="bfloat16")
    write_k3_tokenizer_files(src)
    for file, cls in (("tokenization_kimi.py", "TikTokenTokenizer"), ("configuration_kimi_k3.py", "KimiK3Config")):
        (src / file).write_text(f"open({str(ran)!r}, 'w').close()  # proof it ran\n\n\nclass {cls}:\n    pass\n")
    assert "auto_map" in json.loads((src / "tokenizer_config.json").read_text())
    assert "auto_map" in json.loads((src / "config.json").read_text())
    r = subprocess.run(
        [str(SCRIPT), "convert", "k3", str(src), str(dst), "--no-progress"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,  # transformers' prompt gives up after 15 s on a terminal; with no terminal it must not appear
    )
    assert r.returncode == 0, r.stderr[-3000:]
    said = r.stdout + r.stderr
    assert "custom code" not in said and "[y/N]" not in said and "trust_remote_code" not in said, said
    assert not ran.exists()
    assert (dst / "tokenizer.json").is_file() and (dst / "tokenization_kimi.py").is_file()
    assert json.loads((dst / "generation_config.json").read_text())["eos_token_id"] == [258, 257]  # <|end_of_msg|>
