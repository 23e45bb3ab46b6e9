"""Hybrid model benchmark on CPU: kimi_hf's KimiHybridForCausalLM against transformers' native
KimiLinearForCausalLM (its torch fallbacks: fla is hidden, it cannot run on CPU) on the same tiny
config, plus the cache size against an all-MLA model of the same size.

    python benchmarks/model.py            # forward at T = 512, 2048, 8192; decode; cache
    python benchmarks/model.py --quick    # T = 512, 2048 and fewer steps

Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.modules.setdefault("fla", None)  # native kimi_linear would pick fla's Triton kernels and fail on CPU

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from transformers.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from common import timed  # noqa: E402
from kimi_hf import KimiHybridCache, KimiHybridForCausalLM, KimiHybridTextConfig  # noqa: E402

SIZE = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    num_experts_per_tok=2, n_shared_experts=1, linear_num_heads=4, linear_head_dim=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
    layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3,
)
EXPERTS = 8


def models():
    torch.manual_seed(0)
    ours = KimiHybridForCausalLM(KimiHybridTextConfig(**SIZE, num_experts=EXPERTS)).eval()
    torch.manual_seed(0)
    native = KimiLinearForCausalLM(KimiLinearConfig(**SIZE, num_local_experts=EXPERTS, num_key_value_heads=4)).eval()
    return ours, native


@torch.no_grad()
def decode_tokens_per_s(model, prompt_len, new_tokens):
    x = torch.randint(3, SIZE["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(0))
    out = model(x, use_cache=True)
    cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        out = model(tok, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
    return new_tokens / (time.perf_counter() - t0)


@torch.no_grad()
def cache_bytes(model, T):
    cache = KimiHybridCache(config=model.config)
    x = torch.randint(3, SIZE["vocab_size"], (1, T), generator=torch.Generator().manual_seed(0))
    model(x, past_key_values=cache, use_cache=True)
    return cache.nbytes()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.T, args.repeats, args.decode_tokens = [512, 2048], 2, 32
    torch.set_flush_denormal(True)
    ours, native = models()
    n_params = sum(p.numel() for p in ours.parameters())
    print(f"# hybrid model on CPU: torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, "
          f"{n_params / 1e6:.1f}M params (3 KDA + 1 MLA layers, {EXPERTS} experts top-2), B=1")

    print("\n## forward (no cache)")
    print("| T | ours ms | native ms | speed-up |")
    print("|---|---|---|---|")
    for T in args.T:
        x = torch.randint(3, SIZE["vocab_size"], (1, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            t_ours = timed(lambda: ours(x, use_cache=False), args.repeats)
            t_nat = timed(lambda: native(x, use_cache=False), 1 if T > 2048 else args.repeats)
        print(f"| {T} | {t_ours * 1e3:.1f} | {t_nat * 1e3:.1f} | {t_nat / t_ours:.1f}x |", flush=True)

    print(f"\n## decode (greedy, B=1, {args.decode_tokens} new tokens after the prompt)")
    print("| prompt | ours tokens/s | native tokens/s | ratio |")
    print("|---|---|---|---|")
    for prompt in (128, max(args.T)):
        tps_ours = decode_tokens_per_s(ours, prompt, args.decode_tokens)
        tps_nat = decode_tokens_per_s(native, prompt, args.decode_tokens)
        print(f"| {prompt} | {tps_ours:.0f} | {tps_nat:.0f} | {tps_ours / tps_nat:.2f}x |", flush=True)

    print("\n## cache after T tokens (fp32) vs an all-MLA model of the same size")
    mla = KimiHybridForCausalLM(KimiHybridTextConfig(**{**SIZE, "layer_types": ["full_attention"] * 4}, num_experts=EXPERTS)).eval()
    print("| T | hybrid bytes/token | all-MLA bytes/token | ratio |")
    print("|---|---|---|---|")
    for T in args.T:
        a, b = cache_bytes(ours, T), cache_bytes(mla, T)
        print(f"| {T} | {a / T:.0f} | {b / T:.0f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
