"""KDA operator benchmark on CPU: ours (kimi_hf.ops.chunk_kda, torch path) against transformers'
kimi_linear torch fallbacks (chunk_kimi_delta_attention and the token loop recurrent_kimi_delta_attention).

    python benchmarks/kda.py                 # T in 512 ... 8192, B=1, H=4, K=V=64
    python benchmarks/kda.py --quick         # T in 256, 512, 1024, no memory column: about a minute
    python benchmarks/kda.py --cuda [...]    # the CUDA section: Triton kernels vs fla (kda_cuda.py)
    python benchmarks/kda.py --gate-only     # only the "safe gate vs plain gate" table

Prints one table per mode (forward, forward+backward): median time, the spread of the repeats, peak
memory (extra RSS of a fresh process running the call once) and our speed-up over each peer, then the
scaling check time(8192) / time(2048), then "safe gate vs plain gate": ours with the gate computed inside
(use_gate_in_kernel=True), Kimi K3's safe gate lower_bound * sigmoid(exp(A_log) (f + dt_bias)) against
Kimi-Linear's -exp(A_log) softplus(f + dt_bias), and their ratio (the bounded gate should cost nothing
extra: <= 1.05x). Nothing else should run on the machine meanwhile: timings on
shared machines swing widely, and a WARNING line says when they did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


if "--cuda" not in sys.argv:  # CPU peers are transformers' torch fallbacks; keep fla's CPU warning out
    sys.modules.setdefault("fla", None)

import torch  # noqa: E402


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import (  # noqa: E402
    NOT_RUN,
    Timing,
    argument_parser,
    ratio_range,
    scaling_warning,
    spread_cell,
    spread_warning,
    timed,
    warn,
)


IMPLS = ("ours", "hf_chunk", "hf_loop")


def peers():
    """transformers' pure-torch fallbacks (bypassing the hub-kernel / fla dispatch wrapper)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as m

    unwrap = lambda f: getattr(f, "__wrapped__", f)  # noqa: E731
    return unwrap(m.chunk_kimi_delta_attention), unwrap(m.recurrent_kimi_delta_attention)


def make_inputs(T, H, K, V, requires_grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    # per-channel gates like a trained layer's: mostly mild, some channels decaying fast
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, K, generator=gen) * 2) * 2
    beta = torch.rand(1, T, H, generator=gen)
    xs = [q, k, v, g, beta]
    return [x.requires_grad_(requires_grad) for x in xs]


def runner(impl):
    if impl == "ours":
        from kimi_hf.ops import chunk_kda

        return lambda q, k, v, g, b: chunk_kda(q, k, v, g, b, backend="torch")[0]
    hf_chunk, hf_loop = peers()
    if impl == "hf_chunk":
        return lambda q, k, v, g, b: hf_chunk(q, k, v, g, b)[0]
    return lambda q, k, v, g, b: hf_loop(q, k, v, g, b, initial_state=None, output_final_state=False)[0]


LOWER_BOUND = -5.0  # Kimi K3's safe-gate bound


def gate_inputs(T, H, K, V, requires_grad=False, seed=0):
    """Inputs of the fused-gate calls: q, k, v, the raw forget input f (either sign), beta, A_log [H] and
    dt_bias [H * K] (Kimi-Linear's initialisation: A_log = log of 1 ... 16)."""
    q, k, v, _, beta = make_inputs(T, H, K, V, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    f = torch.randn(1, T, H, K, generator=gen) * 2
    A_log = torch.empty(H).uniform_(1, 16, generator=gen).log()
    dt_bias = torch.randn(H * K, generator=gen) * 0.5
    return [x.requires_grad_(requires_grad) for x in (q, k, v, f, beta, A_log, dt_bias)]


def gate_runner(safe):
    """ours (torch path) with the gate inside: the K3 safe gate or Kimi-Linear's."""
    from kimi_hf.ops import chunk_kda

    gate = dict(safe_gate=True, lower_bound=LOWER_BOUND) if safe else {}

    def fn(q, k, v, f, b, A_log, dt_bias):
        return chunk_kda(
            q, k, v, f, b, backend="torch", use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, **gate
        )[0]

    return fn


def timed_pair(fa, fb, repeats, budget_s=None, min_repeats=3):
    """Timings of fa() and fb() measured in alternation (a b, b a, a b, ...) after one warm-up call each,
    so that a change of the machine's load weighs on both alike: their ratio is what the table is about.
    With budget_s, stops once the repeats took that long (after at least min(min_repeats, repeats))."""
    fa()
    fb()
    ta, tb, start = [], [], time.perf_counter()
    for i in range(repeats):
        for fn, times in ((fa, ta), (fb, tb)) if i % 2 == 0 else ((fb, tb), (fa, ta)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if budget_s is not None and i + 1 >= min(min_repeats, repeats) and time.perf_counter() - start > budget_s:
            break
    return Timing(tuple(ta)), Timing(tuple(tb))


def gate_table(args):
    """The "safe gate vs plain gate" table; returns its timings by label."""
    print(f"\n## safe gate vs plain gate (ours, use_gate_in_kernel=True; safe: lower_bound={LOWER_BOUND})")
    print("| T | mode | plain ms | safe ms | spread | safe / plain |")
    print("|---|---|---|---|---|---|")
    times = {}
    for T in args.T:
        for backward in (False, True):
            mode = "fwd+bwd" if backward else "fwd"
            xs = gate_inputs(T, args.H, args.K, args.V, requires_grad=backward)
            plain_fn, safe_fn = gate_runner(False), gate_runner(True)
            plain, safe_t = timed_pair(
                lambda: call(plain_fn, xs, backward),
                lambda: call(safe_fn, xs, backward),
                args.repeats,
                budget_s=args.budget,
            )
            times[f"T={T} plain ({mode})"], times[f"T={T} safe ({mode})"] = plain, safe_t
            print(
                f"| {T} | {mode} | {plain.ms:.1f} | {safe_t.ms:.1f} | {spread_cell(plain, safe_t)} | "
                f"{safe_t.median / plain.median:.2f}x |",
                flush=True,
            )
    warn(spread_warning(times, "gate timings"))
    return times


def call(fn, xs, backward):
    if backward:
        fn(*xs).sum().backward()
    else:
        with torch.no_grad():
            fn(*xs)


def _status_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure_peak():
    """Resets the process's peak RSS (Linux clear_refs) and returns a function giving the extra
    peak RSS in MB since then. CPU tensors have no allocator statistics; RSS is what users see."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kb("VmRSS")
    return lambda: (_status_kb("VmHWM") - base) / 1024


def peak_memory_mb(impl, T, H, K, V, backward):
    """Extra peak RSS of a fresh process that runs the call once."""
    code = (
        "import json, sys; sys.modules['fla'] = None; import torch; sys.path[:0] = %r; import kda as b; "
        "xs = b.make_inputs(%d, %d, %d, %d, %r); fn = b.runner(%r); "
        "peak = b.measure_peak(); b.call(fn, xs, %r); print(json.dumps(peak()))"
    ) % ([os.path.dirname(os.path.abspath(__file__))], T, H, K, V, backward, impl, backward)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--cuda" in argv:  # the CUDA section: ours (Triton) vs fla, see kda_cuda.py
        import kda_cuda

        return kda_cuda.main([a for a in argv if a != "--cuda"])
    p = argument_parser(__doc__)
    p.add_argument("--T", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192], help="sequence lengths")
    p.add_argument("--H", type=int, default=4, help="heads")
    p.add_argument("--K", type=int, default=64, help="key head dim")
    p.add_argument("--V", type=int, default=64, help="value head dim")
    p.add_argument("--repeats", type=int, default=5, help="timed calls of ours (peers: at most 3) after a warm-up")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds of repeats per cell after which to stop (keeping at least 3 repeats)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="T in 256, 512, 1024, 5 repeats for all, a 3 s budget per cell, no memory: about a minute",
    )
    p.add_argument("--cuda", action="store_true", help="the CUDA section instead (kda_cuda.py; --help there)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--gate-only", action="store_true", help='only the "safe gate vs plain gate" table (ours alone)')
    p.add_argument("--max-T-hf-chunk", type=int, default=4096, help="largest T for the slow chunked fallback")
    p.add_argument(
        "--max-T-peer-backward",
        type=int,
        default=4096,
        help="largest T for the peers' forward+backward (the token loop's autograd takes minutes at 8192)",
    )
    args = p.parse_args(argv)
    peer_repeats = max(1, min(3, args.repeats))
    if args.quick:
        # the peers dominate the run time (~linear in T); one fresh process per memory cell costs seconds of imports
        args.T, args.repeats, peer_repeats, args.no_memory = [256, 512, 1024], 5, 5, True
        args.budget = args.budget or 3.0
    torch.set_flush_denormal(True)
    print(
        f"# KDA on CPU: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"B=1 H={args.H} K={args.K} V={args.V}, fp32, median of {args.repeats} (peers {peer_repeats})"
        f"{'; no memory column (--quick)' if args.quick else ''}"
    )
    print("# spread: interquartile range / median of a cell's repeats, the worst of the row ('!': too noisy)")
    if args.gate_only:
        return gate_table(args)
    ours_times, all_times = {}, {}
    for backward in (False, True):
        mode = "forward+backward" if backward else "forward"
        print(f"\n## {mode}")
        memory = "" if args.no_memory else " ours MB | hf chunk MB | hf loop MB |"
        print(f"| T | ours ms | hf chunk ms | hf loop ms | spread |{memory} vs hf chunk | vs hf loop |")
        print("|---" * (7 if args.no_memory else 10) + "|")
        mode_times = {}
        for T in args.T:
            res = {}
            for impl in IMPLS:
                if (impl == "hf_chunk" and T > args.max_T_hf_chunk) or (
                    impl != "ours" and backward and T > args.max_T_peer_backward
                ):
                    res[impl] = (NOT_RUN, float("nan"))
                    continue
                xs = make_inputs(T, args.H, args.K, args.V, requires_grad=backward)
                fn = runner(impl)
                t = timed(
                    lambda: call(fn, xs, backward),
                    args.repeats if impl == "ours" else peer_repeats,
                    budget_s=args.budget,
                )
                mem = float("nan") if args.no_memory else peak_memory_mb(impl, T, args.H, args.K, args.V, backward)
                res[impl] = (t, mem)
                mode_times[f"T={T} {impl}"] = t
            ours_times[(backward, T)] = res["ours"][0]
            (to, mo), (tc, mc), (tl, ml) = (res[i] for i in IMPLS)
            mb = "" if args.no_memory else f" {mo:.0f} | {mc:.0f} | {ml:.0f} |"
            print(
                f"| {T} | {to.ms:.1f} | {tc.ms:.1f} | {tl.ms:.1f} | {spread_cell(to, tc, tl)} |{mb} "
                f"{tc.median / to.median:.1f}x | {tl.median / to.median:.1f}x |",
                flush=True,
            )
        warn(spread_warning(mode_times, f"{mode} timings"))
        all_times.update({f"{k} ({'fwd+bwd' if backward else 'fwd'})": v for k, v in mode_times.items()})
    lo, hi = (2048, 8192) if {2048, 8192} <= set(args.T) else (min(args.T), max(args.T))
    if hi > lo:
        for backward in (False, True):
            label = "fwd+bwd" if backward else "fwd"
            ratio, low, high = ratio_range(ours_times[(backward, hi)], ours_times[(backward, lo)])
            print(
                f"\nscaling ({label}): time({hi}) / time({lo}) = {ratio:.2f} (the repeats allow {low:.2f} to "
                f"{high:.2f}; linear: {hi / lo:.0f})"
            )
            warn(scaling_warning(f"scaling ({label})", ours_times[(backward, lo)], ours_times[(backward, hi)], lo, hi))
    all_times.update(gate_table(args))
    return all_times


if __name__ == "__main__":
    main()
