"""KDA on CUDA: kimi_hf's Triton kernels against fla's (chunk_kda, fused_recurrent_kda), same inputs,
same process.

    python benchmarks/kda.py --cuda                  # = python benchmarks/kda_cuda.py
    python benchmarks/kda_cuda.py --T 4096 16384 65536 --H 32 --D 128 --out results.json
    TRITON_INTERPRET=1 python benchmarks/kda_cuda.py --smoke   # tiny shapes on CPU: the script runs

1. correctness: ours and fla against the fp32 token-loop reference (kimi_hf.ops, backend="reference")
   on packed sequences with an initial state, in fp32 and bf16: output, final state, every gradient;
2. chunked forward and forward+backward: median time (triton.testing.do_bench; the spread of its
   repeats, with a WARNING line when it is too large to trust the ratio) and peak memory,
   bf16 inputs, fp32 gates and state, q/k L2 norm in the kernel, for both the plain call and the
   fused gate (g = -exp(A_log) softplus(f + dt_bias), sigmoid(beta) inside);
3. decode: one token with a state in and out, ours (recurrent_kda) vs fla's fused_recurrent_kda.
fla's chunk kernels need a GPU driver; under --smoke its columns read n/a.
"""

from __future__ import annotations

import json
import os
import sys

import torch


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import NOT_RUN, Timing, argument_parser, spread_cell, spread_warning, timed, warn  # noqa: E402

from kimi_hf.ops import chunk_kda, recurrent_kda  # noqa: E402


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def fla_ops():
    try:
        from fla.ops.kda import chunk_kda as fla_chunk
        from fla.ops.kda import fused_recurrent_kda as fla_rec
    except ImportError:
        return None, None
    return fla_chunk, fla_rec


def inputs(B, T, H, K, V, dtype, device, seed=0, fused=False, requires_grad=False):
    """q, k, v (dtype), g fp32 (or the raw f when fused), beta (dtype; logits when fused)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    if fused:
        g, beta = r(B, T, H, K), r(B, T, H)
    else:  # per-channel gates like a trained layer's: mostly mild, some channels decaying fast
        g, beta = torch.nn.functional.logsigmoid(r(B, T, H, K) * 2) * 2, torch.rand(B, T, H, generator=gen)
    xs = [q.to(dtype), k.to(dtype), v.to(dtype), g.float(), beta.to(dtype)]
    return [x.to(device).requires_grad_(requires_grad) for x in xs]


def gate_params(H, K, device):
    gen = torch.Generator().manual_seed(1)
    A_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log()
    dt = torch.empty(H * K).uniform_(-6.9, -2.3, generator=gen).exp()
    return A_log.to(device).requires_grad_(), (dt + torch.log(-torch.expm1(-dt))).to(device).requires_grad_()


def ours_call(fused, gp, **kw):
    extra = dict(use_gate_in_kernel=True, A_log=gp[0], dt_bias=gp[1], use_beta_sigmoid_in_kernel=True) if fused else {}
    return lambda q, k, v, g, b, **call_kw: chunk_kda(q, k, v, g, b, use_qk_l2norm=True, **extra, **kw, **call_kw)


def fla_call(fla_chunk, fused, gp):
    extra = dict(use_gate_in_kernel=True, A_log=gp[0], dt_bias=gp[1], use_beta_sigmoid_in_kernel=True) if fused else {}
    return lambda q, k, v, g, b, **call_kw: fla_chunk(q, k, v, g, b, use_qk_l2norm_in_kernel=True, **extra, **call_kw)


def with_grads(fn, xs, h0, cu):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    h = h0.detach().clone().requires_grad_()
    o, S = fn(*xs, initial_state=h, output_final_state=True, cu_seqlens=cu)
    gen = torch.Generator().manual_seed(3)
    w_o, w_s = torch.randn(o.shape, generator=gen).to(o.device), torch.randn(S.shape, generator=gen).to(o.device)
    ((o.float() * w_o).sum() + (S * w_s).sum()).backward()
    return [o, S] + [x.grad for x in xs] + [h.grad]


def correctness(device, smoke):
    fla_chunk, _ = fla_ops()
    H, K, V = (2, 16, 16) if smoke else (4, 128, 128)
    lens = [5, 0, 70] if smoke else [100, 0, 257, 643]
    cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], device=device)
    N, T = len(lens), sum(lens)
    names = ["o", "S", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    print("\n## correctness: rel RMS error vs the fp32 token loop (packed sequences incl. an empty one, h0)")
    print("| dtype | impl | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    rows = []
    for dtype in (torch.float32,) if smoke else (torch.float32, torch.bfloat16):
        xs = inputs(1, T, H, K, V, dtype, device, seed=7)
        h0 = torch.randn(N, H, K, V, generator=torch.Generator().manual_seed(2)).to(device)
        ref = with_grads(ours_call(False, None, backend="reference"), [x.float() for x in xs], h0, cu)
        impls = {"ours": ours_call(False, None, backend="triton")}
        if fla_chunk is not None and not smoke:
            impls["fla"] = fla_call(fla_chunk, False, None)
        for name, fn in impls.items():
            try:
                got = with_grads(fn, xs, h0, cu)
                errs = [rel_rms(a.float(), b.float()) for a, b in zip(got, ref)]
            except Exception as e:  # a peer failing is a result, not a crash of the benchmark
                print(f"| {str(dtype)[6:]} | {name} | failed: {type(e).__name__}: {str(e)[:80]} |")
                continue
            rows.append(dict(dtype=str(dtype), impl=name, **dict(zip(names, errs))))
            print(f"| {str(dtype)[6:]} | {name} | " + " | ".join(f"{e:.1e}" for e in errs) + " |", flush=True)
    return rows


def bench(fn, device) -> Timing:
    if device == "cuda":
        import triton.testing

        times_ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="all")  # ~100 ms of CUDA-event repeats
        return Timing(tuple(t / 1e3 for t in times_ms))
    return timed(fn, 2)  # --smoke: the interpreter is slow; two repeats still give a spread


def peak_mb(fn, device):
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def speed(args, device):
    fla_chunk, _ = fla_ops()
    rows = []
    for fused in (False, True):
        print(
            f"\n## chunked KDA, {'fused gate + sigmoid(beta) + l2norm' if fused else 'precomputed gate, l2norm in kernel'}: "
            f"B=1 H={args.H} K=V={args.D}, {args.dtype}"
        )
        print("| T | mode | ours ms | fla ms | spread | ours / fla time | ours MB | fla MB |")
        print("|---|---|---|---|---|---|---|---|")
        times = {}
        for T in args.T:
            for backward in (False, True):
                xs = inputs(
                    1,
                    T,
                    args.H,
                    args.D,
                    args.D,
                    getattr(torch, args.dtype),
                    device,
                    fused=fused,
                    requires_grad=backward,
                )
                gp = gate_params(args.H, args.D, device) if fused else None
                do = torch.randn(1, T, args.H, args.D, device=device).to(xs[0].dtype)
                res = {}
                impls = {"ours": ours_call(fused, gp, backend="triton")}
                if fla_chunk is not None:
                    impls["fla"] = fla_call(fla_chunk, fused, gp)
                for name, fn in impls.items():

                    def step(fn=fn):
                        if backward:
                            fn(*xs)[0].backward(do)
                        else:
                            with torch.no_grad():
                                fn(*xs)

                    try:
                        res[name] = (bench(step, device), peak_mb(step, device))
                    except Exception as e:
                        print(f"<!-- {name} failed at T={T}: {type(e).__name__}: {str(e)[:120]} -->")
                    for x in xs + list(gp or ()):
                        x.grad = None
                (to, mo), (tf, mf) = (res.get(name, (NOT_RUN, float("nan"))) for name in ("ours", "fla"))
                mode = "fwd+bwd" if backward else "fwd"
                times.update({f"T={T} {mode} ours": to, f"T={T} {mode} fla": tf})
                print(
                    f"| {T} | {mode} | {to.ms:.2f} | {tf.ms:.2f} | {spread_cell(to, tf)} "
                    f"| {to.median / tf.median:.2f} | {mo:.0f} | {mf:.0f} |",
                    flush=True,
                )
                rows.append(
                    dict(
                        T=T,
                        mode=mode,
                        fused=fused,
                        ours_ms=to.ms,
                        fla_ms=tf.ms,
                        ours_spread=to.spread,
                        fla_spread=tf.spread,
                        ours_mb=mo,
                        fla_mb=mf,
                    )
                )
        warn(spread_warning(times, "chunk timings"))
    return rows


def decode(args, device):
    _, fla_rec = fla_ops()
    dtype = getattr(torch, args.dtype)
    print(f"\n## decode: one token, state in and out, H={args.H} K=V={args.D}, {args.dtype} inputs, fp32 state")
    print("| B | ours us | fla us | spread | ours / fla time | max abs diff |")
    print("|---|---|---|---|---|---|")
    rows, times = [], {}
    for B in args.decode_batch:
        xs = inputs(B, 1, args.H, args.D, args.D, dtype, device, seed=B)
        h0 = torch.randn(B, args.H, args.D, args.D, device=device) * 0.1

        def ours():
            return recurrent_kda(*xs, initial_state=h0, output_final_state=True, use_qk_l2norm=True, backend="triton")

        with torch.no_grad():
            t_o, o_ours = bench(ours, device), ours()[0]
            t_f, diff = NOT_RUN, float("nan")
            if fla_rec is not None:
                fla = lambda: fla_rec(*xs, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)  # noqa: E731
                try:
                    t_f, diff = bench(fla, device), (fla()[0].float() - o_ours.float()).abs().max().item()
                except Exception as e:
                    print(f"<!-- fla decode failed: {type(e).__name__}: {str(e)[:120]} -->")
        times.update({f"B={B} ours": t_o, f"B={B} fla": t_f})
        print(
            f"| {B} | {t_o.median * 1e6:.1f} | {t_f.median * 1e6:.1f} | {spread_cell(t_o, t_f)} "
            f"| {t_o.median / t_f.median:.2f} | {diff:.1e} |",
            flush=True,
        )
        rows.append(
            dict(
                B=B,
                ours_us=t_o.median * 1e6,
                fla_us=t_f.median * 1e6,
                ours_spread=t_o.spread,
                fla_spread=t_f.spread,
                max_abs_diff=diff,
            )
        )
    warn(spread_warning(times, "decode timings"))
    return rows


def main(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--T", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--H", type=int, default=32)
    p.add_argument("--D", type=int, default=128, help="head dim (K = V)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--decode-batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--smoke runs the kernels under the interpreter: set TRITON_INTERPRET=1")
        device, args.T, args.H, args.D, args.decode_batch, args.dtype = "cpu", [64], 1, 16, [1], "float32"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        p.error("no CUDA device (use --smoke with TRITON_INTERPRET=1 to check the script on CPU)")
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    import triton

    fla_version = getattr(sys.modules.get("fla"), "__version__", "not installed") if fla_ops()[0] else "not installed"
    print(f"# KDA on {name}: torch {torch.__version__}, triton {triton.__version__}, fla {fla_version}")
    results = {"device": name}
    if not args.skip_correctness:
        results["correctness"] = correctness(device, args.smoke)
    results["chunk"] = speed(args, device)
    results["decode"] = decode(args, device)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
