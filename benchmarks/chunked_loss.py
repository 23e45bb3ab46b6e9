"""The language-model head + cross-entropy in chunks of tokens (kimi_hf.ops.chunked_causal_lm_loss, the model option
`loss_chunk_size`) against the plain head + transformers' ForCausalLMLoss: peak memory and time of a forward +
backward of the loss alone, from the decoder's output [1, T, d] to the gradients of it and of the head.

    python benchmarks/chunked_loss.py                 # 2048 tokens x 32768 vocab on CPU, then Kimi K3's sizes on meta
    python benchmarks/chunked_loss.py --tokens 512 --vocab 4096 --hidden 64 --chunk 128 --repeats 1 --no-k3

Peak MB: the most bytes alive at once among the tensors the loss's ops create, forward and backward (every op
recorded by a dispatch mode, kimi_hf.plan.trace.LiveStorages, the one the memory planner uses; the hidden states and
the head weight themselves not counted, the gradients of both counted alike in each column). This is what a CUDA
allocator would have to hold beyond the inputs, measured on CPU without torch.cuda. The Kimi K3 rows (T 8192, vocab
163840, hidden 7168, bf16) run on the meta device: the same ops and sizes without data, so no time.
"""

from __future__ import annotations

import os
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from common import argument_parser, ratio_range, spread_cell, spread_warning, timed, warn  # noqa: E402
from torch import nn  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

from kimi_hf.ops import chunked_causal_lm_loss  # noqa: E402
from kimi_hf.plan.trace import LiveStorages  # noqa: E402


K3 = dict(tokens=8192, vocab=163840, hidden=7168, dtype=torch.bfloat16)
HEADER = (
    "| tokens | vocab | hidden | dtype | chunk | plain peak MB | chunked peak MB | ratio | plain ms | chunked ms "
    "| spread | time ratio |"
)


def setup(tokens: int, vocab: int, hidden: int, dtype: torch.dtype, device: str):
    torch.manual_seed(0)
    head = nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)
    if device != "meta":
        nn.init.normal_(head.weight, std=hidden**-0.5)
        h = torch.randn(1, tokens, hidden, dtype=dtype, device=device)
        labels = torch.randint(0, vocab, (1, tokens), device=device)
    else:
        h = torch.empty(1, tokens, hidden, dtype=dtype, device=device)
        labels = torch.empty(1, tokens, dtype=torch.long, device=device)
    return head, h, labels


def step(head, h, labels, vocab: int, chunk: int | None):
    """One forward + backward of the loss; the gradients are dropped after."""
    hidden = h.detach().requires_grad_()
    if chunk is None:
        loss = ForCausalLMLoss(head(hidden), labels, vocab)
    else:
        loss = chunked_causal_lm_loss(hidden, head, labels, chunk_size=chunk)
    loss.backward()
    head.weight.grad = None
    return loss


def peak_bytes(head, h, labels, vocab: int, chunk: int | None) -> int:
    mode = LiveStorages(exclude={h.untyped_storage()._cdata, head.weight.untyped_storage()._cdata}, follow_peak=True)
    with mode:
        loss = step(head, h, labels, vocab, chunk)
    del loss
    return mode.peak


def row(tokens, vocab, hidden, dtype, chunk, device, repeats) -> tuple[str, dict]:
    head, h, labels = setup(tokens, vocab, hidden, dtype, device)
    plain, chunked = (peak_bytes(head, h, labels, vocab, c) for c in (None, chunk))
    cells = [str(tokens), str(vocab), str(hidden), str(dtype).removeprefix("torch."), str(chunk)]
    cells += [f"{plain / 2**20:.0f}", f"{chunked / 2**20:.0f}", f"{chunked / plain:.3f}"]
    timings = {}
    if device == "meta":
        cells += ["n/a", "n/a", "n/a", "n/a"]
    else:
        t_plain = timed(lambda: step(head, h, labels, vocab, None), repeats)
        t_chunked = timed(lambda: step(head, h, labels, vocab, chunk), repeats)
        ratio, low, high = ratio_range(t_chunked, t_plain)
        cells += [f"{t_plain.ms:.1f}", f"{t_chunked.ms:.1f}", spread_cell(t_plain, t_chunked)]
        cells += [f"{ratio:.2f} ({low:.2f}-{high:.2f})"]
        timings = {f"T={tokens} plain": t_plain, f"T={tokens} chunked": t_chunked}
    return "| " + " | ".join(cells) + " |", timings


def main(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048], help="tokens of the batch (rows of the table)")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=512, help="loss_chunk_size")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k3-chunks", type=int, nargs="+", default=[4096, 1024], help="chunk sizes of the K3 rows")
    p.add_argument("--no-k3", action="store_true", help="skip Kimi K3's sizes on the meta device")
    args = p.parse_args(argv)
    torch.set_flush_denormal(True)
    dtype = getattr(torch, args.dtype)
    print(f"# loss forward + backward, CPU ({torch.get_num_threads()} threads); peak = live bytes beyond the inputs")
    print(HEADER)
    print("|---" * (HEADER.count("|") - 1) + "|")
    timings = {}
    for tokens in args.tokens:
        line, t = row(tokens, args.vocab, args.hidden, dtype, args.chunk, "cpu", args.repeats)
        print(line, flush=True)
        timings.update(t)
    if not args.no_k3:
        for chunk in args.k3_chunks:
            line, _ = row(K3["tokens"], K3["vocab"], K3["hidden"], K3["dtype"], chunk, "meta", 0)
            print(line, flush=True)
    warn(spread_warning(timings, "loss timings"))


if __name__ == "__main__":
    main()
