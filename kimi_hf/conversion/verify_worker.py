"""Run by kimi_hf.conversion.kimi_linear.verify in a fresh process:

    python -m kimi_hf.conversion.verify_worker SRC DST LAYERS

Loads both checkpoints with their own classes (transformers' KimiLinearForCausalLM for the native
naming, ours otherwise), truncated to the first LAYERS decoder layers (0: all; extended to the first
MLA layer), and prints
{"rel_max_diff": ...} for the logits of random tokens. fla is hidden on CPU: transformers' native
kimi_linear would pick its Triton kernels there and fail.
"""

import json
import sys

import torch


if not torch.cuda.is_available():
    sys.modules["fla"] = None


def _first_full_attention(cfg: dict) -> int | None:
    """1-based index of the first MLA layer in either config spelling."""
    if cfg.get("layer_types"):
        return next((i + 1 for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"), None)
    full = (cfg.get("linear_attn_config") or {}).get("full_attn_layers")
    return min(full) if full else None


def truncated(cfg: dict, layers: int) -> dict:
    """The config of the first `layers` decoder layers, extended to the first MLA layer (a cache
    without any attention layer cannot count tokens, in transformers' kimi_linear as in ours)."""
    n = cfg["num_hidden_layers"]
    layers = max(layers, _first_full_attention(cfg) or 0) if layers else 0
    if not layers or layers >= n:
        return cfg
    cfg = dict(cfg, num_hidden_layers=layers)
    for key in ("layer_types", "mlp_layer_types"):
        if cfg.get(key):
            cfg[key] = cfg[key][:layers]
    if cfg.get("linear_attn_config"):
        lac = dict(cfg["linear_attn_config"])
        for key in ("kda_layers", "full_attn_layers"):
            if key in lac:
                lac[key] = [i for i in lac[key] if i <= layers]
        cfg["linear_attn_config"] = lac
    return cfg


def load(path: str, layers: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    import kimi_hf  # noqa: F401  (registers our classes)

    with open(f"{path}/config.json") as f:
        cfg = truncated(json.load(f), layers)
    config_cls = type(AutoConfig.for_model(cfg["model_type"]))
    config = config_cls(
        **{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "transformers_version")}
    )
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval(), config


def main():
    src, dst, layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    a, config = load(src, layers)
    b, _ = load(dst, layers)
    ids = torch.randint(3, config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    print(
        json.dumps(
            {
                "rel_max_diff": ((la - lb).abs().max() / la.abs().max().clamp_min(1e-30)).item(),
                "layers": config.num_hidden_layers,
            }
        )
    )


if __name__ == "__main__":
    main()
