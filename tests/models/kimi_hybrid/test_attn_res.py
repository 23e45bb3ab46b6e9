"""Block Attention Residuals (config attn_residual): equivalence with the residual sum at zero
pseudo-queries, the depth sources each sublayer sees, gradients to the queries, and the model
features it must keep: cache + generate, packed documents, gradient checkpointing, save/load, PEFT,
MuonClip (queries in the AdamW part)."""

import pytest
import torch

from kimi_hf import KimiHybridForCausalLM
from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid import KimiHybridDepthAttention

from .helpers import rel_err, tiny_config


def model(mode="block", block_size=2, seed=0, random_queries=True, **kw):
    torch.manual_seed(seed)
    m = KimiHybridForCausalLM(tiny_config(attn_residual=mode, attn_residual_block_size=block_size, **kw)).eval()
    if random_queries:
        with torch.no_grad():
            for mod in m.modules():
                if isinstance(mod, KimiHybridDepthAttention):
                    mod.query.normal_(0, 1.0)
    return m


def ids(B, T, seed=0):
    return torch.randint(3, 97, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(attn_residual="blocks"), "attn_residual must be one of"),
        (dict(attn_residual="block", attn_residual_block_size=0), "attn_residual_block_size"),
        (dict(attn_residual="full", attn_residual_block_size=3), "one sublayer per block"),
    ],
)
def test_invalid_settings_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**bad)


@pytest.mark.parametrize("mode,block_size", [("block", 2), ("block", 3), ("full", None), ("block", 64)])
def test_zero_queries_with_baseline_weights_equal_the_residual_sum(mode, block_size):
    """Uniform depth weights give (sum of sources) / n, and every consumer normalises its input
    (scale-invariant RMSNorm): the same logits as the standard residual, up to the norms' eps."""
    torch.manual_seed(0)
    base = KimiHybridForCausalLM(tiny_config(rms_norm_eps=1e-12)).eval()
    ar = KimiHybridForCausalLM(
        tiny_config(rms_norm_eps=1e-12, attn_residual=mode, attn_residual_block_size=block_size)
    ).eval()
    missing, unexpected = ar.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(".query" in k or ".key_norm." in k for k in missing)
    x = ids(2, 40)
    with torch.no_grad():
        assert rel_err(ar(x).logits, base(x).logits) < 1e-5


@pytest.mark.parametrize("block_size", [1, 2, 3, 100])
def test_each_sublayer_sees_embedding_completed_blocks_and_partial_sum(block_size):
    """Sublayer s attends over 1 + s // bs + (s % bs > 0) sources; bs >= L (one block) leaves the
    embedding and the running sum: the standard residual plus the embedding source."""
    m = model("block", block_size)
    seen = []
    count = lambda mod, inp, out: seen.append(inp[0].shape[0] + (len(inp) > 1 and inp[1] is not None))  # noqa: E731
    hooks = [mod.register_forward_hook(count) for layer in m.model.layers for mod in (layer.attn_res, layer.mlp_res)]
    hooks.append(m.model.final_res.register_forward_hook(count))
    with torch.no_grad():
        m(ids(1, 12))
    for h in hooks:
        h.remove()
    L = 2 * len(m.model.layers)
    expect = [1 + s // block_size + (s % block_size > 0) for s in range(L + 1)]
    assert seen == expect
    if block_size >= L:
        assert max(seen[1:]) == 2


def test_gradients_reach_queries_and_key_norms():
    m = model().train()
    m(ids(2, 20), labels=ids(2, 20)).loss.backward()
    for mod in [m.model.final_res] + [layer.mlp_res for layer in m.model.layers]:
        assert mod.query.grad.abs().sum() > 0 and mod.key_norm.weight.grad.abs().sum() > 0


def test_cached_generation_equals_full_forwards_and_packed_documents_do_not_leak():
    m = model("block", 3)
    x = ids(1, 20, seed=1)
    out = m.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    seq = x
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, m(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(out, seq)
        docs = [ids(1, n, seed=5 + n) for n in (23, 70)]
        pos = torch.cat([torch.arange(d.shape[1]) for d in docs]).unsqueeze(0)
        packed = m(torch.cat(docs, 1), position_ids=pos).logits
        assert rel_err(packed[:, :23], m(docs[0]).logits) < 1e-4 and rel_err(packed[:, 23:], m(docs[1]).logits) < 1e-4


def test_gradient_checkpointing_save_load_peft_and_muonclip(tmp_path):
    from peft import LoraConfig, get_peft_model

    from kimi_hf.optim import MuonClip

    m = model("block", 2).train()
    x = ids(2, 16)
    grads = []
    for ckpt in (False, True):
        m.zero_grad()
        if ckpt:
            m.activation_checkpointing_enable()
        m(x, labels=x, use_cache=False).loss.backward()
        grads.append(
            torch.cat([m.model.layers[1].mlp_res.query.grad, m.model.layers[0].self_attn.q_proj.weight.grad.flatten()])
        )
    assert rel_err(grads[1], grads[0]) < 1e-5
    m.activation_checkpointing_disable()
    m.eval().save_pretrained(tmp_path)
    loaded = KimiHybridForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.attn_residual == "block" and loaded.config.attn_residual_block_size == 2
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, m(x).logits)
    opt = MuonClip.from_model(m, lr=1e-2)
    muon = {id(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    assert all(id(mod.query) not in muon for mod in m.modules() if isinstance(mod, KimiHybridDepthAttention))
    lora = get_peft_model(m, LoraConfig(r=4, target_modules="all-linear"))
    lora(x, labels=x).loss.backward()  # LoRA trains on top; the depth attention is unaffected by the adapters
