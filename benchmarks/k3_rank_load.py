"""Loading Kimi K3 per rank: each rank reads only the bytes of the tensors it keeps, so its load peak is its share
of the model, not a shard or the whole.

    python benchmarks/k3_rank_load.py              # the ~1 GB K3-shaped folder (benchmarks/k3_shaped.py), 4 gloo ranks
    python benchmarks/k3_rank_load.py --quick

For each layout, `torchrun --nproc_per_node 4` (gloo, CPU) runs `from_pretrained(folder, distributed_config=...)`
with the routed experts resident in MXFP4 (the default), from a model built on the meta device (transformers shards
it before any weight exists). Layouts, in transformers' DistributedConfig terms (pp x fsdp x tp = pp x efsdp x ep):
"EP 4" = tp_size 4, ep_size 4 (whole experts, a quarter per rank; the rest by tensor parallelism), "TP 2 x EP 2"
= tp_size 2, ep_size 2, dp_replicate_size 2 (experts halved by EP, the rest by TP, two replicas) and "PP 2 x EP 2" =
two pipeline stages, each loaded by `kimi_hf.distributed.load_pipeline_stage` with ep_size 2, fsdp_size 2 (a stage's
layers, their experts halved by EP; the stage's dense weights whole until FSDP2 shards them after the load).
Each rank samples its RssAnon (allocated memory) and VmRSS (that plus the pages of the shards it mapped and touched:
tensors the loader keeps as views of the file count there) every 2 ms during the load (after a warm-up load of a
tiny folder, so imports are done) and reports the peak growth against the bytes it holds afterwards (its parameters'
and buffers' local shards). The issue's target: the RssAnon peak <= 1.25x the rank's share (VmRSS, which also counts the page cache
of what was read, beside it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile


sys.modules.setdefault("fla", None)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import argument_parser  # noqa: E402
from k3_shaped import add_shape_arguments, write_k3_shaped  # noqa: E402


WORKER = r"""
import gc, json, sys, threading, time, torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers.distributed import DistributedConfig
from kimi_hf import KimiK3ForConditionalGeneration

def rss():  # (RssAnon: allocated, VmRSS: allocated + the shards' mapped pages this process touched)
    out = {}
    for line in open("/proc/self/status"):
        key = line.split(":")[0]
        if key in ("RssAnon", "VmRSS"):
            out[key] = int(line.split()[1]) * 1024
    return out["RssAnon"], out["VmRSS"]
folder, tiny, tp, ep, replicas, pp = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
dist.init_process_group("gloo")
if pp == 1:
    config = DistributedConfig(tp_size=tp, ep_size=ep, dp_replicate_size=replicas)
    load = lambda path: KimiK3ForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16, distributed_config=config)
else:  # a stage's ranks: ep of them hold its experts, all of them are its data ranks
    from kimi_hf.distributed import PipelineStageInfo, load_pipeline_stage
    world = dist.get_world_size()
    config = DistributedConfig(ep_size=ep, fsdp_size=world // pp)
    def load(path):
        layers = KimiK3ForConditionalGeneration.config_class.from_pretrained(path).text_config.num_hidden_layers
        stage = PipelineStageInfo.split(layers, dist.get_rank() // (world // pp), pp)
        return load_pipeline_stage(KimiK3ForConditionalGeneration, path, stage, distributed_config=config,
                                   dtype=torch.bfloat16)
warm = load(tiny)
del warm
gc.collect()
dist.barrier()
before = rss()
peak, done = list(before), threading.Event()
def sample():
    while not done.is_set():
        peak[:] = [max(p, v) for p, v in zip(peak, rss())]
        time.sleep(0.002)
sampler = threading.Thread(target=sample)
sampler.start()
t0 = time.perf_counter()
model = load(folder)
seconds = time.perf_counter() - t0
done.set()
sampler.join()
local = lambda t: t.to_local() if isinstance(t, DTensor) else t
held = sum(local(t).numel() * local(t).element_size() for t in [*model.parameters(), *model.buffers()])
whole = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
out = [None] * dist.get_world_size()
dist.all_gather_object(out, dict(rank=dist.get_rank(), anon=peak[0] - before[0], rss=peak[1] - before[1], held=held, whole=whole,
                             seconds=seconds))
if dist.get_rank() == 0:
    print(json.dumps(out))
dist.destroy_process_group()
"""

# (tp_size, ep_size, dp_replicate_size, pipeline stages)
LAYOUTS = {"EP 4": (4, 4, 1, 1), "TP 2 x EP 2": (2, 2, 2, 1), "PP 2 x EP 2": (1, 2, 1, 2)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    p = argument_parser(__doc__)
    add_shape_arguments(p)
    p.add_argument("--quick", action="store_true", help="a ~60 MB folder")
    args = p.parse_args(argv)
    args.heads = 8  # heads divisible by tp 4
    if args.quick:
        args.experts, args.hidden, args.latent, args.inter, args.vocab = 32, 512, 256, 256, 1024
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as tiny:
        size = write_k3_shaped(folder, args, heads=8)
        small = argparse_namespace(args, experts=16, hidden=256, latent=128, inter=128, vocab=512, layers=2)
        write_k3_shaped(tiny, small, heads=8, quiet=True)
        with tempfile.TemporaryDirectory() as scratch:
            worker = os.path.join(scratch, "worker.py")
            with open(worker, "w") as f:
                f.write(WORKER)
            rows = []
            for name, sizes in LAYOUTS.items():
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4"]
                cmd += ["--master_port", str(free_port()), worker, folder, tiny, *map(str, sizes)]
                env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
                if out.returncode:
                    sys.exit(out.stdout[-2000:] + out.stderr[-6000:])
                rows.append((name, json.loads(out.stdout.strip().splitlines()[-1])))
    mb = lambda b: f"{b / 2**20:.0f} MB"  # noqa: E731
    print(
        f"# K3-shaped folder {size / 2**30:.2f} GiB ({args.experts} experts, MXFP4 resident, bf16 rest), 4 gloo ranks"
    )
    print(
        "| layout | rank | holds (its share) | load peak growth: RssAnon | RssAnon peak / share | "
        "VmRSS (+ touched shard pages) | VmRSS peak / share | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|")
    whole = max(r["whole"] for _, ranks in rows for r in ranks)  # (a pipeline stage's model is its part of it)
    for name, ranks in rows:
        for r in ranks:
            print(
                f"| {name} | {r['rank']} | {mb(r['held'])} of {mb(whole)} | {mb(r['anon'])} | "
                f"**{r['anon'] / r['held']:.2f}x** | {mb(r['rss'])} | {r['rss'] / r['held']:.2f}x | {r['seconds']:.1f} |"
            )


def argparse_namespace(args, **changes):
    import argparse

    return argparse.Namespace(**{**vars(args), **changes})


if __name__ == "__main__":
    main()
