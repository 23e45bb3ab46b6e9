"""FSDP2 warns when a wrapped module returns a view tensor (an in-place op on it would skip the pre-backward hook):
Kimi's decoder layers return none. With Block Attention Residuals a layer that completes no depth block used to
hand its input blocks back, which FSDP2 had turned into a view of the input (and which before the first block is
the embedding's [None] view): it now returns None for them, and the caller keeps its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.launch import ROOT, free_port


VIEW_WARNING = "returned a view tensor"


@pytest.fixture(scope="module")
def k3_folder(tmp_path_factory) -> Path:
    from tests.models.kimi_k3.release_format import tiny_k3_config, write_k3_checkpoint

    folder = tmp_path_factory.mktemp("k3_release")
    write_k3_checkpoint(folder, tiny_k3_config(), seed=0, mxfp4=True, shards=3, dtype="float32")
    return folder


def test_decoder_layers_return_no_views_and_not_their_input_blocks():
    from kimi_hf import KimiK3ForConditionalGeneration
    from kimi_hf.presets import small_k3_config

    config = small_k3_config(64, 4, vocab_size=100, media_token_id=99, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = KimiK3ForConditionalGeneration(config).train()
    layers = model.model.language_model.layers
    seen = []

    def check(layer, args, output):
        partial, blocks = output
        assert partial._base is None, layer.layer_idx
        assert blocks is None or (blocks._base is None and blocks is not args[1]), layer.layer_idx
        seen.append(blocks is None)

    for layer in layers:
        layer.register_forward_hook(check)
    x = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=x, labels=x, use_cache=False).loss.backward()
    assert len(seen) == len(layers) and any(seen) and not all(seen)  # some layers complete a block, some do not


def test_fsdp2_lora_step_prints_no_view_warning(k3_folder):
    """examples/k3_finetune.py, LoRA on FSDP2 over 2 gloo ranks (one decoder layer a unit): no view warning."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += [str(ROOT / "examples" / "k3_finetune.py"), "--model", str(k3_folder), "--lora", "--fsdp", "2"]
    cmd += ["--steps", "1", "--data", "random", "--seq-len", "32"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    assert '"step": 0' in out.stdout
    assert VIEW_WARNING not in out.stdout + out.stderr
