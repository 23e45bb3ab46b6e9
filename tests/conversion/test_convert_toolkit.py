"""The toolkit every converter shares (kimi-linear, k25-vision, k3): one peak-memory helper, one progress bar, one
atomic output folder, one --verify (one truncation rule), one list of the tensors kept in float32, and command
lines without import cycles."""

import ast
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import kimi_hf
from kimi_hf.conversion import checkpoint, fp32, k3, k3_plan, k25_vision, kimi_linear, monitor, output_dir, verify

from ..models.kimi_hybrid.helpers import tiny_config
from ..models.kimi_k3.release_format import k3_logical_specs, tiny_k3_config


ROOT = Path(__file__).resolve().parents[2]
CONVERTERS = (kimi_linear, k25_vision, k3)


def test_every_converter_reports_memory_and_progress_through_the_same_helpers():
    for module in CONVERTERS:
        assert module.peak_rss_mb is monitor.peak_rss_mb and module.progress is monitor.progress, module.__name__


def test_peak_memory_is_the_converters_own_not_its_parents(tmp_path):
    """The converter runs in a child of a process holding 2 GB: getrusage's ru_maxrss would report the parent's
    pages (kept across exec), the printed peak (VmHWM) is the converter's own few hundred MB."""
    src = tmp_path / "src"
    kimi_hf.KimiHybridForCausalLM(tiny_config()).save_pretrained(src)
    script = ROOT / "conversion" / "convert_kimi_linear.py"
    parent = (
        "import resource, subprocess, sys\n"
        "held = bytearray(2 << 30)\n"
        "held[::4096] = b'x' * len(held[::4096])\n"  # touch every page: resident
        f"r = subprocess.run([sys.executable, {str(script)!r}, {str(src)!r}, {str(tmp_path / 'out')!r}, '--no-progress'],"
        " capture_output=True, text=True)\n"
        "print(r.stdout, r.stderr[-2000:])\n"
        "print('children maxrss', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)\n"
    )
    r = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=600)
    printed = re.search(r"peak memory (\d+) MB", r.stdout)
    assert printed, r.stdout + r.stderr
    children = float(re.search(r"children maxrss ([\d.]+)", r.stdout).group(1))
    assert children > 2048  # what ru_maxrss says of the converter: the parent's 2 GB and more
    assert int(printed.group(1)) < 1536, r.stdout


def test_peak_memory_reads_vmhwm_on_linux():
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc")
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    assert abs(monitor.peak_rss_mb() - hwm) <= 64  # the same figure (pytest allocates a little in between)
    assert monitor.rss_mb() <= monitor.peak_rss_mb() + 1


def test_a_progress_bar_not_shown_iterates_and_updates_silently(capsys):
    bar = monitor.progress(range(3), 3, "converting", enabled=False)
    assert list(bar) == [0, 1, 2]
    bar.update(5)
    bar.close()
    assert capsys.readouterr() == ("", "")


def test_the_output_folder_is_installed_by_one_function():
    assert checkpoint.install is output_dir.install and k3.output_dir is output_dir.output_dir


def test_the_output_folder_gets_normal_modes_and_never_replaces_what_it_must_not(tmp_path):
    dst = tmp_path / "out"
    old = os.umask(0o022)
    try:
        with output_dir.output_dir(str(dst), ".convert-") as tmp:
            Path(tmp, "a.json").write_text("{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(dst.stat().st_mode) == 0o755 and stat.S_IMODE((dst / "a.json").stat().st_mode) == 0o644
    # a non-empty folder at dst (one that appeared after the caller's checks) stays, without overwrite
    with pytest.raises(OSError):
        with output_dir.output_dir(str(dst), ".convert-"):
            pass
    assert os.listdir(dst) == ["a.json"] and [p.name for p in tmp_path.iterdir()] == ["out"]
    with output_dir.output_dir(str(dst), ".convert-", overwrite=True) as tmp:
        Path(tmp, "b.json").write_text("{}")
    assert os.listdir(dst) == ["b.json"] and [p.name for p in tmp_path.iterdir()] == ["out"]
    # a failure inside the block leaves dst as it was and removes the temporary folder
    with pytest.raises(KeyboardInterrupt):
        with output_dir.output_dir(str(dst), ".convert-", overwrite=True):
            raise KeyboardInterrupt
    assert os.listdir(dst) == ["b.json"] and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_verify_is_one_implementation_with_one_truncation_rule():
    assert kimi_linear.compare_logits is k3.compare_logits is verify.compare_logits
    assert k3_plan.verify_layer_count is verify.verify_layer_count  # K3's memory check counts the same layers
    # one layout, linear layers 1-2 then MLA at 3, in Kimi Linear's spelling and in K3's (1-based lists)
    linear = {
        "num_hidden_layers": 5,
        "layer_types": ["linear_attention"] * 2 + ["full_attention"] + ["linear_attention"] * 2,
        "mlp_layer_types": ["dense"] + ["sparse"] * 4,
    }
    released = {
        "text_config": {
            "num_hidden_layers": 5,
            "linear_attn_config": {"kda_layers": [1, 2, 4, 5], "full_attn_layers": [3]},
        }
    }
    for layers, n in ((0, 5), (1, 3), (3, 3), (4, 4), (5, 5), (9, 5)):
        assert verify.verify_layer_count(linear, layers) == verify.verify_layer_count(released, layers) == n
    cut = verify.truncated_config(linear, 4)
    assert cut["num_hidden_layers"] == 4 and len(cut["layer_types"]) == len(cut["mlp_layer_types"]) == 4
    lac = verify.truncated_config(released, 1)["text_config"]["linear_attn_config"]
    assert lac == {"kda_layers": [1, 2], "full_attn_layers": [3]} and released["text_config"]["num_hidden_layers"] == 5


def test_the_fp32_list_is_the_models_and_k3s_is_what_the_release_stores_in_f32():
    assert fp32.model_fp32_modules() == tuple(kimi_hf.KimiHybridPreTrainedModel._keep_in_fp32_modules_strict)
    assert fp32.kimi_linear_fp32() == tuple(kimi_hf.KimiK3ForCausalLM._keep_in_fp32_modules_strict)
    specs = k3_logical_specs(tiny_k3_config())
    assert {n for n, *_ in specs if fp32.keeps_fp32(n, fp32.k3_fp32())} == {n for n, _, _, keep in specs if keep}
    router = "language_model.model.layers.1.block_sparse_moe.gate.weight"
    assert fp32.keeps_fp32(router, fp32.kimi_linear_fp32()) and not fp32.keeps_fp32(router, fp32.k3_fp32())
    assert not fp32.keeps_fp32("model.layers.1.mlp.gate_proj.weight", fp32.kimi_linear_fp32())


def _imports(path: Path, module: str) -> set[str]:
    """The kimi_hf modules a file imports, at module level or inside functions (relative imports resolved)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def test_no_cli_or_conversion_module_imports_a_module_that_imports_it_back():
    modules = {}
    for path in (ROOT / "kimi_hf").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    imports = {m: _imports(p, m) & set(modules) - {m} for m, p in modules.items()}
    ours = [m for m in modules if m.startswith(("kimi_hf.cli", "kimi_hf.conversion"))]
    cycles = [(a, b) for a in ours for b in imports[a] if a in imports[b]]
    assert cycles == []
    assert not {"kimi_hf.cli", "kimi_hf.conversion.cli"} & imports["kimi_hf.cli_args"]  # the shared leaf


def test_sizes_are_read_by_one_leaf_module():
    """kimi_hf.sizes reads every size and imports the standard library only; cli_args (the command lines' shared
    leaf) imports it and nothing else of the package, no parent or sibling package; no other module of the package
    defines a size parser of its own."""
    modules = {}
    for path in (ROOT / "kimi_hf").rglob("*.py"):
        modules[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    sizes = _imports(modules["kimi_hf.sizes"], "kimi_hf.sizes")
    assert {name.split(".")[0] for name in sizes} <= set(sys.stdlib_module_names) | {"__future__"}, sizes
    assert _imports(modules["kimi_hf.cli_args"], "kimi_hf.cli_args") & set(modules) == {"kimi_hf.sizes"}
    parsers = re.compile(r"^def (parse_size|parse_bytes|\w*size_to_int)\(", re.MULTILINE)
    defined = [m for m, p in modules.items() if parsers.search(p.read_text())]
    assert defined == ["kimi_hf.sizes"], defined


@pytest.mark.parametrize("text", ["5GB", "500MB", "100KB", "5GiB", "3MiB", "64KiB", "5gB", "5gib", "2048"])
def test_every_size_flag_reads_a_size_as_transformers_does(text):
    """One convention: "5GB" is 5 x 10^9 bytes and "5GiB" 5 x 2^30, as transformers' save_pretrained reads
    max_shard_size, in every converter's --max-shard-size, `kimi-hf plan --gpu-memory` and the Python API alike
    (transformers takes a bare number only as an int)."""
    from transformers.utils.hub import convert_file_size_to_int

    from kimi_hf.conversion.cli import k3_parser, k25_vision_parser, kimi_linear_parser
    from kimi_hf.plan.cli import parser as plan_parser

    expected = convert_file_size_to_int(int(text) if text.isdigit() else text)
    assert kimi_hf.conversion.parse_size(text) == expected
    for parser, positional in ((kimi_linear_parser(), 2), (k25_vision_parser(), 3), (k3_parser(), 2)):
        args = parser.parse_args([*"abc"[:positional], "--max-shard-size", text])
        assert args.max_shard_size == expected, parser.prog
        assert parser.parse_args(list("abc"[:positional])).max_shard_size == 5 * 10**9  # the default: 5GB
    assert plan_parser().parse_args(["config.json", "--gpu-memory", text]).gpu_memory == expected


@pytest.mark.parametrize(
    "value, error",
    [
        ("5Gb", ValueError),  # transformers: bits
        ("500mb", ValueError),
        ("lots", ValueError),
        ("0", ValueError),
        (0, ValueError),
        (None, TypeError),
        (True, TypeError),
    ],
)
def test_a_bad_max_shard_size_is_refused_naming_the_argument_before_any_work(tmp_path, value, error):
    """The Python API names its argument and the value, and creates nothing (ShardedWriter: kimi-linear, k25-vision;
    convert_k3)."""
    with pytest.raises(error, match="max_shard_size"):
        checkpoint.ShardedWriter(str(tmp_path / "out"), value)
    with pytest.raises(error, match="max_shard_size"):
        k3.convert_k3(tmp_path / "missing", tmp_path / "out", max_shard_size=value)
    assert os.listdir(tmp_path) == []
    if isinstance(value, str):
        with pytest.raises(ValueError, match=re.escape(repr(value))):
            kimi_hf.conversion.parse_size(value, "max_shard_size")
    if value in ("5Gb", "500mb"):  # the error names the byte spelling
        with pytest.raises(ValueError, match="bits; write (5GB|500MB) for bytes"):
            kimi_hf.conversion.parse_size(value)
