"""Peak memory of the streaming export (kimi_hf.distributed.export) against the model it writes: the export must never
hold the whole model, only about one output shard plus its inputs.

    python benchmarks/k3_export.py            # the ~1 GB K3-shaped folder (LoRA), a smaller one for full fine-tuning
    python benchmarks/k3_export.py --quick

Steps: write the K3-shaped folder (benchmarks/k3_shaped.py, MXFP4 experts, 4 shards), train one step with
`examples/k3_finetune.py --lora` (and `--full` on the smaller folder) saving a sharded checkpoint, then export in a fresh
process that samples its RssAnon (allocated memory) every 2 ms; the table gives the peak growth against the largest
source shard / output shard, the largest decoder layer and the whole model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import argument_parser  # noqa: E402
from k3_shaped import add_shape_arguments, write_k3_shaped  # noqa: E402


EXPORT = r"""
import gc, json, sys, threading, time
import torch.distributed.checkpoint, transformers, kimi_hf  # imported before the baseline: not the export's memory
from kimi_hf.distributed.export import export_full, export_lora
from kimi_hf.models.kimi_k3 import modeling_kimi_k3

def rss_anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024
kind, step_dir, model_dir, out = sys.argv[1:5]
gc.collect()
before = rss_anon()
peak, done = [before], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.002)
t = threading.Thread(target=sample, daemon=True)
t.start()
if kind == "lora":
    export_lora(step_dir, model_dir, out, scaling=2.0)
else:
    export_full(step_dir, model_dir, out, max_shard_size=int(sys.argv[5]))
done.set(); t.join()
print(json.dumps({"peak_growth": max(peak[0], rss_anon()) - before}))
"""


def shard_sizes(folder: str) -> list[int]:
    return [os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors")]


def layer_bytes(folder: str) -> int:
    """The largest decoder layer's stored bytes (from the index)."""
    import re

    from safetensors import safe_open

    sizes: dict[int, int] = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as f:
                for key in f.keys():
                    m = re.search(r"\.layers\.(\d+)\.", key)
                    if m and key.startswith("language_model."):
                        sl = f.get_slice(key)
                        n = 1
                        for d in sl.get_shape():
                            n *= d
                        itemsize = {"BF16": 2, "F32": 4, "U8": 1, "F16": 2}.get(sl.get_dtype(), 4)
                        sizes[int(m.group(1))] = sizes.get(int(m.group(1)), 0) + n * itemsize
    return max(sizes.values())


def train(folder: str, mode: str, ck: str) -> None:
    cmd = [sys.executable, os.path.join(ROOT, "examples", "k3_finetune.py"), "--model", folder, mode, "--steps", "1"]
    cmd += ["--data", "random", "--seq-len", "16", "--micro-batches", "1", "--dtype", "bfloat16"]
    cmd += ["--checkpoint-dir", ck]
    res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    if res.returncode:
        raise SystemExit(f"k3_finetune failed: {res.stderr[-2000:]}")


def export(kind: str, ck: str, folder: str, out: str, max_shard: int) -> int:
    cmd = [sys.executable, "-c", EXPORT, kind, os.path.join(ck, "step-1"), folder, out, str(max_shard)]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_growth"]


def main(argv=None):
    p = argument_parser(__doc__.split("\n\n")[0])
    add_shape_arguments(p)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--full-experts", type=int, default=96, help="routed experts of the full fine-tuning folder")
    args = p.parse_args(argv)
    if args.quick:
        args.experts, args.layers, args.hidden, args.full_experts = 64, 4, 512, 32
    mb = 1e6
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, experts in (("lora", args.experts), ("full", args.full_experts)):
            folder = os.path.join(tmp, kind)
            args.experts = experts
            write_k3_shaped(folder, args, shards=4, quiet=True)
            ck = os.path.join(tmp, kind + "_ck")
            train(folder, "--" + kind, ck)
            out = os.path.join(tmp, kind + "_out")
            max_shard = max(shard_sizes(folder))
            peak = export(kind, ck, folder, out, max_shard)
            model = sum(shard_sizes(out))
            rows.append((kind, model, max(shard_sizes(folder)), max(shard_sizes(out)), layer_bytes(out), peak))
    print(
        "| export | model written | largest source shard | largest output shard | largest layer | peak RssAnon growth "
        "| peak / model |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind, model, src, dst, layer, peak in rows:
        name = "LoRA (merged, MXFP4 experts)" if kind == "lora" else "full fine-tuning (dense experts)"
        print(
            f"| {name} | {model / mb:.0f} MB | {src / mb:.0f} MB | {dst / mb:.0f} MB | {layer / mb:.0f} MB "
            f"| {peak / mb:.0f} MB | {peak / model:.2f}x |"
        )


if __name__ == "__main__":
    main()
