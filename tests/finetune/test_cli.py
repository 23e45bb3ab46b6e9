"""`kimi-hf finetune` on a tiny Kimi K3 in the released layout (MXFP4 experts, K3's chat template): a chat dataset with
tools written here, the loss on the assistant's tokens, packed rows with document boundaries, a held-out loss; the
same per-step losses (and eval losses) on one process and on gloo ranks (LoRA: EP 2 with fsdp filled in, CP 2,
PP 2 x FSDP2 2 x EP 2; full fine-tuning as a 2-node torchrun job), clipping and the chunked loss on; resume
bit-identical; --chat-template-kwargs; bad input one line before any model is built."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.distributed.launch import free_port, run, run_nodes


REL = 1e-5  # the bound: the same data and seed give the same losses in every layout
# K3's template renders these chats in 150-400 tokens; a gradient norm above 0.5 (clipping on), chunks of 128 tokens
COMMON = ["--steps", "3", "--seq-len", "512", "--micro-batches", "4", "--lr", "2e-3", "--warmup", "1"]
COMMON += ["--max-grad-norm", "0.5", "--eval-every", "2", "--lora-rank", "4", "--loss-chunk-size", "128"]


CLI = [sys.executable, "-m", "kimi_hf"]


def finetune(folder, data, *args, nproc: int = 1) -> dict[str, dict[int, float]]:
    """{"loss": {step: x}, "eval_loss": {step: x}} of rank 0's JSON lines (stdout holds nothing else)."""
    flags = ["finetune", "--model", str(folder), "--data", str(data["train"])]
    flags += ["--eval-data", str(data["eval"])]
    flags += [*COMMON, *args]
    if nproc == 1:
        cmd = [*CLI, *flags]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        cmd += ["--master-port", str(free_port()), "-m", "kimi_hf", *flags]
    out = run(cmd)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-5000:]
    return parse(out.stdout)


def parse(stdout: str) -> dict[str, dict[int, float]]:
    got = {"loss": {}, "eval_loss": {}}
    for r in (json.loads(line) for line in stdout.splitlines()):
        assert set(r) in ({"step", "loss"}, {"step", "eval_loss"}), stdout
        key = "loss" if "loss" in r else "eval_loss"
        got[key][r["step"]] = r[key]
    return got


def assert_same(a: dict, b: dict, rel: float = REL) -> None:
    for key in ("loss", "eval_loss"):
        assert a[key].keys() == b[key].keys(), (key, a, b)
        for step in a[key]:
            assert b[key][step] == pytest.approx(a[key][step], rel=rel, abs=0), (key, step, a, b)


@pytest.fixture(scope="module")
def reference(k3, chats, tmp_path_factory) -> dict:
    """One process: LoRA over the resident MXFP4 experts, its adapter saved in the released names."""
    adapter = tmp_path_factory.mktemp("adapters") / "one"
    return {"lora": finetune(k3, chats, "--save-adapter", str(adapter)), "adapter": adapter}


def adapter_tensors(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "adapter_model.safetensors"))


def test_one_process_trains_on_the_chat_data_and_logs_the_held_out_loss(reference):
    lora = reference["lora"]
    assert sorted(lora["loss"]) == [0, 1, 2] and sorted(lora["eval_loss"]) == [1, 2]  # every 2 steps, and the end
    assert lora["loss"][2] != lora["loss"][0] and lora["eval_loss"][2] != lora["eval_loss"][1]  # it trains
    keys = adapter_tensors(reference["adapter"])
    assert keys and all(k.startswith("base_model.model.language_model.") for k in keys)  # the released names


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (2, ["--ep", "2"]),  # --fsdp left out: FSDP2 2 x EP 2 over the resident MXFP4 experts
        (2, ["--cp", "2"]),  # packed documents split over the context-parallel ranks
        # PP 2 x FSDP2 2 x EP 2: the documents' positions to every stage; the held-out loss by the forward-only
        # schedule
        (4, ["--pp", "2", "--ep", "2"]),
    ],
    ids=["ep2", "cp2", "pp2_fsdp2_ep2"],
)
def test_layouts_match_one_process(k3, chats, reference, tmp_path, nproc, layout):
    """The same per-step losses (and held-out losses) as one process, gradient clipping and the chunked loss on;
    the adapter saved from the sharded ranks (gathered: FSDP2's shards, every pipeline stage's layers) is one
    process's."""
    adapter = tmp_path / "adapter"
    got = finetune(k3, chats, *layout, "--save-adapter", str(adapter), nproc=nproc)
    assert_same(reference["lora"], got)
    one, here = adapter_tensors(reference["adapter"]), adapter_tensors(adapter)
    assert one.keys() == here.keys()
    for key in one:
        assert torch.allclose(here[key], one[key], rtol=1e-4, atol=1e-6), key


def test_full_fine_tuning_on_two_nodes_matches_one_process(k3, chats, tmp_path):
    """Full fine-tuning (the MXFP4 experts loaded dense, every weight trained, MuonClip with QK-Clip, clipping) on the
    chat data, launched as a 2-node cluster job runs it: one `torchrun --nnodes 2 ... kimi-hf finetune` a "node"
    (one rank each, on 127.0.0.1, at a c10d rendezvous), FSDP2 2 x EP 2 with --fsdp left out; global rank 0, on one
    of the nodes, prints one process's per-step and held-out losses."""
    want = finetune(k3, chats, "--full")
    flags = ["finetune", "--model", str(k3), "--data", str(chats["train"]), "--eval-data", str(chats["eval"])]
    outs = run_nodes(["-m", "kimi_hf", *flags, *COMMON, "--full", "--ep", "2"], nodes=2, nproc=1)
    printed = [o.stdout for o in outs if o.stdout.strip()]
    assert len(printed) == 1, [o.stdout for o in outs]
    assert_same(want, parse(printed[0]))
    assert want["loss"][2] != want["loss"][0]


def test_resume_is_bit_identical(k3, chats, reference, tmp_path):
    ck = tmp_path / "ck"
    first = finetune(k3, chats, "--steps", "3", "--checkpoint-dir", str(ck), "--save-every", "2")
    assert first == {k: reference["lora"][k] for k in ("loss", "eval_loss")}
    import shutil

    shutil.rmtree(ck / "step-3")  # as if the run had died after step 2's save
    rest = finetune(k3, chats, "--checkpoint-dir", str(ck), "--resume")
    assert rest["loss"] == {2: reference["lora"]["loss"][2]}  # exactly


def test_a_config_file_holds_the_flags_and_the_command_line_wins(k3, chats, tmp_path):
    from kimi_hf.finetune.cli import parse_args

    path = tmp_path / "job.yaml"
    path.write_text(f"model: {k3}\ndata: {chats['train']}\nlora-rank: 2\nsteps: 7\nschedule: wsd\n")
    args = parse_args(["--config", str(path), "--steps", "3"])
    assert (args.model, args.lora_rank, args.steps, args.schedule, args.lora) == (str(k3), 2, 3, "wsd", True)
    (tmp_path / "bad.json").write_text(json.dumps({"model": str(k3), "stepz": 3}))
    with pytest.raises(ValueError, match="--config .*bad.json: unknown option 'stepz'"):
        parse_args(["--config", str(tmp_path / "bad.json")])


def test_chat_template_kwargs_reach_every_row(k3, chats):
    """--chat-template-kwargs: K3's default "max" thinking-effort preamble (a system message on every row) left out
    with thinking_effort null; every row shorter by the same preamble, the assistant tokens trained on unchanged."""
    from kimi_hf.finetune.cli import check, parse_args

    flags = ["--model", str(k3), "--data", str(chats["train"]), "--seq-len", "2048", "--steps", "1"]
    docs = {}
    for extra in ([], ["--chat-template-kwargs", '{"thinking_effort": null}']):
        docs[bool(extra)] = check(parse_args(flags + extra), world=1)[2].docs
    with_preamble, without = docs[False].lengths, docs[True].lengths
    saved = with_preamble - without
    assert saved.min() == saved.max() > 20  # the one preamble, from every row
    trained = [int((d.labels != -100).sum()) for d in (docs[False], docs[True])]
    assert trained[0] == trained[1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "{tmp}/none.jsonl"], "none.jsonl"),
        (["--data", "{bad}"], "row 1: messages[0].role: unknown role 'bot'"),
        (["--data", "random", "--ep", "3"], "--ep 3 does not divide num_experts"),
        (["--data", "random", "--steps", "0"], "--steps must be a positive integer, got 0"),
        (["--data", "random", "--resume"], "--resume needs --checkpoint-dir"),
        (["--data", "random", "--eval-data", "{bad}"], "--eval-data goes with --data PATH"),
        (["--data", "random", "--config", "{tmp}/nothing.yaml"], "--config"),
        (["--data", "{train}", "--chat-template-kwargs", "[1]"], "--chat-template-kwargs: expected a JSON object"),
        (["--data", "{train}", "--pp", "2", "--micro-batches", "2", "--gpus-typo"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line_before_any_model(k3, chats, tmp_path, capsys, args, message):
    """In this process (a world of one): the refusal is one line `kimi-hf finetune: error: ...`, exit status 2 (usage
    errors: argparse's own line, also 2)."""
    from kimi_hf.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n"
        + json.dumps({"messages": [{"role": "bot", "content": "hi"}]})
        + "\n"
    )
    fill = {"{tmp}": str(tmp_path), "{bad}": str(bad), "{train}": str(chats["train"])}
    for key, value in fill.items():
        args = [a.replace(key, value) for a in args]
    assert main(["finetune", "--model", str(k3), *args]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and out.err.startswith("kimi-hf finetune: error: "), out.err
    assert message in out.err, out.err
