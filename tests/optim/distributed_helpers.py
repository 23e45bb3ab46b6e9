"""What the distributed tests and their worker scripts (ddp_worker, fsdp2_worker, accelerate_worker) share: the
models they train, the batches, the step count and QK-Clip's threshold."""

import torch

from kimi_hf import KimiHybridForCausalLM

from ..models.kimi_hybrid.helpers import tiny_config


STEPS = 3


def config():
    return tiny_config(attn_implementation="eager")


def build(arch: str):
    """The model trained by the FSDP2 test: the tiny hybrid, or a tiny Kimi K3 (safe-gate KDA, gated MLA with q
    LoRA, SiTU LatentMoE, K3 Block AttnRes, the K3 vision tower) trained on text."""
    if arch == "hybrid":
        return KimiHybridForCausalLM(config())
    from kimi_hf import KimiK3ForConditionalGeneration
    from kimi_hf.presets import small_k3_config

    cfg = small_k3_config(64, 4, vocab_size=100, media_token_id=99, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return KimiK3ForConditionalGeneration._from_config(cfg, attn_implementation="eager")


def qk_clip_tau(arch: str) -> float:
    """Low enough that some head is clipped in STEPS steps (K3's q LoRA with its latent norm starts with smaller
    logits than the tiny hybrid's)."""
    return 0.5 if arch == "hybrid" else 0.05


def decoder_layers(model):
    return model.model.language_model.layers if hasattr(model.model, "language_model") else model.model.layers


def batch(step):
    return torch.randint(3, 97, (4, 24), generator=torch.Generator().manual_seed(100 + step))
