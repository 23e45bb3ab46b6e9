"""The hybrid causal LM inside transformers: outputs, padding, packing, cache and generate, training
features, save/load, Auto classes."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForCausalLM

from kimi_hf import KimiHybridCache, KimiHybridForCausalLM, KimiHybridTextModel
from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid import KimiDeltaAttention, KimiHybridMLA, KimiHybridMoE

from .helpers import rel_err, tiny_config


def make_model(**overrides):
    torch.manual_seed(0)
    return KimiHybridForCausalLM(tiny_config(**overrides)).eval()


def ids(B, T, seed=0, vocab=97):
    return torch.randint(3, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def test_structure_and_auto_classes():
    cfg = tiny_config()
    model = AutoModelForCausalLM.from_config(cfg)
    assert isinstance(model, KimiHybridForCausalLM)
    assert isinstance(AutoModel.from_config(cfg), KimiHybridTextModel)
    kinds = [type(layer.self_attn) for layer in model.model.layers]
    assert kinds == [KimiDeltaAttention] * 3 + [KimiHybridMLA]
    assert not isinstance(model.model.layers[0].mlp, KimiHybridMoE) and isinstance(
        model.model.layers[1].mlp, KimiHybridMoE
    )


def test_init_weights_follow_the_spec():
    model = make_model()
    attn = model.model.layers[0].self_attn
    decay = attn.A_log.exp()
    assert decay.min() >= 1.0 - 1e-5 and decay.max() <= 16.0 + 1e-4
    dt = F.softplus(attn.dt_bias)
    assert dt.min() >= 1e-4 - 1e-7 and dt.max() <= 0.1 + 1e-6
    assert torch.equal(attn.o_norm.weight, torch.ones_like(attn.o_norm.weight))
    assert torch.count_nonzero(model.model.layers[1].mlp.gate.e_score_correction_bias) == 0


def test_loss_is_shifted_cross_entropy():
    model = make_model()
    x = ids(2, 20)
    out = model(x, labels=x)
    ref = F.cross_entropy(out.logits[:, :-1].reshape(-1, 97).float(), x[:, 1:].reshape(-1))
    assert out.logits.shape == (2, 20, 97)
    assert torch.allclose(out.loss, ref, atol=1e-5)


def test_left_padding_rows_equal_rows_alone():
    model = make_model()
    a, b = ids(1, 30, seed=1), ids(1, 18, seed=2)
    pad = torch.zeros(1, 12, dtype=torch.long)
    batch = torch.cat([a, torch.cat([pad, b], 1)])
    mask = torch.cat([torch.ones(1, 30), torch.cat([torch.zeros(1, 12), torch.ones(1, 18)], 1)]).long()
    with torch.no_grad():
        out = model(batch, attention_mask=mask).logits
        la, lb = model(a).logits, model(b).logits
    assert rel_err(out[0], la[0]) < 1e-5
    assert rel_err(out[1, 12:], lb[0]) < 1e-5


@pytest.mark.parametrize("batch", [1, 2])
def test_packed_documents_do_not_leak(batch):
    model = make_model()
    lens = [23, 70, 9]  # crosses a 64-token KDA chunk boundary
    docs = [ids(1, n, seed=10 + i) for i, n in enumerate(lens)]
    row = torch.cat(docs, 1)
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    with torch.no_grad():
        out = model(row.repeat(batch, 1), position_ids=pos.repeat(batch, 1)).logits
        alone = [model(d).logits for d in docs]
    start = 0
    for n, ref in zip(lens, alone):
        for b in range(batch):
            assert rel_err(out[b, start : start + n], ref[0]) < 1e-5
        start += n


def test_packed_training_loss_and_gradients_match_separate_documents():
    model = make_model().train()
    lens = [15, 40]
    docs = [ids(1, n, seed=20 + i) for i, n in enumerate(lens)]
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    packed_logits = model(torch.cat(docs, 1), position_ids=pos, use_cache=False).logits
    sep_logits = torch.cat([model(d, use_cache=False).logits for d in docs], 1)
    assert rel_err(packed_logits, sep_logits) < 1e-5
    g1 = torch.autograd.grad(packed_logits.square().sum(), model.model.layers[0].self_attn.q_proj.weight)[0]
    sep_logits = torch.cat([model(d, use_cache=False).logits for d in docs], 1)
    g2 = torch.autograd.grad(sep_logits.square().sum(), model.model.layers[0].self_attn.q_proj.weight)[0]
    assert rel_err(g1, g2) < 1e-4


def test_greedy_generation_equals_repeated_full_forwards():
    model = make_model()
    prompt = ids(2, 11, seed=3)
    with torch.no_grad():
        gen = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
        seq = prompt
        for _ in range(12):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(gen, seq)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_incremental_decoding_matches_full_forward_logits(attn):
    # steps of 1 and 9 tokens on a 30+ token cache take MLA's absorbed (latent-space) path
    model = make_model(attn_implementation=attn)
    x = ids(2, 40, seed=4)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        cache = KimiHybridCache(config=model.config)
        parts = [model(x[:, :30], past_key_values=cache, use_cache=True).logits]
        parts += [model(x[:, 30:31], past_key_values=cache, use_cache=True).logits]
        parts += [model(x[:, 31:40], past_key_values=cache, use_cache=True).logits]  # multi-token continuation
    assert rel_err(torch.cat(parts, 1), full) < 1e-5
    assert cache.get_seq_length() == 40
    kda_state = cache.layers[0].recurrent_states[0]
    assert kda_state.dtype == torch.float32 and kda_state.shape == (2, 2, 8, 8)


def test_left_padded_generation_matches_unpadded():
    model = make_model()
    a, b = ids(1, 9, seed=5), ids(1, 5, seed=6)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], 1)])
    mask = (batch != 0).long()
    mask[0] = 1
    with torch.no_grad():
        gen = model.generate(
            batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None
        )
        ga = model.generate(a, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
        gb = model.generate(b, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(gen[0, 9:], ga[0, 9:]) and torch.equal(gen[1, 9:], gb[0, 5:])


def test_sampling_and_beam_search_run():
    model = make_model()
    prompt = ids(2, 7, seed=7)
    with torch.no_grad():
        sampled = model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=0, eos_token_id=None)
        beams = model.generate(
            prompt, max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    assert sampled.shape == (2, 13) and beams.shape == (2, 13)
    # beam search reorders the cache (KDA states, MLA latents) as beams swap: the score of every returned beam must
    # equal the log-probability of its tokens under a fresh full forward (length_penalty 0: a plain sum)
    with torch.no_grad():
        out = model.generate(
            prompt,
            max_new_tokens=6,
            num_beams=4,
            num_return_sequences=3,
            do_sample=False,
            length_penalty=0.0,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
        seqs = out.sequences
        logp = model(seqs, use_cache=False).logits[:, 6:-1].log_softmax(-1).gather(-1, seqs[:, 7:, None])[..., 0]
    assert len({tuple(s.tolist()) for s in seqs}) == 6  # distinct beams
    assert torch.allclose(out.sequences_scores, logp.sum(-1), atol=1e-4)
    assert (out.sequences_scores.view(2, 3).diff(dim=1) <= 1e-6).all()  # best first


def test_eager_and_sdpa_agree():
    x = ids(2, 33, seed=8)
    with torch.no_grad():
        eager = make_model(attn_implementation="eager")
        sdpa = make_model(attn_implementation="sdpa")
        sdpa.load_state_dict(eager.state_dict())
        assert rel_err(sdpa(x).logits, eager(x).logits) < 1e-5
        out = eager(x, output_attentions=True)
    assert len(out.attentions) == 1 and out.attentions[0].shape == (2, 2, 33, 33)


def test_gradient_checkpointing_gives_the_same_gradients():
    x = ids(2, 24, seed=9)
    grads = []
    for checkpointing in (False, True):
        model = make_model().train()
        if checkpointing:
            model.activation_checkpointing_enable()
        model(x, labels=x, use_cache=False).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert rel_err(grads[1], grads[0]) < 1e-5


def test_all_parameters_receive_gradients():
    model = make_model().train()
    x = ids(2, 70, seed=11)
    model(x, labels=x, use_cache=False).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    # the router weight gets no gradient through top-k indices, only through the expert weights it scales
    assert missing == [], missing


def test_bf16_forward_is_finite_and_close():
    # default init (std 0.02): bf16 rounding through 4 layers costs ~1% of the logits (native: the same)
    model = make_model(initializer_range=0.02)
    x = ids(1, 50, seed=12)
    with torch.no_grad():
        ref = model(x).logits
        out = model.to(torch.bfloat16)(x).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert rel_err(out.float(), ref) < 2e-2
    assert model.model.layers[0].self_attn.A_log.dtype == torch.float32  # kept: the decays are fp32 by design


def test_router_logits_and_aux_loss():
    model = make_model()
    x = ids(2, 10, seed=13)
    out = model(x, labels=x, output_router_logits=True)
    assert len(out.router_logits) == 3 and out.router_logits[0].shape == (20, 4)
    assert out.aux_loss is not None and out.aux_loss > 0
    base = model(x, labels=x).loss
    # released Kimi models balance without an auxiliary loss: by default it is returned, not added
    assert model.config.router_aux_loss_coef == 0.0 and torch.equal(out.loss, base)
    model.config.router_aux_loss_coef = 0.01
    out = model(x, labels=x, output_router_logits=True)
    assert torch.allclose(out.loss, base + 0.01 * out.aux_loss, atol=1e-6) and not torch.equal(out.loss, base)


def test_save_and_reload_roundtrip(tmp_path):
    model = make_model()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = ids(1, 20, seed=14)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    assert loaded.model.layers[0].self_attn.A_log.dtype == torch.float32


def test_cache_memory_is_constant_for_kda_layers():
    model = make_model()
    with torch.no_grad():
        sizes = []
        for T in (16, 64):
            cache = KimiHybridCache(config=model.config)
            model(ids(1, T), past_key_values=cache, use_cache=True)
            sizes.append(cache.nbytes())
    cfg = model.config
    latent_per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4  # one MLA layer, fp32
    assert sizes[1] - sizes[0] == 48 * latent_per_token


def test_inputs_embeds_and_bad_arguments():
    model = make_model()
    x = ids(1, 6)
    with torch.no_grad():
        a = model(x).logits
        b = model(inputs_embeds=model.model.embed_tokens(x)).logits
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="input_ids"):
        model(x, inputs_embeds=model.model.embed_tokens(x))


def test_forward_backward_under_cpu_bf16_autocast():
    """Trainer / TRL with bf16=True on CPU run the model under autocast: KDA keeps its own precision."""
    model = KimiHybridForCausalLM(tiny_config())
    x = torch.randint(3, 60, (2, 40))
    with torch.no_grad():
        reference = model(x, labels=x).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, labels=x).loss
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - reference.item()) < 0.05 * reference.item()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("mixer", ["linear_attention", "full_attention"])
def test_models_of_one_layer_type_forward_train_and_generate(mixer):
    """Issue: an all-KDA model was accepted but a plain forward failed (`get_seq_length can only be called on
    Attention layers`); any mix of layer types must work, all-KDA and all-MLA included."""
    model = make_model(layer_types=[mixer] * 4)
    x = ids(2, 9, seed=5)
    model.train()
    model(x, labels=x).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.eval()
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        assert torch.allclose(model(x).logits, full, atol=1e-6)
        gen = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False, eos_token_id=None
        )
        seq = x
        for _ in range(6):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(gen, seq)


@pytest.mark.parametrize("attn_residual", ["none", "block"])
def test_disk_offload_forward_and_generate_match(tmp_path, attn_residual):
    """Issue: with accelerate's disk offload, KDA read `q_conv1d.weight` and absorbed MLA decoding read
    `kv_b_proj.weight` without calling those modules, so their offload hooks never loaded them ("Tensor on
    device meta"). A 21-token prompt makes decoding take the absorbed path (more than 16 cached tokens)."""
    model = make_model(attn_residual=attn_residual)
    model.save_pretrained(tmp_path / "m")
    x = ids(1, 21, seed=6)
    offloaded = KimiHybridForCausalLM.from_pretrained(
        tmp_path / "m", device_map="auto", max_memory={"cpu": "60KB"}, offload_folder=str(tmp_path / "offload")
    ).eval()
    assert {"cpu", "disk"} <= set(offloaded.hf_device_map.values()), offloaded.hf_device_map
    assert any(p.device.type == "meta" for p in offloaded.parameters())  # really offloaded
    with torch.no_grad():
        assert torch.allclose(offloaded(x).logits, model(x).logits, atol=1e-5)
        kwargs = dict(max_new_tokens=4, do_sample=False, eos_token_id=None)
        assert torch.equal(offloaded.generate(x, **kwargs), model.generate(x, **kwargs))


def test_torch_export_of_a_forward():
    """Issue: torch.export failed on data-dependent checks (KDA input validation, the MoE's bincount().tolist())."""
    model = make_model()
    x = ids(2, 9, seed=7)
    exported = torch.export.export(model, (x,), kwargs={"use_cache": False})
    with torch.no_grad():
        assert torch.allclose(
            exported.module()(x, use_cache=False).logits, model(x, use_cache=False).logits, atol=1e-5
        )


def test_aux_loss_counts_the_experts_the_router_chose():
    """Issue: the load-balancing loss re-selected the top-k without the correction bias (or group limits), so it
    counted experts the router did not choose. Reference: the routers' own outputs, caught with hooks."""
    model = make_model(n_group=2, topk_group=1)
    for layer in model.model.layers[1:]:  # a bias that overrides the scores: experts 2 and 3 always chosen
        layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 5.0]))
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: seen.append(o)) for layer in model.model.layers[1:]]
    x = ids(2, 10, seed=14)
    out = model(x, output_router_logits=True)
    for h in hooks:
        h.remove()
    E = 4
    f = torch.cat([F.one_hot(indices, E).sum(1).double() / 2 for _, _, indices in seen]).mean(0)
    p = torch.cat([(lg.double().sigmoid() / lg.double().sigmoid().sum(-1, keepdim=True)) for lg, _, _ in seen]).mean(0)
    assert f.tolist() == [0.0, 0.0, 0.5, 0.5]  # what the routers did
    assert torch.allclose(out.aux_loss.double(), E * (f * p).sum(), atol=1e-6)


def test_decays_gates_convs_and_router_stay_fp32_in_bf16(tmp_path):
    """Issue: from_pretrained(dtype=bf16) rounded A_log, dt_bias, the short convs, o_norm and the router bias to bf16."""
    make_model().save_pretrained(tmp_path)
    kept = (
        "A_log",
        "dt_bias",
        "q_conv1d.weight",
        "k_conv1d.weight",
        "v_conv1d.weight",
        "gate.weight",
        "e_score_correction_bias",
        "expert_load",  # the routers' token counts (expert balancing), not saved
        "o_norm.weight",  # Kimi K3's checkpoint stores it F32
    )
    for model in (
        KimiHybridForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16),
        make_model().to(torch.bfloat16),
    ):
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        fp32 = {n for n, t in tensors.items() if t.dtype == torch.float32}
        assert (
            fp32 == {n for n in tensors if n.endswith(kept)} and len(fp32) == 3 * 6 + 3 * 3
        )  # 3 KDA layers x 6, 3 routers x 3
        assert all(t.dtype == torch.bfloat16 for n, t in tensors.items() if n not in fp32 and t.is_floating_point())
        assert model(ids(1, 6)).logits.dtype == torch.bfloat16


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_static_cache_prefill_and_decode_match_the_hybrid_cache(attn):
    """Issue: a pre-allocated StaticCache (longer than 16) under sdpa gave wrong prefill logits (the absorbed MLA
    path masked the whole buffer, not the filled length)."""
    from transformers import StaticCache

    model = make_model(attn_implementation=attn)
    for T in (5, 12, 20):
        x = ids(2, T, seed=T)
        with torch.no_grad():
            static = StaticCache(config=model.config, max_cache_len=40)
            dynamic = KimiHybridCache(config=model.config)
            a, b = model(x, past_key_values=static).logits, model(x, past_key_values=dynamic).logits
            assert (a - b).abs().max() < 1e-5, (T, (a - b).abs().max())
            nxt = b[:, -1:].argmax(-1)
            a, b = model(nxt, past_key_values=static).logits, model(nxt, past_key_values=dynamic).logits
            assert (a - b).abs().max() < 1e-5


@pytest.mark.parametrize("multimodal", [False, True])
def test_generate_with_a_static_cache(multimodal):
    """Issue: generate(cache_implementation="static") crashed: generate passes {layer_type: mask}."""
    from kimi_hf import KimiHybridForConditionalGeneration

    from .helpers import tiny_multimodal_config

    torch.manual_seed(0)
    model = (KimiHybridForConditionalGeneration(tiny_multimodal_config()) if multimodal else make_model()).eval()
    x = ids(2, 20, seed=15)
    kwargs = dict(attention_mask=torch.ones_like(x), max_new_tokens=5, do_sample=False, eos_token_id=None)
    assert torch.equal(model.generate(x, cache_implementation="static", **kwargs), model.generate(x, **kwargs))


def test_forward_annotations_are_real_types():
    """Issue: `from __future__ import annotations` made them strings, which transformers introspects."""
    import inspect

    from kimi_hf import KimiHybridForConditionalGeneration, KimiHybridModel, KimiHybridVisionModel

    for cls in (
        KimiHybridTextModel,
        KimiHybridForCausalLM,
        KimiHybridModel,
        KimiHybridForConditionalGeneration,
        KimiHybridVisionModel,
    ):
        sig = inspect.signature(cls.forward)
        assert not isinstance(sig.return_annotation, str), cls
        assert not any(isinstance(p.annotation, str) for p in sig.parameters.values()), cls


def test_experts_implementations_match(tmp_path):
    """transformers' experts interface: eager (our loop), batched_mm and grouped_mm (the default) agree, forward and
    backward; from_pretrained(experts_implementation=...) picks one."""
    make_model().save_pretrained(tmp_path)
    x = ids(2, 17, seed=16)
    results = {}
    for impl in ("eager", "batched_mm", "grouped_mm"):
        model = KimiHybridForCausalLM.from_pretrained(tmp_path, experts_implementation=impl)
        assert model.config._experts_implementation == impl
        out = model(x, labels=x)
        out.loss.backward()
        experts = model.model.layers[1].mlp.experts
        results[impl] = (out.logits.detach(), experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone())
    for impl in ("batched_mm", "grouped_mm"):
        for got, want in zip(results[impl], results["eager"]):
            assert rel_err(got, want) < 1e-5, impl
    assert KimiHybridForCausalLM(tiny_config()).config._experts_implementation == "grouped_mm"


def test_moe_block_compiles_fullgraph_without_host_syncs():
    """The routed experts (grouped_mm) and the router run in one graph: no .tolist() / bincount on the host."""
    model = make_model()
    moe = model.model.layers[1].mlp
    x = torch.randn(2, 9, 32)
    compiled = torch.compile(moe, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert torch.allclose(compiled(x), moe(x), atol=1e-6)
