"""Kimi K3's architecture on CPU: what its extra parts cost, and what loading a released-layout folder takes.

    python benchmarks/k3.py            # hidden 256, 8 layers: forward at T = 512, 2048; decode; load
    python benchmarks/k3.py --quick

1. Forward and decode of a small K3-architecture model (safe-gate KDA with the full-rank output gate, gated
   MLA with q LoRA, SiTU, Stable LatentMoE, Block Attention Residuals every 4 layers) against the same model
   with Attention Residuals and LatentMoE off (plain residual; routed experts at the full hidden width), the
   other K3 parts unchanged. The issue's target: AttnRes + LatentMoE cost <= +10%.
2. Loading a folder in the released layout (MXFP4 experts, written by our save_pretrained) with
   `from_pretrained(dtype=torch.bfloat16, experts_format="dense")` (the experts dequantised: the bf16 model; resident
   MXFP4 loads are benchmarks/k3_lora_memory.py and k3_rank_load.py) in a fresh process (after a first load of a tiny folder, so that
   imports are done): wall time and the peak growth of allocated memory (RssAnon) against the bf16 model's
   size + its largest shard (the target), and apart from it the shards' pages mapped by the loader (RssFile).

Timings print the spread of their repeats; a WARNING line says when it is too large to trust the ratios.
Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


sys.modules.setdefault("fla", None)

import torch  # noqa: E402


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import argument_parser, decode_step_times, spread_cell, spread_warning, timed, warn  # noqa: E402

from kimi_hf import KimiK3ForConditionalGeneration  # noqa: E402
from kimi_hf.presets import small_k3_config  # noqa: E402


def k3_config(hidden: int, layers: int, k3_parts: bool = True):
    """The benchmark's K3 (see kimi_hf.presets.small_k3_config): 4 heads, MLA heads of 32, 16 experts top-4,
    AttnRes every 4 layers; k3_parts=False turns Attention Residuals and LatentMoE off."""
    return small_k3_config(
        hidden,
        layers,
        vocab_size=1024,
        heads=4,
        mla_head_dim=32,
        experts=16,
        top_k=4,
        attn_res_block_size=4,
        k3_parts=k3_parts,
        vision_hidden=64,
        media_token_id=3,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


LOAD_CHILD = """
import gc, json, sys, threading, time, torch
import kimi_hf
from kimi_hf import KimiK3ForConditionalGeneration
def status_mb():  # RssAnon (allocated memory), RssFile (mapped files: the shards' touched pages), VmRSS, Linux
    out = {}
    for line in open("/proc/self/status"):
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) / 1024
    return out
# a first load of a tiny folder imports what loading needs (transformers loads modules lazily) without leaving
# freed heap that the measured load would reuse (that would hide part of its allocations)
warm = KimiK3ForConditionalGeneration.from_pretrained(sys.argv[2], dtype=torch.bfloat16, experts_format="dense")
del warm
gc.collect()
before = status_mb()
peak, done = dict(before), threading.Event()
def sample():  # the kernel keeps a high-water mark only for the total: sample the parts every 2 ms
    while not done.is_set():
        for key, value in status_mb().items():
            peak[key] = max(peak[key], value)
        time.sleep(0.002)
sampler = threading.Thread(target=sample)
sampler.start()
t0 = time.perf_counter()
model = KimiK3ForConditionalGeneration.from_pretrained(sys.argv[1], dtype=torch.bfloat16, experts_format="dense")
seconds = time.perf_counter() - t0
done.set()
sampler.join()
print(json.dumps(dict(seconds=seconds, before=before, peak=peak)))
"""


def load_report(model: KimiK3ForConditionalGeneration, shard: str) -> dict:
    """Saves `model` in the released layout (MXFP4 experts) and loads it in a fresh process (after a warm-up load
    of a tiny K3 folder)."""
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as tiny:
        model.save_pretrained(folder, saved_experts="mxfp4", max_shard_size=shard)
        KimiK3ForConditionalGeneration(k3_config(64, 4)).save_pretrained(tiny, saved_experts="mxfp4")
        files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
        largest = max(os.path.getsize(os.path.join(folder, f)) for f in files) / 2**20
        on_disk = sum(os.path.getsize(os.path.join(folder, f)) for f in files) / 2**20
        cmd = [sys.executable, "-c", LOAD_CHILD, folder, tiny]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
    bf16 = sum(p.numel() * 2 for p in model.parameters()) / 2**20
    return dict(**result, bf16_mb=bf16, largest_shard_mb=largest, on_disk_mb=on_disk, shards=len(files))


def main(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--T", type=int, nargs="+", default=[512, 2048], help="sequence lengths of the forward")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--shard", default="20MB", help="max_shard_size of the saved folder for the load test")
    p.add_argument("--quick", action="store_true", help="T = 512, 3 repeats, 16 decoded tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.T, args.repeats, args.decode_tokens = [512], 3, 16
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    k3 = KimiK3ForConditionalGeneration(k3_config(args.hidden, args.layers)).eval()
    torch.manual_seed(0)
    plain = KimiK3ForConditionalGeneration(k3_config(args.hidden, args.layers, k3_parts=False)).eval()
    n = sum(p.numel() for p in k3.parameters()) / 1e6
    n_plain = sum(p.numel() for p in plain.parameters()) / 1e6
    print(
        f"# K3 architecture on CPU: torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, hidden "
        f"{args.hidden}, {args.layers} layers, 16 experts top-4; {n:.1f}M params (AttnRes + LatentMoE off: "
        f"{n_plain:.1f}M)"
    )
    print("# spread: interquartile range / median of the repeats, the worst of the row ('!': too noisy to compare)")
    print("\n## forward (B=1, no cache): K3 vs AttnRes + LatentMoE off")
    print("| T | K3 ms | off ms | spread | K3 / off |")
    print("|---|---|---|---|---|")
    times = {}
    for T in args.T:
        x = torch.randint(4, 1024, (1, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            t_k3 = timed(lambda: k3(input_ids=x, use_cache=False), args.repeats)
            t_off = timed(lambda: plain(input_ids=x, use_cache=False), args.repeats)
        times.update({f"forward T={T} K3": t_k3, f"forward T={T} off": t_off})
        print(
            f"| {T} | {t_k3.ms:.1f} | {t_off.ms:.1f} | {spread_cell(t_k3, t_off)} | "
            f"{t_k3.median / t_off.median:.2f}x |",
            flush=True,
        )
    warn(spread_warning(times, "forward timings"))

    print(f"\n## decode (greedy, B=1, prompt 128, {args.decode_tokens} tokens; spread: of the token times)")
    print("| K3 tokens/s | off tokens/s | spread | K3 / off time |")
    print("|---|---|---|---|")
    t_k3 = decode_step_times(k3, 128, args.decode_tokens, 1024, low=4)  # 3 is the image slot
    t_off = decode_step_times(plain, 128, args.decode_tokens, 1024, low=4)
    print(
        f"| {1 / t_k3.median:.0f} | {1 / t_off.median:.0f} | {spread_cell(t_k3, t_off)} | "
        f"{t_k3.median / t_off.median:.2f}x |"
    )
    warn(spread_warning({"decode K3": t_k3, "decode off": t_off}, "decode timings"))

    print("\n## load of the released layout (MXFP4 experts) with dtype=bfloat16, in a fresh process")
    r = load_report(k3, args.shard)
    budget = r["bf16_mb"] + r["largest_shard_mb"]
    grew = {key: r["peak"][key] - r["before"][key] for key in ("VmRSS", "RssAnon", "RssFile")}
    print(
        "| on disk MB | shards | load s | peak growth MB: allocated (RssAnon) | mapped shards (RssFile) | "
        "bf16 model + largest shard MB | allocated / budget |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {r['on_disk_mb']:.1f} | {r['shards']} | {r['seconds']:.2f} | {grew['RssAnon']:.1f} | "
        f"{grew['RssFile']:.1f} | {budget:.1f} | {grew['RssAnon'] / budget:.2f} |"
    )
    print(
        "(RssFile: the safetensors pages the loader touched through its memory maps, page cache the kernel can drop; "
        "peaks sampled every 2 ms)"
    )


if __name__ == "__main__":
    main()
