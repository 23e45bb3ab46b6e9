"""Test-session setup.

transformers' native kimi_linear picks fla's Triton kernels when fla is importable and then crashes
on CPU ("0 active drivers"); tests that run the native model as a reference need its torch path, so
fla is hidden from this test session before anything imports transformers' model code. kimi_hf itself
never imports fla.
"""

import sys

import pytest
import torch

sys.modules.setdefault("fla", None)  # `import fla` now raises ImportError

torch.set_flush_denormal(True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
