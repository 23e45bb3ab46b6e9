"""Every converter's `--verify`: SRC and the converted folder loaded in float32 in a fresh process, their logits compared.

`compare_logits` runs `python -m kimi_hf.conversion.verify SRC DST LAYERS ROUND_TO` (a fresh process: nothing of the
converter's state leaks in) and returns what it measured; each converter then applies its tolerance (kimi-linear:
transformers' implementation against ours, relative; k3: the same class on both sides, nearly exact).

- Which layers (`verify_layer_count`, `truncated_config`), the one rule: LAYERS 0, or at least the model's, loads
  the whole model; else its first LAYERS decoder layers, extended to the first MLA (full-attention) layer, since a
  cache without an attention layer cannot count tokens (in transformers' kimi_linear as in ours). The config's
  text part (K3's text_config, a Kimi Linear config itself) is cut: num_hidden_layers, the layer_types /
  mlp_layer_types lists, linear_attn_config's 1-based kda_layers / full_attn_layers.
- Which classes: each folder's own (KimiK3ForConditionalGeneration for kimi_k3, else AutoModelForCausalLM:
  transformers' KimiLinearForCausalLM for Moonshot's naming, ours for kimi_hybrid_text). fla is hidden on CPU:
  transformers' native kimi_linear would pick its Triton kernels there and fail.
- Which input: VERIFY_TOKENS text tokens (seed 0) drawn from [3, vocab) without the image placeholder (ids 0..2
  are the special tokens of the Kimi Linear configs; image tokens need image features).
- ROUND_TO ("none" or a dtype): SRC's floating tensors are first rounded to it, but those its format keeps in
  float32 (`fp32`): what a conversion to that --dtype did to SRC, so that both models hold the same values.
- A whole-model load of DST must find every tensor and no other (missing / unexpected tensors raise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


VERIFY_TOKENS = 48


def _text_config(config: dict) -> dict:
    """The decoder's part of a config dict: K3's text_config, or a Kimi Linear config itself."""
    return config.get("text_config") or config


def _first_full_attention(text: dict) -> int | None:
    """1-based index of the first MLA layer, from layer_types or linear_attn_config.full_attn_layers."""
    if text.get("layer_types"):
        return next((i + 1 for i, t in enumerate(text["layer_types"]) if t == "full_attention"), None)
    full = (text.get("linear_attn_config") or {}).get("full_attn_layers")
    return min(full) if full else None


def verify_layer_count(config: dict, layers: int) -> int:
    """The decoder layers --verify loads for a config dict (see the module's docstring for the rule)."""
    n = _text_config(config)["num_hidden_layers"]
    if not layers or layers >= n:
        return n
    return min(n, max(layers, _first_full_attention(_text_config(config)) or 0))


def truncated_config(config: dict, layers: int) -> dict:
    """A copy of a config dict cut to its first `verify_layer_count(config, layers)` decoder layers."""
    config = json.loads(json.dumps(config))  # a deep copy
    text = _text_config(config)
    n = verify_layer_count(config, layers)
    if n == text["num_hidden_layers"]:
        return config
    text["num_hidden_layers"] = n
    for key in ("layer_types", "mlp_layer_types"):
        if text.get(key):
            text[key] = text[key][:n]
    lac = text.get("linear_attn_config")
    if lac:
        for key in ("kda_layers", "full_attn_layers"):
            if key in lac:
                lac[key] = [i for i in lac[key] if i <= n]
    return config


def compare_logits(src: str, dst: str, layers: int = 0, round_to: str | None = None) -> dict:
    """Runs the worker on src and dst (their first `layers` layers; 0: all; round_to: see the module's docstring).
    Returns {"max_abs_diff", "max_abs_logit", "rel_max_diff", "layers", "tokens", "round_to"}. Raises
    RuntimeError when the models could not be loaded and run, ValueError when a whole-model load of dst misses
    tensors or finds unexpected ones."""
    cmd = [sys.executable, "-m", __name__, src, dst, str(layers), round_to or "none"]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        tail = " ".join(out.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"--verify could not load and run the models: {tail}")
    result = json.loads(lines[-1])
    missing, unexpected = result.pop("dst_missing"), result.pop("dst_unexpected")
    if missing or unexpected:
        raise ValueError(
            f"the converted folder loads with missing tensors {missing[:3]} or unexpected ones {unexpected[:3]}"
        )
    return result


def _load(path: str, layers: int):
    """(model in float32, eval mode; its config; whole-model loading info or None when truncated) of a folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import kimi_hf

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        full = json.load(f)
    cfg = truncated_config(full, layers)
    config_cls = type(AutoConfig.for_model(cfg["model_type"]))
    skip = ("model_type", "architectures", "auto_map", "transformers_version")
    config = config_cls(**{k: v for k, v in cfg.items() if k not in skip})
    kwargs = dict(config=config, dtype=torch.float32, output_loading_info=True)
    if cfg["model_type"] == "kimi_k3":  # the experts dequantised as the converted folder holds them: one code path
        model_cls, kwargs["experts_format"] = kimi_hf.KimiK3ForConditionalGeneration, "dense"
    else:
        model_cls = AutoModelForCausalLM
    model, info = model_cls.from_pretrained(path, **kwargs)
    whole = _text_config(cfg)["num_hidden_layers"] == _text_config(full)["num_hidden_layers"]
    return model.eval(), config, info if whole else None


def _round(model, dtype_name: str, model_type: str) -> None:
    """Rounds the model's floating tensors to dtype_name in place, but those its format keeps in float32."""
    import torch

    from .fp32 import k3_fp32, keeps_fp32, kimi_linear_fp32

    dtype, kept = getattr(torch, dtype_name), k3_fp32() if model_type == "kimi_k3" else kimi_linear_fp32()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point() and not keeps_fp32(name, kept):
                t.copy_(t.to(dtype))


def _logits(model, config):
    """The logits of the fixed input (see the module's docstring)."""
    import torch

    vocab = config.get_text_config().vocab_size
    allowed = torch.arange(3, vocab)
    image = getattr(config, "image_token_id", None)
    if image is not None:
        allowed = allowed[allowed != image]
    pick = torch.randint(0, len(allowed), (1, VERIFY_TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=allowed[pick], use_cache=False).logits


def _worker(src: str, dst: str, layers: int, round_to: str) -> None:
    """Prints the comparison as one JSON line: SRC's model is freed before DST's loads (one copy in memory)."""
    import torch

    if not torch.cuda.is_available():
        sys.modules["fla"] = None
    a, config, _ = _load(src, layers)
    if round_to != "none":
        _round(a, round_to, config.model_type)
    la = _logits(a, config)
    del a
    b, _, info = _load(dst, layers)
    lb = _logits(b, config)
    peak = la.abs().max().item()
    diff = (la - lb).abs().max().item()
    result = {
        "max_abs_diff": diff,
        "max_abs_logit": peak,
        "rel_max_diff": diff / max(peak, 1e-30),
        "layers": config.get_text_config().num_hidden_layers,
        "tokens": VERIFY_TOKENS,
        "round_to": None if round_to == "none" else round_to,
        "dst_missing": sorted(info["missing_keys"]) if info else [],
        "dst_unexpected": sorted(info["unexpected_keys"]) if info else [],
    }
    print(json.dumps(result))


__all__ = ["VERIFY_TOKENS", "compare_logits", "truncated_config", "verify_layer_count"]


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(f"usage: {sys.executable} -m {__spec__.name} SRC DST LAYERS ROUND_TO|none")
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
