"""Smoke tests: every example runs on CPU at a small size and checks its own result."""

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kda_prefill_decode(capsys):
    worst = load("kda_prefill_decode").main(["--lengths", "70", "5", "130", "--decode", "3", "--heads", "2", "--head-dim", "16"])
    assert worst <= 1e-4
    assert "decode continues prefill" in capsys.readouterr().out
