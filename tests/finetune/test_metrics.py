"""kimi_hf.finetune.metrics: rank 0's JSON lines on stdout (nothing else), TensorBoard event files that TensorBoard's
own reader reads back, and nothing from the other ranks."""

from __future__ import annotations

import json

import pytest


def test_json_lines_and_tensorboard_scalars(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from kimi_hf.finetune.metrics import Metrics

    metrics = Metrics(rank=0, steps=2, log_dir=str(tmp_path / "runs"))
    metrics.step(0, 2.5, 1e-3, 0.75)
    metrics.step(1, 2.25, 5e-4)
    metrics.eval(1, 2.4)
    metrics.close()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines == [{"step": 0, "loss": 2.5}, {"step": 1, "loss": 2.25}, {"step": 1, "eval_loss": 2.4}]
    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    scalars = {tag: [(e.step, round(e.value, 6)) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars == {
        "train/loss": [(0, 2.5), (1, 2.25)],
        "train/learning_rate": [(0, 0.001), (1, 0.0005)],
        "train/grad_norm": [(0, 0.75)],
        "eval/loss": [(1, 2.4)],
    }


def test_other_ranks_report_nothing(tmp_path, capsys):
    from kimi_hf.finetune.metrics import Metrics

    metrics = Metrics(rank=1, steps=2, log_dir=str(tmp_path / "runs"))
    metrics.step(0, 2.5, 1e-3)
    metrics.eval(0, 2.4)
    metrics.close()
    out = capsys.readouterr()
    assert out.out == "" and out.err == "" and not (tmp_path / "runs").exists()


def test_a_log_dir_without_tensorboard_is_refused_naming_the_flag(monkeypatch):
    import builtins

    from kimi_hf.finetune.metrics import check_tensorboard

    real = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard") or name.startswith("tensorboard"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ValueError, match="--log-dir runs: TensorBoard event files need the tensorboard package"):
        check_tensorboard("runs")
