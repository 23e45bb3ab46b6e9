"""PEFT LoRA on tensor-parallel models (docs/parallelism.md), on CPU.

One `torchrun --nproc_per_node 2` run (gloo, tp_lora_worker.py) loads a tiny Kimi Linear folder and a tiny K3 folder
in the released layout with `from_pretrained(path, tp_plan="auto")` (K3 also with `DistributedConfig(tp_size=2,
ep_size=2)`), wraps them with `peft.get_peft_model` on `kimi_hf.lora_target_modules(config)` (and "all-linear"), B
not zero, and the test compares the logits, the loss and every LoRA gradient with the same model in this process.
What it guards (PEFT 0.21, transformers 5.25): PEFT shards adapters of "colwise" / "rowwise" layers only, so

    colwise  q/k/v, q_b, kv_b, gate/up, KDA's gates      right as PEFT does it
    rowwise  o_proj, down_proj                           right with check_lora_layer's in_features (without it the
                                                         first forward with gradients fails on a shape)
    none     q_a, kv_a_proj_with_mqa, latent-MoE bridges right: kv_a_proj_with_mqa's rope-gradient sum is on
                                                         kv_a_output, which sees the adapter's output too
    other    e.g. mla_kv_a_proj on kv_a_proj_with_mqa    refused at get_peft_model, naming module and style (the
                                                         adapter's gradients were partial, different per rank)

About 30 s on 2 cores.
"""

import os
import re
import subprocess
import sys

import pytest
import torch
from peft import get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM

from kimi_hf import KimiHybridForCausalLM, KimiK3Config, KimiK3ForConditionalGeneration, lora_target_modules
from kimi_hf.models.kimi_hybrid.parallel_kimi_hybrid import LORA_TP_STYLES

from ..kimi_k3.release_format import write_k3_checkpoint
from ..kimi_k3.test_tensor_parallel_k3 import k3_tp_config
from .helpers import tiny_config
from .test_tensor_parallel import HEADS, ROOT, free_port
from .tp_lora_worker import lora_compute, lora_config, set_lora_weights


WORKER = ROOT / "tests" / "models" / "kimi_hybrid" / "tp_lora_worker.py"
# fp32; observed max |diff| (logits / LoRA gradients): hybrid 2.7e-6 / 9.2e-7, K3 1.9e-5 / 7.6e-6. The partial
# rope-key gradients of the old kv_a rule differed by 1.3e-3 (hybrid) to 4.4e-2 (K3).
ATOL = {"hybrid": 1e-5, "k3": 1e-4}
# (case, layout, targets): compared with one process
MATCHING = [
    ("hybrid", "tp", "recommended"),
    ("hybrid", "tp", "all-linear"),
    ("k3", "tp", "recommended"),
    ("k3", "ep", "recommended"),
]
REFUSED = ("hybrid", "tp-old-kv-a", "kv_a_proj_with_mqa")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(case, layout, targets): [rank 0, rank 1] results, (case, targets): the single-process reference}."""
    root = tmp_path_factory.mktemp("tp_lora")
    torch.manual_seed(0)
    # 3 KDA + 1 MLA layers (q_proj, no q LoRA), a dense layer and MoE layers with a shared expert
    KimiHybridForCausalLM(tiny_config(linear_num_heads=HEADS, num_attention_heads=HEADS)).save_pretrained(
        root / "hybrid"
    )
    # K3: q LoRA, output gates, latent MoE, the vision tower
    write_k3_checkpoint(root / "k3", k3_tp_config(), seed=0, mxfp4=True, shards=2, dtype="float32")
    ids = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    for case in ("hybrid", "k3"):
        torch.save({"ids": ids}, root / case / "inputs.pt")
    specs = [f"{root / case}:{layout}:{targets}" for case, layout, targets in (*MATCHING, REFUSED)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    out = subprocess.run(
        [*cmd, str(WORKER), str(root), *specs], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    results = {}
    for case, layout, targets in (*MATCHING, REFUSED):
        results[case, layout, targets] = [
            torch.load(root / f"{case}-{layout}-{targets}-rank{rank}.pt", weights_only=False) for rank in (0, 1)
        ]
    for case, targets in {(case, targets) for case, _, targets in MATCHING}:
        model = AutoModelForCausalLM.from_pretrained(root / case, dtype=torch.float32)
        model = get_peft_model(model, lora_config(model, targets))
        set_lora_weights(model)
        results[case, targets] = lora_compute(model, ids)
    return results


@pytest.mark.parametrize(("case", "layout", "targets"), MATCHING)
def test_lora_matches_one_process(runs, case, layout, targets):
    """Logits (without gradients and in training), loss and every LoRA factor's gradient equal one process's, on
    both ranks, with no PEFT warning about a TP plan it cannot follow."""
    ref = runs[case, targets]
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in ref["grads"]}
    # the recommended targets cover every style: colwise, rowwise and replicated (kv_a_proj_with_mqa, q_a_proj)
    assert {"q_proj", "o_proj", "down_proj", "kv_a_proj_with_mqa"} <= adapted
    for rank, res in enumerate(runs[case, layout, targets]):
        assert "logits" in res, res
        for key in ("logits", "train_logits", "loss"):
            torch.testing.assert_close(res[key], ref[key], rtol=0, atol=ATOL[case], msg=f"{key}, rank {rank}")
        assert res["grads"].keys() == ref["grads"].keys()
        for name, grad in ref["grads"].items():
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(res["grads"][name], grad, rtol=0, atol=ATOL[case], msg=f"{name}, rank {rank}")
        assert res["peft_warnings"] == []


def test_a_style_peft_does_not_follow_is_refused_at_get_peft_model(runs):
    """The rope key's gradient summed on kv_a_proj_with_mqa itself (mla_kv_a_proj, the plan before kv_a_output):
    an adapter's rope gradient would stay partial. get_peft_model raises on both ranks, naming module and style."""
    for res in runs[REFUSED]:
        assert "KimiHybridMLA.kv_a_proj_with_mqa (layer 3)" in res.get("refused", res)
        assert "'mla_kv_a_proj'" in res["refused"] and "lora_target_modules" in res["refused"]


# ---- without processes -------------------------------------------------------------------------------------------


def styles(model, names) -> dict[str, str | None]:
    """{wildcard module name: its rule in model.tp_plan, or None} for the modules whose last name is in names (what
    PEFT's target_modules matches, and how PEFT finds a target's rule)."""
    modules = {re.sub(r"\.\d+(\.|$)", r".*\1", n) for n, _ in model.named_modules()}
    return {n: model.tp_plan.get(n) for n in modules if n.rsplit(".", 1)[-1] in names}


K3_CONFIG = KimiK3Config(**k3_tp_config())


@pytest.mark.parametrize(
    "config",
    [
        tiny_config(),
        tiny_config(q_lora_rank=8, mla_use_output_gate=True, kda_full_rank_output_gate=True),
        K3_CONFIG,
    ],
    ids=["kimi_linear", "q_lora_gates", "k3"],
)
def test_every_lora_target_has_a_style_peft_follows(config):
    """Under the default TP plan each recommended target, and every nn.Linear of the decoder ("all-linear"), is
    colwise, rowwise or replicated: what the torchrun test shows right."""
    with torch.device("meta"):
        model = (KimiK3ForConditionalGeneration if config is K3_CONFIG else KimiHybridForCausalLM)(config)
    targets = styles(model, set(lora_target_modules(config)))
    assert {s for s in targets.values() if s is not None} == set(LORA_TP_STYLES), targets
    assert targets[next(n for n in targets if n.endswith("self_attn.kv_a_proj_with_mqa"))] is None
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and "layers." in n}
    decoder = styles(model, linear)
    assert {s for s in decoder.values() if s is not None} <= set(LORA_TP_STYLES), decoder


def test_refusal_leaves_the_module_in_place():
    """check_lora_layer runs before the LoRA layer replaces the child: a refused target keeps its base layer."""
    torch.manual_seed(0)
    model = KimiHybridForCausalLM(tiny_config())
    mla = model.model.layers[3].self_attn
    base = mla.kv_b_proj
    base._hf_tp_plan = "colwise_gather_output"  # as PEFT records a rule of model.tp_plan
    with pytest.raises(ValueError, match=r"KimiHybridMLA\.kv_b_proj \(layer 3\).*'colwise_gather_output'"):
        get_peft_model(model, lora_config(model, "kv_b_proj"))
    assert mla.kv_b_proj is base
