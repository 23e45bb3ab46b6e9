"""Hybrid model benchmark on CPU: kimi_hf's KimiHybridForCausalLM against transformers' native
KimiLinearForCausalLM (its torch fallbacks: fla is hidden, it cannot run on CPU) on the same tiny
config, decoding compiled with torch.compile(fullgraph=True) over a StaticCache against eager, plus the
cache size against an all-MLA model of the same size.

    python benchmarks/model.py            # forward at T = 512, 2048, 8192; decode; compiled decode; cache
    python benchmarks/model.py --quick    # T = 512, 2048 and fewer steps

Timings print the spread of their repeats (decode: of the per-token times); a WARNING line says when
it is too large to trust the ratios. Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import os
import sys
import time


sys.modules.setdefault("fla", None)  # native kimi_linear would pick fla's Triton kernels and fail on CPU

import torch  # noqa: E402


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import HYBRID_SIZE, Timing, argument_parser, decode_step_times, spread_cell, spread_warning, timed, warn  # noqa: E402
from transformers import StaticCache  # noqa: E402
from transformers.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from kimi_hf import KimiHybridCache, KimiHybridForCausalLM, KimiHybridTextConfig  # noqa: E402
from kimi_hf.models.kimi_hybrid.configuration_kimi_hybrid import kimi_linear_layer_types  # noqa: E402


SIZE = dict(HYBRID_SIZE, layer_types=kimi_linear_layer_types(4))  # Kimi Linear's 3 KDA : 1 MLA
EXPERTS = 8


def models():
    torch.manual_seed(0)
    ours = KimiHybridForCausalLM(KimiHybridTextConfig(**SIZE, num_experts=EXPERTS)).eval()
    torch.manual_seed(0)
    native = KimiLinearForCausalLM(KimiLinearConfig(**SIZE, num_local_experts=EXPERTS, num_key_value_heads=4)).eval()
    return ours, native


@torch.no_grad()
def static_decode_step_times(model, prompt_len, new_tokens, compiled: bool) -> Timing:
    """Greedy decoding steps over a pre-allocated StaticCache (fixed shapes): eager, or one
    torch.compile(fullgraph=True) of the model whose first two steps (compilation) are not timed."""
    x = torch.randint(3, SIZE["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(0))
    warmup = 2 if compiled else 0
    cache = StaticCache(config=model.config, max_cache_len=prompt_len + new_tokens + warmup + 1)
    out = model(x, past_key_values=cache, use_cache=True)
    tok = out.logits[:, -1:].argmax(-1)
    step = torch.compile(model, fullgraph=True) if compiled else model
    times = []
    for _ in range(new_tokens + warmup):
        t0 = time.perf_counter()
        out = step(tok, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t0)
    return Timing(tuple(times[warmup:]))


@torch.no_grad()
def cache_bytes(model, T):
    cache = KimiHybridCache(config=model.config)
    x = torch.randint(3, SIZE["vocab_size"], (1, T), generator=torch.Generator().manual_seed(0))
    model(x, past_key_values=cache, use_cache=True)
    return cache.nbytes()


def main(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--T", type=int, nargs="+", default=[512, 2048, 8192], help="sequence lengths of the forward")
    p.add_argument("--repeats", type=int, default=3, help="timed forwards per T after a warm-up")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens to decode (each step is timed)")
    p.add_argument("--quick", action="store_true", help="T in 512, 2048, 2 repeats, 32 decoded tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.T, args.repeats, args.decode_tokens = [512, 2048], 2, 32
    torch.set_flush_denormal(True)
    ours, native = models()
    n_params = sum(p.numel() for p in ours.parameters())
    print(
        f"# hybrid model on CPU: torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, "
        f"{n_params / 1e6:.1f}M params (3 KDA + 1 MLA layers, {EXPERTS} experts top-2), B=1"
    )

    print("# spread: interquartile range / median of the repeats, the worst of the row ('!': too noisy to compare)")
    print("\n## forward (no cache)")
    print("| T | ours ms | native ms | spread | speed-up |")
    print("|---|---|---|---|---|")
    times = {}
    for T in args.T:
        x = torch.randint(3, SIZE["vocab_size"], (1, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            t_ours = timed(lambda: ours(x, use_cache=False), args.repeats)
            t_nat = timed(lambda: native(x, use_cache=False), 1 if T > 2048 else args.repeats)
        times.update({f"forward T={T} ours": t_ours, f"forward T={T} native": t_nat})
        print(
            f"| {T} | {t_ours.ms:.1f} | {t_nat.ms:.1f} | {spread_cell(t_ours, t_nat)} | "
            f"{t_nat.median / t_ours.median:.1f}x |",
            flush=True,
        )
    warn(spread_warning(times, "forward timings"))

    print(f"\n## decode (greedy, B=1, {args.decode_tokens} new tokens after the prompt; spread: of the token times)")
    print("| prompt | ours tokens/s | native tokens/s | spread | ratio |")
    print("|---|---|---|---|---|")
    times = {}
    for prompt in (128, max(args.T)):
        t_ours = decode_step_times(ours, prompt, args.decode_tokens, SIZE["vocab_size"])
        t_nat = decode_step_times(native, prompt, args.decode_tokens, SIZE["vocab_size"])
        times.update({f"decode prompt={prompt} ours": t_ours, f"decode prompt={prompt} native": t_nat})
        print(
            f"| {prompt} | {1 / t_ours.median:.0f} | {1 / t_nat.median:.0f} | {spread_cell(t_ours, t_nat)} | "
            f"{t_nat.median / t_ours.median:.2f}x |",
            flush=True,
        )
    warn(spread_warning(times, "decode timings"))

    print(f"\n## compiled decoding (torch.compile fullgraph, StaticCache, B=1, {args.decode_tokens} new tokens)")
    print("| prompt | eager tokens/s | compiled tokens/s | spread | speed-up |")
    print("|---|---|---|---|---|")
    times = {}
    for prompt in (128, max(args.T)):
        t_eager = static_decode_step_times(ours, prompt, args.decode_tokens, compiled=False)
        t_comp = static_decode_step_times(ours, prompt, args.decode_tokens, compiled=True)
        times.update({f"static decode prompt={prompt} eager": t_eager, f"compiled prompt={prompt}": t_comp})
        print(
            f"| {prompt} | {1 / t_eager.median:.0f} | {1 / t_comp.median:.0f} | {spread_cell(t_eager, t_comp)} | "
            f"{t_eager.median / t_comp.median:.2f}x |",
            flush=True,
        )
    warn(spread_warning(times, "compiled decode timings"))

    print("\n## cache after T tokens (fp32) vs an all-MLA model of the same size")
    mla = KimiHybridForCausalLM(
        KimiHybridTextConfig(**{**SIZE, "layer_types": ["full_attention"] * 4}, num_experts=EXPERTS)
    ).eval()
    print("| T | hybrid bytes/token | all-MLA bytes/token | ratio |")
    print("|---|---|---|---|")
    for T in args.T:
        a, b = cache_bytes(ours, T), cache_bytes(mla, T)
        print(f"| {T} | {a / T:.0f} | {b / T:.0f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
