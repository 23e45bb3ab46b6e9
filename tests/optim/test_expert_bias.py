"""Auxiliary-loss-free expert balancing: the routers count exactly the experts they chose (once, also under
gradient checkpointing), the bias moves by the rate against the load (the DeepSeek-V3 rule, written out here),
repeated updates even out a skewed router, and the Trainer callback runs it, logs it and saves the bias."""

import pytest
import torch
from transformers import Trainer

from kimi_hf import KimiHybridForCausalLM
from kimi_hf.optim import ExpertBiasCallback, MuonClip, track_expert_load, update_expert_bias
from kimi_hf.optim.expert_bias import expert_routers

from ..models.kimi_hybrid.helpers import tiny_config
from .trainer_helpers import args, dataset


def batch(seed=0):
    return torch.randint(3, 97, (4, 24), generator=torch.Generator().manual_seed(seed))


def chosen_counts(model, x):
    """An independent count: the experts each router chooses for the hidden states its layer receives."""
    routers = expert_routers(model)
    seen = []
    hooks = [r.register_forward_hook(lambda m, inp, out: seen.append(out[2].reshape(-1))) for r in routers]
    try:
        with torch.no_grad():
            model(x, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [torch.bincount(i, minlength=r.num_experts).float() for i, r in zip(seen, routers)]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_routers_count_the_experts_they_chose_once(checkpointing):
    torch.manual_seed(0)
    model = KimiHybridForCausalLM(tiny_config(use_cache=False)).train()
    x = batch()
    expected = chosen_counts(model, x)  # tracking off: nothing counted
    routers = track_expert_load(model)
    assert routers and all(r.expert_load.sum() == 0 for r in routers)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model(x, labels=x, use_cache=False).loss.backward()  # the recompute in the backward is not counted
    for router, want in zip(routers, expected):
        assert torch.equal(router.expert_load, want)
        assert router.expert_load.sum() == x.numel() * router.top_k
    model.eval()
    with torch.no_grad():
        model(x, use_cache=False)  # evaluation is not counted
    assert all(torch.equal(r.expert_load, w) for r, w in zip(routers, expected))
    assert not any("expert_load" in key for key in model.state_dict())  # not saved


def test_update_moves_the_bias_against_the_load_and_clears_the_counts():
    torch.manual_seed(0)
    model = KimiHybridForCausalLM(tiny_config(use_cache=False))
    routers = track_expert_load(model)
    first = routers[0]
    E = first.num_experts
    load = torch.arange(E, dtype=torch.float32) * 2  # expert 0 idle ... expert E-1 busiest
    first.expert_load.copy_(load)
    before = first.e_score_correction_bias.clone()
    stats = update_expert_bias(model, update_rate=0.01)
    mean = load.mean()
    want = before + 0.01 * torch.where(load < mean, 1.0, torch.where(load > mean, -1.0, 0.0))
    assert torch.equal(first.e_score_correction_bias, want)
    assert stats["routers"] == 1 and stats["expert_load_imbalance"] == pytest.approx((load.max() / mean).item())
    assert all(r.expert_load.sum() == 0 for r in routers)
    with pytest.raises(ValueError, match="update_rate"):
        update_expert_bias(model, update_rate=-1)


def test_repeated_updates_even_out_a_skewed_router():
    def imbalances(skew: float, rate: float) -> list[float]:
        torch.manual_seed(0)
        model = KimiHybridForCausalLM(tiny_config(use_cache=False)).train()
        with torch.no_grad():
            for router in expert_routers(model):  # skew 1: experts 0 .. k-1 win every token (scores lie in (0, 1))
                router.e_score_correction_bias[: router.top_k] = skew
        track_expert_load(model)
        out = []
        with torch.no_grad():  # the bias alone changes: the weights stay as they are
            for step in range(40):
                model(batch(step), use_cache=False)
                out.append(update_expert_bias(model, update_rate=rate)["expert_load_imbalance"])
        return out

    skewed, natural = imbalances(1.0, 0.05), imbalances(0.0, 0.0)  # natural: the same router, unskewed, no updates
    E, k = 4, 2
    assert tiny_config().num_experts == E and tiny_config().num_experts_per_tok == k
    assert skewed[:5] == [pytest.approx(E / k)] * 5  # all tokens on k of the E experts
    late = sum(skewed[-20:]) / 20
    assert late < 0.7 * E / k and late < 1.15 * sum(natural) / len(natural), (skewed, natural)


def test_trainer_callback_updates_logs_and_saves_the_bias(tmp_path):
    torch.manual_seed(0)
    model = KimiHybridForCausalLM(tiny_config(use_cache=False))
    opt = MuonClip.from_model(model, lr=1e-2)
    trainer = Trainer(
        model=model,
        args=args(tmp_path, gradient_accumulation_steps=2),
        train_dataset=dataset(32),
        optimizers=(opt, None),
        callbacks=[ExpertBiasCallback(update_rate=1e-3)],
    )
    trainer.train()
    routers = expert_routers(model)
    # 6 optimizer steps of +-1e-3 (0 where an expert sits exactly at the mean)
    for router in routers:
        bias = router.e_score_correction_bias
        assert bias.abs().max() <= 6e-3 + 1e-9 and bias.abs().sum() > 0
        assert not router.track_load and router.expert_load.sum() == 0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(h["expert_load_imbalance"] >= 1.0 for h in logs)
    trainer.save_model(str(tmp_path / "saved"))
    again = KimiHybridForCausalLM.from_pretrained(str(tmp_path / "saved"))
    for a, b in zip(expert_routers(again), routers):
        assert torch.equal(a.e_score_correction_bias, b.e_score_correction_bias)
    with pytest.raises(ValueError, match="update_rate"):
        ExpertBiasCallback(update_rate="fast")
