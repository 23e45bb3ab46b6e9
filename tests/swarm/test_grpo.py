"""ParlRewards inside TRL's GRPOTrainer: a real (tiny) GRPO run; the lambdas anneal through trainer_state."""

import pytest

from kimi_hf.swarm import ParlRewards, Trace

from .test_backends import tiny_chat_model
from .test_rewards import trace


def test_grpo_trainer_logs_annealed_parl_rewards(tmp_path, monkeypatch):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tok = tiny_chat_model()
    tok.padding_side = "left"
    # every row carries a recorded episode (a JSONL trace of 4 parallel runs that answered "A"); playing
    # completions through a rollout is covered in test_rewards (an untrained model calls no tools)
    path = tmp_path / "wide.jsonl"
    recorded = Trace(path)
    for e in trace([4]):
        recorded.add(**e)
    rows = [{"prompt": "collect the items", "solution": "A", "swarm_trace": str(path)}] * 8
    parl = ParlRewards(
        perf_fn=lambda answer, solution: float(answer == solution), lambda1=0.4, lambda2=0.2, anneal_fraction=1.0
    )
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-4,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=parl.reward_funcs,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "rewards/r_parallel/mean" in h]
    assert len(logs) == 2
    # r_parallel = r_finish = 1 before the lambdas; lambda(t) = lambda * (1 - global_step / max_steps)
    for log, factor in zip(logs, (1.0, 0.5)):
        assert float(log["rewards/r_parallel/mean"]) == pytest.approx(0.4 * factor, abs=1e-6)
        assert float(log["rewards/r_finish/mean"]) == pytest.approx(0.2 * factor, abs=1e-6)
        assert float(log["rewards/r_perf/mean"]) == 1.0
