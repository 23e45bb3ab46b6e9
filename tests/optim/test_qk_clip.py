"""QK-Clip: per-head max-logit records (exact with eager, LSE bound with sdpa) and the MLA rescaling."""

import math

import pytest
import torch

from kimi_hf import KimiHybridForCausalLM
from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid import KimiHybridMLA
from kimi_hf.optim import MuonClip, QKClip
from kimi_hf.optim.qk_clip import attention_max_logits

from ..models.kimi_hybrid.helpers import tiny_config


def mla_logits(mla: KimiHybridMLA, h: torch.Tensor) -> torch.Tensor:
    """Pre-softmax logits [B, H, T, T] (causal entries only are meaningful)."""
    B, T, _ = h.shape
    latent, k_rope = mla.kv_a_proj_with_mqa(h).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
    key, _ = mla.expand_latent(mla.kv_a_layernorm(latent).view(B, 1, T, -1), k_rope.view(B, 1, T, -1))
    return mla.project_query(h) @ key.transpose(-1, -2) * mla.scaling


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_apply_qk_clip_scales_each_head_by_gamma(q_lora_rank):
    torch.manual_seed(0)
    mla = KimiHybridForCausalLM(tiny_config(q_lora_rank=q_lora_rank)).model.layers[3].self_attn
    h = torch.randn(2, 9, 32)
    with torch.no_grad():
        before = mla_logits(mla, h)
        rope_key = mla.kv_a_proj_with_mqa.weight[-mla.qk_rope_head_dim :].clone()
        v_rows = mla.kv_b_proj.weight.view(2, 16, -1)[:, 8:].clone()
        mla.apply_qk_clip(torch.tensor([0.25, 1.0]))
        after = mla_logits(mla, h)
    assert torch.allclose(after[:, 0], 0.25 * before[:, 0], atol=1e-5)
    assert torch.allclose(after[:, 1], before[:, 1], atol=1e-6)  # innocent head untouched
    assert torch.equal(mla.kv_a_proj_with_mqa.weight[-mla.qk_rope_head_dim :], rope_key)  # shared rope key
    assert torch.equal(mla.kv_b_proj.weight.view(2, 16, -1)[:, 8:], v_rows)  # values


def recorded_max(model, x):
    clip = QKClip(model, tau=1e9)
    model.train()
    model(x, use_cache=False)
    return clip._maxima[id(model.model.layers[3].self_attn)]


def test_records_exact_with_eager_and_a_tight_upper_bound_with_sdpa():
    torch.manual_seed(0)
    eager = KimiHybridForCausalLM(tiny_config(attn_implementation="eager"))
    sdpa = KimiHybridForCausalLM(tiny_config(attn_implementation="sdpa"))
    sdpa.load_state_dict(eager.state_dict())
    x = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    exact = recorded_max(eager, x)
    # the reference: materialised logits of the MLA layer's input
    mla = eager.model.layers[3].self_attn
    hidden = {}

    def grab(module, args, kwargs):
        hidden["h"] = args[0] if args else kwargs["hidden_states"]

    handle = mla.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        eager(x, use_cache=False)
    handle.remove()
    logits = mla_logits(mla, hidden["h"]).masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(exact, logits.amax(dim=(0, 2, 3)), atol=1e-5)
    bound = recorded_max(sdpa, x)
    assert (bound >= exact - 1e-5).all() and (bound <= exact + math.log(40) + 1e-5).all()


def test_clip_brings_heads_above_tau_down_to_tau():
    torch.manual_seed(0)
    model = KimiHybridForCausalLM(tiny_config(attn_implementation="eager"))
    x = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(2))
    before = recorded_max(model, x)
    tau = (before.max() * 0.7).item()  # above the smaller head only if heads differ enough
    opt = MuonClip.from_model(model, lr=0.0, weight_decay=0.0, qk_clip_tau=tau)  # lr 0: only the clip moves weights
    model.train()
    model(x, labels=x, use_cache=False).loss.backward()
    opt.step()
    over = before > tau
    assert opt.qk_clip.last_clipped_heads == int(over.sum()) > 0
    assert opt.qk_clip.last_max_logit == pytest.approx(before.max().item(), rel=1e-5)
    after = recorded_max(model, x)
    assert torch.allclose(after[over], torch.full_like(after[over], tau), rtol=1e-4)
    assert torch.allclose(after[~over], before[~over], rtol=1e-5)


def test_only_mla_layers_are_clipped_in_the_hybrid_model():
    model = KimiHybridForCausalLM(tiny_config())
    clip = QKClip(model)
    assert clip.modules == [model.model.layers[3].self_attn]
    # the one recording wrapper, standing in for the implementation the model had
    assert model.config._attn_implementation == "kimi_hf_qk_clip_sdpa"
    assert clip.modules[0]._qk_clip_inner_attention == "sdpa"


def test_no_record_outside_training_and_no_clip_without_records():
    model = KimiHybridForCausalLM(tiny_config()).eval()
    clip = QKClip(model, tau=1e-3)
    with torch.no_grad():
        model(torch.randint(3, 97, (1, 10)))
    assert clip._maxima == {}
    assert clip.clip() == 0 and clip.last_max_logit is None


def test_attention_max_logits_respects_masks():
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    s = q @ k.transpose(-1, -2)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    expect = s.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))
    assert torch.allclose(attention_max_logits(q, k, None, 1.0), expect)
    assert torch.allclose(attention_max_logits(q, k, causal[None, None], 1.0), expect)
    additive = torch.zeros(5, 5).masked_fill(~causal, float("-inf"))[None, None]
    assert torch.allclose(attention_max_logits(q, k, additive, 1.0), expect)
    with pytest.raises(ValueError, match="qk_clip_tau"):
        QKClip(torch.nn.Linear(2, 2), tau=0)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_generic_q_k_attention_of_another_model(kv_heads, impl):
    """A transformers Llama (RoPE, GQA or not): records post-rotary max logits (exact with eager, the log-sum-exp
    bound with sdpa on CPU), clips head h by gamma_h = tau / record_h."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def llama(attn_implementation):
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            attn_implementation=attn_implementation,
        )
        return LlamaForCausalLM(cfg).train()

    def exact_max(state):  # an eager twin: the wrapper's exact record (attention_max_logits, tested above)
        twin = llama("eager")
        twin.load_state_dict(state)
        clip = QKClip(twin, tau=1e9)
        with torch.no_grad():
            twin(x)
        return clip._maxima[id(twin.model.layers[0].self_attn)]

    model = llama(impl)
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(x).logits
    clip = QKClip(model, tau=1e9)
    attn = model.model.layers[0].self_attn
    assert clip.modules == [model.model.layers[0].self_attn, model.model.layers[1].self_attn]
    with torch.no_grad():
        assert torch.allclose(model(x).logits, ref, atol=1e-6)  # the wrapper changes nothing
    before = clip._maxima[id(attn)].clone()
    exact = exact_max(model.state_dict())
    if impl == "eager":
        torch.testing.assert_close(before, exact)
    else:  # max <= lse <= max + log(keys), the row with the most keys bounding it
        assert (exact <= before + 1e-5).all() and (before <= exact + math.log(12) + 1e-5).all()
    clip.tau = float(before.min()) * 0.5
    clip.clip()  # every head of every layer is over tau: each scaled by tau / its record
    torch.testing.assert_close(exact_max(model.state_dict()), exact * clip.tau / before, rtol=1e-4, atol=1e-5)
