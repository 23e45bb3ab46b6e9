"""Test-session setup.

TRITON_INTERPRET=1: kimi_hf_kernels' Triton kernels are tested on CPU through the interpreter.

transformers' native kimi_linear picks fla's Triton kernels when fla is importable and then crashes
on CPU ("0 active drivers"); tests that run the native model as a reference need its torch path, so
fla is hidden from this test session before anything imports transformers' model code. kimi_hf itself
never imports fla.
"""

import os
import sys


# Triton kernels run on CPU tensors under the interpreter (set before triton is imported); the
# dispatcher still sends CPU tensors to the PyTorch path unless backend="triton" is forced.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


sys.modules.setdefault("fla", None)  # `import fla` now raises ImportError

torch.set_flush_denormal(True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
