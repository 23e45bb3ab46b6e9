"""Context parallelism's memory per rank: one training step (forward + backward) of a small Kimi K3-architecture model
on one long sequence, in one process and split over 2 and 4 gloo ranks (kimi_hf.distributed.context).

    python benchmarks/k3_context_memory.py                 # T = 16384 tokens, 1 / 2 / 4 ranks, checkpointing off / on
    python benchmarks/k3_context_memory.py --quick         # T = 2048 (a smoke run)

Reported per rank (the largest over the ranks): the activations autograd saves for the backward (summed exactly by
torch.autograd.graph.saved_tensors_hooks: what grows with T), and the peak of the step's allocations above the
process's memory before it (RssAnon sampled every 2 ms: weights, gradients and the backward's transients included),
each with its ratio to one process. The ideal is 1 / cp; what is not split: MLA's gathered latent and the per-head
keys and values expanded from it (every rank attends its queries over the whole sequence), MLA's mask [T / cp, T],
and the second KDA pass's outputs on ranks > 0 (kimi_hf/ops/kda_context.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, HERE)

from common import argument_parser  # noqa: E402


CHILD = r"""
import json, os, sys, torch
import torch.distributed as dist
from memory_sampler import Peak, status
from transformers.loss.loss_utils import ForCausalLMLoss
from kimi_hf import KimiK3ForConditionalGeneration
from kimi_hf.presets import small_k3_config
from kimi_hf.distributed.context import context_parallel_batch, enable_context_parallel

T, hidden, layers, checkpointing, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("gloo")
rank = dist.get_rank() if world > 1 else 0

torch.manual_seed(0)
cfg = small_k3_config(hidden, layers, vocab_size=512, heads=4, mla_head_dim=32, media_token_id=511, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
model = KimiK3ForConditionalGeneration._from_config(cfg, attn_implementation="sdpa").train()
if checkpointing:
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
ids = torch.randint(3, 500, (1, T), generator=torch.Generator().manual_seed(1))
labels = torch.full_like(ids, -100); labels[:, :-1] = ids[:, 1:]
inputs = {"input_ids": ids}
if world > 1:
    enable_context_parallel(model, None)
    part = context_parallel_batch(ids, None)
    inputs, labels = {"input_ids": part["input_ids"], "position_ids": part["position_ids"]}, part["shift_labels"]
saved = [0]
def pack(t):
    saved[0] += t.numel() * t.element_size()
    return t
base = status(("RssAnon",))["RssAnon"]
peak = Peak(("RssAnon",))
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    logits = model(**inputs, use_cache=False).logits
    loss = ForCausalLMLoss(logits, None, cfg.text_config.vocab_size, num_items_in_batch=T - 1, shift_labels=labels)
loss.backward()
top = peak.stop()["RssAnon"]
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"saved": saved[0], "peak": top - base}, f)
if world > 1:
    dist.destroy_process_group()
"""


def measure(T: int, hidden: int, layers: int, ranks: int, checkpointing: bool) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]), OMP_NUM_THREADS="1")
        if ranks == 1:
            cmd = [sys.executable, "-c", CHILD]
        else:
            script = os.path.join(out, "child.py")
            with open(script, "w") as f:
                f.write(CHILD)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), script]
        args = [str(T), str(hidden), str(layers), str(int(checkpointing)), out]
        subprocess.run([*cmd, *args], check=True, env=env, capture_output=True)
        parts = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(ranks)]
    return {key: max(p[key] for p in parts) for key in ("saved", "peak")}


def main(argv=None) -> None:
    p = argument_parser(__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="T = 2048")
    args = p.parse_args(argv)
    T = 2048 if args.quick else args.seq_len
    print(
        f"K3-architecture model, hidden {args.hidden}, {args.layers} layers (3 KDA : 1 MLA), one sequence of T = {T}"
    )
    for checkpointing in (False, True):
        rows = {cp: measure(T, args.hidden, args.layers, cp, checkpointing) for cp in (1, 2, 4)}
        one = rows[1]
        print(f"\ngradient checkpointing {'on' if checkpointing else 'off'}")
        print("| ranks (cp) | tokens a rank | saved activations a rank | ratio | step peak a rank | ratio | ideal |")
        print("|---|---|---|---|---|---|---|")
        for cp, r in rows.items():
            print(
                f"| {cp} | {T // cp} | {r['saved'] / 2**20:.0f} MB | {r['saved'] / one['saved']:.3f}x | "
                f"{r['peak'] / 2**20:.0f} MB | {r['peak'] / one['peak']:.3f}x | {1 / cp:.3f}x |"
            )


if __name__ == "__main__":
    main()
