"""Kimi Delta Attention as a layer would use it: chunked prefill of a packed batch of documents,
then token-by-token decoding from the saved per-sequence states.

    python examples/kda_prefill_decode.py --lengths 300 45 1000 --decode 16

Checks that decoding continues the prefill exactly (against one chunked pass over each full
document) and prints the timings.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from kimi_hf.cli_args import ArgumentParser
from kimi_hf.ops import chunk_kda, recurrent_kda


def gates(shape, gen):
    """KDA's per-channel log-decay as the layer computes it: -exp(A_log) * softplus(f + dt_bias)."""
    A_log = torch.empty(shape[2]).uniform_(1, 16, generator=gen).log()
    return -A_log.exp()[:, None] * F.softplus(torch.randn(shape, generator=gen) - 4)


def check_args(args) -> None:
    """Bad input, found before any work (ValueError naming the argument)."""
    if not args.lengths or min(args.lengths) < 1:
        raise ValueError(f"--lengths must be positive integers, got {args.lengths}")
    for name in ("decode", "heads", "head_dim"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")


def main(argv=None):
    # one-line usage errors (`PROG: error: ...`, exit 2), for argparse's checks and for check_args'
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[300, 45, 1000])
    p.add_argument("--decode", type=int, default=16, help="tokens to decode after each document")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args(argv)
    try:
        check_args(args)
    except (ValueError, TypeError, OSError) as e:
        p.error(" ".join(str(e).split()))
    gen = torch.Generator().manual_seed(0)
    N, H, D, n_dec = len(args.lengths), args.heads, args.head_dim, args.decode
    docs = []
    for L in args.lengths:  # each document: prompt of L tokens + n_dec tokens to decode
        T = L + n_dec
        docs.append(
            (
                torch.randn(1, T, H, D, generator=gen),
                torch.randn(1, T, H, D, generator=gen),
                torch.randn(1, T, H, D, generator=gen),
                gates((1, T, H, D), gen),
                torch.rand(1, T, H, generator=gen),
            )
        )

    # 1) prefill all prompts at once, packed, with cu_seqlens
    cu = torch.tensor([0] + torch.tensor(args.lengths).cumsum(0).tolist())
    packed = [torch.cat([d[i][:, :L] for d, L in zip(docs, args.lengths)], 1) for i in range(5)]
    t0 = time.perf_counter()
    o_prefill, state = chunk_kda(*packed, cu_seqlens=cu, use_qk_l2norm=True, output_final_state=True)
    t_prefill = time.perf_counter() - t0

    # 2) decode: one token of every document per step, batched, state in and out
    t0 = time.perf_counter()
    decoded = []
    for t in range(n_dec):
        step = [torch.cat([d[i][:, L + t : L + t + 1] for d, L in zip(docs, args.lengths)], 0) for i in range(5)]
        o_t, state = recurrent_kda(*step, initial_state=state, use_qk_l2norm=True, output_final_state=True)
        decoded.append(o_t)
    t_decode = time.perf_counter() - t0

    # 3) check against one chunked pass over each full document
    worst = 0.0
    for n, (d, L) in enumerate(zip(docs, args.lengths)):
        o_full, _ = chunk_kda(*d, use_qk_l2norm=True)
        got = torch.cat([o_prefill[:, cu[n] : cu[n + 1]]] + [o[n : n + 1] for o in decoded], 1)
        worst = max(worst, ((got - o_full).norm() / o_full.norm()).item())
    print(f"prefill {sum(args.lengths)} tokens in {N} packed documents: {t_prefill * 1e3:.1f} ms")
    print(f"decode {n_dec} steps x {N} documents: {t_decode / n_dec * 1e3:.2f} ms/step")
    print(f"decode continues prefill: worst relative error {worst:.2e}")
    if worst > 1e-4:
        raise SystemExit("mismatch between decoding and the full chunked pass")
    return worst


if __name__ == "__main__":
    main()
