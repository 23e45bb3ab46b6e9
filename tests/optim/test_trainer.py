"""MuonClip inside transformers' Trainer: both ways of passing it, QK-Clip stats in the logs."""

import torch
from transformers import Trainer

from kimi_hf import KimiHybridForCausalLM
from kimi_hf.optim import MuonClip, MuonClipCallback

from ..models.kimi_hybrid.helpers import tiny_config
from .trainer_helpers import args, dataset


def test_trainer_with_optimizers_tuple_logs_qk_clip(tmp_path):
    torch.manual_seed(0)
    model = KimiHybridForCausalLM(tiny_config(use_cache=False))
    opt = MuonClip.from_model(model, lr=1e-2, qk_clip_tau=0.5)
    trainer = Trainer(
        model=model,
        args=args(tmp_path),
        train_dataset=dataset(),
        optimizers=(opt, None),
        callbacks=[MuonClipCallback()],
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    assert all("qk_max_logit" in h and "qk_clipped_heads" in h for h in logs)
    assert sum(h["qk_clipped_heads"] for h in logs) == opt.qk_clip.total_clipped_heads > 0
    assert logs[-1]["loss"] < logs[0]["loss"]


def test_trainer_with_optimizer_cls_and_kwargs_splits_by_role(tmp_path):
    torch.manual_seed(0)
    model = KimiHybridForCausalLM(tiny_config(use_cache=False))
    kwargs = {"model": model, "lr": 1e-2, "weight_decay": 0.1, "qk_clip_tau": 100.0}
    trainer = Trainer(
        model=model, args=args(tmp_path), train_dataset=dataset(), optimizer_cls_and_kwargs=(MuonClip, kwargs)
    )
    trainer.train()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(opt, MuonClip)
    muon = [g for g in opt.param_groups if g["use_muon"]]
    assert muon and any(p is model.model.layers[0].self_attn.q_proj.weight for g in muon for p in g["params"])
    # vectors (norms, biases, A_log, dt_bias) get no weight decay
    assert {g["weight_decay"] for g in opt.param_groups} == {0.0, 0.1}
    # QK-Clip ran at the last step over every attention module's heads; tau = 100 is far above a tiny model's logits
    qk = opt.qk_clip
    assert qk is not None and len(qk.last_head_max) == len(qk.modules) > 0
    assert qk.last_max_logit == max(heads.max().item() for heads in qk.last_head_max)
    assert 0 < qk.last_max_logit < qk.tau == 100.0 and qk.total_clipped_heads == 0
