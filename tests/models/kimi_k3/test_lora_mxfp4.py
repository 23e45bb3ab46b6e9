"""PEFT LoRA over Kimi K3's routed experts kept in MXFP4 (QLoRA-style: the experts frozen bytes, the adapters on
attention, MLA's q LoRA chain, shared experts and the LatentMoE bridges, K3_LORA_TARGET_MODULES), through
transformers' Trainer with gradient checkpointing, MuonClip or AdamW: the same losses as LoRA over the dequantised
model (same data, same seed), the adapter saved and reloaded with PEFT, merged, and the merged model exported."""

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from transformers import Trainer

from kimi_hf import KimiK3ForConditionalGeneration
from kimi_hf.models.kimi_k3.modeling_kimi_k3 import K3_LORA_TARGET_MODULES
from kimi_hf.optim import MuonClip

from ...optim.trainer_helpers import args as training_args
from ...optim.trainer_helpers import dataset
from ..kimi_hybrid.test_tensor_parallel import ROOT, free_port
from .release_format import tiny_k3_config, write_k3_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("k3_lora_mxfp4")
    write_k3_checkpoint(out, tiny_k3_config(), seed=5, mxfp4=True, shards=2, dtype="float32")
    return str(out)


def lora_model(folder, experts_format):
    base = KimiK3ForConditionalGeneration.from_pretrained(folder, experts_format=experts_format)
    base.config.text_config.use_cache = False
    torch.manual_seed(0)  # the same adapter initialisation for both formats
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=K3_LORA_TARGET_MODULES, task_type="CAUSAL_LM"
    )
    return get_peft_model(base, config)


def train(model, tmp_path, optimizer):
    # one batch, seen at every step (losses comparable from step to step); checkpointed layers recompute the experts
    kwargs = dict(max_steps=4, per_device_train_batch_size=2, logging_steps=1, seed=0, activation_checkpointing=True)
    optimizers = (None, None)
    if optimizer == "muonclip":
        optimizers = (MuonClip.from_model(model, lr=2e-2, qk_clip_tau=None), None)
    else:
        kwargs.update(learning_rate=2e-3, optim="adamw_torch")
    trainer = Trainer(
        model=model, args=training_args(tmp_path, **kwargs), train_dataset=dataset(n=2), optimizers=optimizers
    )
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("optimizer", ["muonclip", "adamw"])
def test_lora_over_resident_experts_matches_lora_over_dense_experts(folder, tmp_path, optimizer):
    resident, dense = lora_model(folder, "mxfp4"), lora_model(folder, "dense")
    trainable = [n for n, p in resident.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert [n for n, p in dense.named_parameters() if p.requires_grad] == trainable
    assert any("routed_expert_down_proj.lora_A" in n for n in trainable)
    losses_r = train(resident, tmp_path / "r", optimizer)
    losses_d = train(dense, tmp_path / "d", optimizer)
    assert len(losses_r) == 4 and losses_r[-1] < losses_r[0], losses_r
    assert max(abs(a - b) for a, b in zip(losses_r, losses_d)) <= 1e-5, (losses_r, losses_d)
    # the adapters trained alike (the frozen experts pass the same input gradients)
    ra, da = dict(resident.named_parameters()), dict(dense.named_parameters())
    for n in trainable:
        torch.testing.assert_close(ra[n], da[n], rtol=0, atol=1e-4)


def test_adapter_saves_reloads_and_merges(folder, tmp_path):
    model = lora_model(folder, "mxfp4")
    train(model, tmp_path / "run", "adamw")
    model.eval()
    ids = torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        tuned = model(ids).logits
    model.save_pretrained(tmp_path / "adapter")
    files = os.listdir(tmp_path / "adapter")
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        assert all("lora_" in k for k in f.keys())  # the adapter only: no expert byte
    base = KimiK3ForConditionalGeneration.from_pretrained(folder)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, tuned, rtol=0, atol=1e-6)
        merged = reloaded.merge_and_unload()
        assert isinstance(merged, KimiK3ForConditionalGeneration) and merged.experts_format == "mxfp4"
        # x (W + s B A) vs x W + s (x A) B: fp32 rounding, through 6 layers (observed 5e-5 on logits of ~5)
        torch.testing.assert_close(merged(ids).logits, tuned, rtol=0, atol=2e-4)
    # exported: the experts' bytes as released, the merged projections dense; a dense copy on request
    merged.save_pretrained(tmp_path / "merged")
    merged.save_pretrained(tmp_path / "merged_dense", saved_experts="dense")
    for path, fmt in ((tmp_path / "merged", "mxfp4"), (tmp_path / "merged_dense", "dense")):
        names = [k for p in glob.glob(str(path / "*.safetensors")) for k in safe_open(p, "pt").keys()]
        assert any(k.endswith("w1.weight_packed") for k in names) == (fmt == "mxfp4")
        again = KimiK3ForConditionalGeneration.from_pretrained(path)
        assert again.experts_format == fmt
        with torch.no_grad():
            # the same bytes: bitwise; dense experts run transformers' grouped_mm (another summation order)
            atol = 0 if fmt == "mxfp4" else 2e-5
            torch.testing.assert_close(again(ids).logits, merged(ids).logits, rtol=0, atol=atol)


FSDP2_WORKER = Path(__file__).with_name("fsdp2_lora_worker.py")


def test_lora_over_resident_experts_on_fsdp2_matches_one_process(folder, tmp_path):
    """torchrun, 2 gloo ranks: FSDP2 shards the experts' bytes by expert (dim 0) like every parameter; the losses and
    the trained adapters equal one process on the whole batch (observed: 1.7e-5 on the third loss, 6e-5 on adapters
    of up to 0.2, from the order of the gradient sums)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    out = subprocess.run(
        [*cmd, str(FSDP2_WORKER), folder, str(tmp_path / "two.pt")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    one = subprocess.run(
        [sys.executable, str(FSDP2_WORKER), folder, str(tmp_path / "one.pt")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert one.returncode == 0, one.stderr[-4000:]
    two, ref = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")
    assert two["local_experts"][0] * 2 == ref["local_experts"][0]  # half of the experts' bytes per rank
    assert ref["losses"][-1] < ref["losses"][0]
    assert max(abs(a - b) for a, b in zip(two["losses"], ref["losses"])) < 5e-5, (two["losses"], ref["losses"])
    assert two["adapters"].keys() == ref["adapters"].keys()
    for name, value in ref["adapters"].items():
        torch.testing.assert_close(two["adapters"][name], value, rtol=0, atol=2e-4)
