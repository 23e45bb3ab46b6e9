"""Training Kimi K3 (tiny, fp32, CPU): QK-Clip on K3's MLA (q LoRA), MuonClip inside transformers' Trainer on text
and image batches, gradient checkpointing with Block Attention Residuals, PEFT LoRA (train and merge), and a
gradient for every parameter of the model on a text + image batch."""

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import Trainer

from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid import KimiDeltaAttention, KimiHybridMLA
from kimi_hf.models.kimi_k3.configuration_kimi_k3 import KimiK3Config
from kimi_hf.models.kimi_k3.modeling_kimi_k3 import K3_LORA_TARGET_MODULES, KimiK3ForConditionalGeneration
from kimi_hf.optim import MuonClip, MuonClipCallback

from ...optim.trainer_helpers import args as training_args
from ..kimi_hybrid.helpers import tiny_tokenizer
from .release_format import tiny_k3_config


# the package's recommended list (kimi_hf.models.kimi_k3.modeling_kimi_k3.K3_LORA_TARGET_MODULES)
K3_LORA_TARGETS = K3_LORA_TARGET_MODULES

CONFIG = tiny_k3_config()
VOCAB = CONFIG["text_config"]["vocab_size"]
MEDIA = CONFIG["media_placeholder_token_id"]
PATCH = CONFIG["vision_config"]["patch_size"]


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


def k3_model(seed=0, **config_kwargs) -> KimiK3ForConditionalGeneration:
    """A tiny K3 in fp32 (a config built from the released dict says bfloat16 for the text backbone), no cache."""
    torch.manual_seed(seed)
    config = KimiK3Config(**tiny_k3_config(), **config_kwargs)
    config.text_config.use_cache = False
    return KimiK3ForConditionalGeneration(config).float().train()


def text_batch(B=2, T=24, seed=1) -> dict:
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))
    ids = ids.masked_fill(ids == MEDIA, 5)
    return {"input_ids": ids, "labels": ids.clone()}


def image_batch(seed=2) -> dict:
    """Two images (4 x 6 and 4 x 4 patches: 6 and 4 merged 2 x 2 groups), one per row, with one
    media_placeholder_token_id per merged group, text around them; labels ignore the placeholders."""
    grid = torch.tensor([[1, 4, 6], [1, 4, 4]])
    gen = torch.Generator().manual_seed(seed)
    pixel_values = torch.randn(int(grid.prod(-1).sum()), 3, PATCH, PATCH, generator=gen)
    groups = (grid[:, 1:].prod(-1) // 4).tolist()
    rows = []
    for n, before in zip(groups, (3, 5)):
        text = torch.randint(6, VOCAB, (20 - n,), generator=gen)
        text = text.masked_fill(text == MEDIA, 7)
        rows.append(torch.cat([text[:before], torch.full((n,), MEDIA), text[before:]]))
    ids = torch.stack(rows)
    return {
        "input_ids": ids,
        "labels": ids.masked_fill(ids == MEDIA, -100),
        "pixel_values": pixel_values,
        "image_grid_thw": grid,
    }


def mixed_batch() -> dict:
    """The image rows and two text rows in one batch: every component of the model runs."""
    img, txt = image_batch(), text_batch(B=2, T=20)
    out = dict(img)
    out["input_ids"] = torch.cat([img["input_ids"], txt["input_ids"]])
    out["labels"] = torch.cat([img["labels"], txt["labels"]])
    return out


def mla_max_logits(mla: KimiHybridMLA, h: torch.Tensor) -> torch.Tensor:
    """Independent per-head max over the batch of the causal pre-softmax logits [H] of K3's MLA (q LoRA, no
    positional rotation) on its input h [B, T, hidden]."""
    B, T, _ = h.shape
    with torch.no_grad():
        latent, k_rope = mla.kv_a_proj_with_mqa(h).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        key, _ = mla.expand_latent(mla.kv_a_layernorm(latent).view(B, 1, T, -1), k_rope.view(B, 1, T, -1))
        logits = mla.project_query(h) @ key.transpose(-1, -2) * mla.scaling
        logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return logits.amax(dim=(0, 2, 3))


def test_qk_clip_on_k3_mla_with_q_lora():
    model = k3_model(attn_implementation="eager")
    text = model.model.language_model
    mlas = [layer.self_attn for layer in text.layers if layer.layer_type == "full_attention"]
    assert len(mlas) == 3 and all(m.q_lora_rank for m in mlas)
    opt = MuonClip.from_model(model, lr=0.0, weight_decay=0.0, qk_clip_tau=1e9)  # lr 0: only the clip moves weights
    clip = opt.qk_clip
    # the MLA layers only: not KDA (q, k L2-normalised: qk_clip_exempt), not the ViT (fused qkv_proj)
    assert clip.modules == mlas
    assert not any(isinstance(m, KimiDeltaAttention) for m in clip.modules)
    assert model.config.text_config._attn_implementation == "kimi_hf_qk_clip_eager"

    inputs = {}
    hooks = [
        m.register_forward_pre_hook(lambda mod, args: inputs.__setitem__(mod, args[0].detach().clone())) for m in mlas
    ]
    model(**text_batch(T=32)).loss.backward()
    for h in hooks:
        h.remove()
    before = torch.stack([clip._maxima[id(m)].clone() for m in mlas])  # [layers, heads]
    # eager: the record is exact
    torch.testing.assert_close(before, torch.stack([mla_max_logits(m, inputs[m]) for m in mlas]), rtol=0, atol=1e-5)

    flat = before.flatten().sort().values
    tau = ((flat[2] + flat[3]) / 2).item()  # three heads above, three below
    clip.tau = tau
    saved = {
        (i, name): getattr(m, name).weight.detach().clone()
        for i, m in enumerate(mlas)
        for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "q_a_layernorm", "kv_a_layernorm")
    }
    opt.step()
    over = before > tau
    assert clip.last_clipped_heads == int(over.sum()) == 3
    assert clip.last_max_logit == pytest.approx(before.max().item(), rel=1e-6)
    after = torch.stack([mla_max_logits(m, inputs[m]) for m in mlas])
    torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=1e-5, atol=0)
    torch.testing.assert_close(after[~over], before[~over], rtol=0, atol=1e-6)

    for i, m in enumerate(mlas):
        gamma = torch.where(over[i], tau / before[i], torch.ones_like(before[i]))[:, None, None]
        H, nope, rope, v = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        q_old, q_new = saved[i, "q_b_proj"].view(H, nope + rope, -1), m.q_b_proj.weight.view(H, nope + rope, -1)
        torch.testing.assert_close(q_new[:, :nope], q_old[:, :nope] * gamma.sqrt(), rtol=1e-6, atol=0)
        torch.testing.assert_close(q_new[:, nope:], q_old[:, nope:] * gamma, rtol=1e-6, atol=0)
        kv_old, kv_new = saved[i, "kv_b_proj"].view(H, nope + v, -1), m.kv_b_proj.weight.view(H, nope + v, -1)
        torch.testing.assert_close(kv_new[:, :nope], kv_old[:, :nope] * gamma.sqrt(), rtol=1e-6, atol=0)
        assert torch.equal(kv_new[:, nope:], kv_old[:, nope:])  # values
        # q_a_proj, the shared latent and rope key (kv_a_proj_with_mqa), the latent norms: bit for bit
        for name in ("q_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "kv_a_layernorm"):
            assert torch.equal(getattr(m, name).weight, saved[i, name]), (i, name)


class _Batches(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return i


class _AlternatingCollator:
    """Text batch, image batch, text batch, ...: the same two batches again and again."""

    def __init__(self):
        self.batches, self.calls = [text_batch(B=2, T=24), image_batch()], 0

    def __call__(self, features):
        batch = self.batches[self.calls % 2]
        self.calls += 1
        return {k: v.clone() for k, v in batch.items()}


def test_trainer_with_muonclip_on_text_and_image_batches(tmp_path):
    # eager: exact max-logit records (the tiny model's are ~0.06 at init; sdpa on CPU records the log-sum-exp
    # bound, ~log(T) here, and a tau below it would clip every head at every step)
    model = k3_model(attn_implementation="eager")
    opt = MuonClip.from_model(model, lr=1e-2, qk_clip_tau=0.065)
    trainer = Trainer(
        model=model,
        args=training_args(
            tmp_path,
            max_steps=8,
            per_device_train_batch_size=1,
            logging_steps=1,
            remove_unused_columns=False,
            dataloader_num_workers=0,
            seed=0,
        ),
        train_dataset=_Batches(),
        data_collator=_AlternatingCollator(),
        optimizers=(opt, None),
        callbacks=[MuonClipCallback()],
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 8
    losses = [h["loss"] for h in logs]
    assert all(math.isfinite(x) for x in losses)
    text_losses, image_losses = losses[0::2], losses[1::2]
    assert text_losses[-1] < text_losses[0] and image_losses[-1] < image_losses[0], losses
    # the callback ran at every step: QK-Clip's max logit and clip counts in every log
    assert all("qk_max_logit" in h and "qk_clipped_heads" in h for h in logs)
    assert sum(h["qk_clipped_heads"] for h in logs) == opt.qk_clip.total_clipped_heads > 0
    assert opt.qk_clip.total_clipped_heads < 6 * len(logs)  # some heads, not all of them at every step
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _enable_checkpointing(model, use_reentrant):
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant):
    model = k3_model()
    batch = mixed_batch()
    grads = []
    for checkpointing in (False, True):
        model.zero_grad(set_to_none=True)
        if checkpointing:
            _enable_checkpointing(model, use_reentrant)
            assert all(layer.gradient_checkpointing for layer in model.model.language_model.layers)
            assert all(layer.gradient_checkpointing for layer in model.model.vision_tower.layers)
        model(**batch).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() == {n for n, _ in model.named_parameters()}
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-5, msg=name)


def test_torch_checkpoint_wrapper_around_the_layers_gives_the_same_gradients():
    """torch's apply_activation_checkpointing (what accelerate's fsdp_activation_checkpointing applies) wraps each
    decoder layer in a CheckpointWrapper; with Attention Residuals the decoder used to refuse such layers as if they
    were a pipeline stage's placeholders."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid import KimiHybridDecoderLayer

    model = k3_model()
    batch = text_batch()
    model(**batch).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, KimiHybridDecoderLayer))
    assert all(hasattr(layer, "_checkpoint_wrapped_module") for layer in model.model.language_model.layers)
    model(**batch).loss.backward()
    wrapped = {
        n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters() if p.grad is not None
    }
    assert wrapped.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(wrapped[name], plain[name], rtol=0, atol=1e-6, msg=name)


def _lora_train(model, batch, steps=4):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("targets", ["all-linear", "k3"])
def test_lora_trains_and_merges_back(targets):
    model = k3_model()
    target_modules = K3_LORA_TARGETS if targets == "k3" else "all-linear"
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, task_type="CAUSAL_LM")
    )
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    adapted = {n.split(".lora_A")[0].removeprefix("base_model.model.") for n in trainable if ".lora_A." in n}
    kinds = {n.rsplit(".", 1)[-1] for n in adapted}
    expected = {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "routed_expert_down_proj",
        "routed_expert_up_proj",
    }
    if targets == "k3":
        assert kinds == expected  # every recommended target exists in K3, nothing else is adapted
        assert not any(n.startswith(("model.vision_tower", "model.mm_projector")) for n in adapted)
    else:  # also the gates, the ViT and the projector; never the head nor the router (not nn.Linear)
        assert expected | {"g_proj", "f_a_proj", "f_b_proj", "b_proj", "qkv_proj", "proj", "fc1", "fc2"} <= kinds
        assert "lm_head" not in kinds and "gate" not in kinds
        assert any(n.startswith("model.mm_projector.proj.") for n in adapted)
    batch = mixed_batch()
    losses = _lora_train(peft_model.train(), batch)
    assert losses[-1] < losses[0], losses

    peft_model.eval()
    with torch.no_grad():
        tuned = peft_model(**batch).logits
        merged = peft_model.merge_and_unload()
        assert isinstance(merged, KimiK3ForConditionalGeneration)
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(**batch).logits, tuned, rtol=0, atol=1e-5)


# Parameters whose gradient is zero by construction, with the reason.
DEAD_BY_CONSTRUCTION = {
    # layer 0's attention-side depth attention mixes one source (the embedding: no partial sum yet): its softmax
    # weight is 1 whatever the pseudo-query and key norm, so both get an exactly zero gradient
    "model.language_model.layers.0.attn_res.query": "one depth source at layer 0",
    "model.language_model.layers.0.attn_res.key_norm.weight": "one depth source at layer 0",
}


def test_every_parameter_gets_a_finite_nonzero_gradient_on_text_and_image():
    model = k3_model()
    model(**mixed_batch()).loss.backward()
    params = dict(model.named_parameters())
    assert DEAD_BY_CONSTRUCTION.keys() <= params.keys()
    missing = [n for n, p in params.items() if p.grad is None and n not in DEAD_BY_CONSTRUCTION]
    assert not missing, missing
    not_finite = [n for n, p in params.items() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not not_finite, not_finite
    zero = {n for n, p in params.items() if p.grad is not None and not p.grad.any()}
    assert zero == {n for n in DEAD_BY_CONSTRUCTION if params[n].grad is not None}, zero
    for name in DEAD_BY_CONSTRUCTION:
        assert params[name].grad is None or not params[name].grad.any(), name
    # every routed expert of every MoE layer was chosen by some token of the batch
    for i, layer in enumerate(model.model.language_model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if isinstance(experts, nn.Module):
            used = experts.gate_up_proj.grad.flatten(1).any(1) & experts.down_proj.grad.flatten(1).any(1)
            assert used.all(), (i, used)


def test_trl_sft_on_k3_optimises_the_released_objective(tmp_path):
    """K3 balances its experts by the router's bias (noaux_tc), and its released config declares no auxiliary-loss
    coefficient: TRL's SFTTrainer, which reads the config's `router_aux_loss_coef`, must add no load-balancing loss
    (it added 0.001 x aux when the config defaulted to 0.001), so the two trainers optimise the same objective."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    released = KimiK3Config(**tiny_k3_config())
    assert "router_aux_loss_coef" not in tiny_k3_config()["text_config"]
    assert released.text_config.router_aux_loss_coef == 0.0
    model = k3_model()
    rows = [{"input_ids": torch.randint(1, VOCAB, (12,)).tolist()} for _ in range(4)]  # pre-tokenized
    args = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True
    )
    tokenizer = tiny_tokenizer.__wrapped__()  # pads with id 0; the rows are already token ids
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    assert trainer.aux_loss_enabled is False and model.config.text_config.output_router_logits is False
