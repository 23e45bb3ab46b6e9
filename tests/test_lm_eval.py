"""EleutherAI's lm-evaluation-harness (`lm_eval`, PyPI `lm-eval`) evaluates a saved kimi_hf model
with the command line a user types: `--model hf` and `trust_remote_code=True` in --model_args (the
folder's auto_map + copied code; lm_eval never imports kimi_hf, and here it cannot), on a tiny local
task (YAML + jsonl, written to tmp_path). The loglikelihoods it reports are checked against the
in-process model, so a wrong load, padding or batching shows up. Without trust_remote_code the same
command fails and says to pass it."""

import glob
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch


pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lm-eval>=0.4.10', or the `test` extra)")

from kimi_hf import KimiHybridForCausalLM  # noqa: E402
from kimi_hf.tokenization import train_tokenizer  # noqa: E402

from .models.kimi_hybrid.helpers import tiny_config  # noqa: E402


LIMIT = 4  # of the 6 multiple-choice docs
MC_DOCS = [
    {"question": "The cat sat on the", "choices": ["mat", "moon", "car"], "label": 0},
    {"question": "Paris is the capital of", "choices": ["Spain", "France"], "label": 1},
    {"question": "Two plus two is", "choices": ["four", "five", "six", "zero"], "label": 0},
    {"question": "The sky is", "choices": ["green", "blue"], "label": 1},
    {"question": "Water is", "choices": ["wet", "dry", "loud"], "label": 0},
    {"question": "Fire is", "choices": ["cold", "hot"], "label": 1},
]
PPL_DOCS = [{"text": "The cat sat on the mat."}, {"text": "Two plus two is four, and the sky is blue."}]


def write_tasks(task_dir):
    """A multiple-choice task (acc) and a rolling-loglikelihood one (perplexities), on local jsonl files."""
    task_dir.mkdir()
    for name, docs in (("mc", MC_DOCS), ("ppl", PPL_DOCS)):
        (task_dir / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\nmetadata:\n  version: 1.0\n"
    (task_dir / "kimi_tiny_mc.yaml").write_text(
        "task: kimi_tiny_mc\n"
        + common.format(path=json.dumps(str(task_dir / "mc.jsonl")))
        + 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: choices\ndoc_to_target: label\n'
        + "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (task_dir / "kimi_tiny_ppl.yaml").write_text(
        "task: kimi_tiny_ppl\n"
        + common.format(path=json.dumps(str(task_dir / "ppl.jsonl")))
        + 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        + "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )


def lm_eval_command(model_args, task_dir, out_dir):
    exe = shutil.which("lm_eval", path=os.path.dirname(sys.executable)) or shutil.which("lm_eval")
    assert exe, "lm_eval is importable but its console script is not on PATH"
    return [
        exe,
        "--model",
        "hf",
        "--model_args",
        model_args,
        "--tasks",
        "kimi_tiny_mc,kimi_tiny_ppl",
        "--include_path",
        str(task_dir),
        "--device",
        "cpu",
        "--batch_size",
        "2",
        "--limit",
        str(LIMIT),
        "--output_path",
        str(out_dir),
        "--log_samples",
    ]


def blocking_env(tmp_path):
    """Offline, caches in tmp_path, and `import kimi_hf` / `import kimi_hf_kernels` raise ImportError
    (stub packages first on PYTHONPATH shadow the editable install): only the saved folder's code runs."""
    stubs = tmp_path / "stubs"
    for name in ("kimi_hf", "kimi_hf_kernels"):
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(f"raise ImportError('{name} must not be needed by lm_eval')\n")
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf_home"),
        PYTHONPATH=str(stubs),
        TOKENIZERS_PARALLELISM="false",
    )


def loglikelihood(model, tok, context, continuation):
    """lm_eval's hf loglikelihood for a causal model: encode context+continuation whole, split at len(context)."""
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    n_ctx = len(tok(context, add_special_tokens=False)["input_ids"]) if context else 0
    ids = whole if context else [tok.bos_token_id] + whole  # rolling: lm_eval's prefix token (BOS) is the context
    n_ctx = n_ctx if context else 1
    with torch.no_grad():
        logprobs = model(input_ids=torch.tensor([ids[:-1]])).logits[0].log_softmax(-1)[n_ctx - 1 :]
    return logprobs.gather(-1, torch.tensor(ids[n_ctx:])[:, None]).sum().item()


def test_lm_eval_cli_with_trust_remote_code(tmp_path):
    tok = train_tokenizer([d["question"] + " " + " ".join(d["choices"]) for d in MC_DOCS] * 3, vocab_size=300)
    model = KimiHybridForCausalLM(
        tiny_config(
            vocab_size=len(tok),
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )
    ).eval()
    model_dir, task_dir = tmp_path / "model", tmp_path / "tasks"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    write_tasks(task_dir)
    env = blocking_env(tmp_path)

    untrusted = subprocess.Popen(
        lm_eval_command(f"pretrained={model_dir},dtype=float32", task_dir, tmp_path / "out_untrusted"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    run = subprocess.run(
        lm_eval_command(f"pretrained={model_dir},trust_remote_code=True,dtype=float32", task_dir, tmp_path / "out"),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    untrusted_log = untrusted.communicate(timeout=300)[0]
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "kimi_tiny_mc" in run.stdout and "acc" in run.stdout  # the results table

    (results_file,) = glob.glob(str(tmp_path / "out" / "*" / "results_*.json"))
    report = json.loads(open(results_file).read())
    mc, ppl = report["results"]["kimi_tiny_mc"], report["results"]["kimi_tiny_ppl"]
    assert report["n-samples"]["kimi_tiny_mc"] == {"original": len(MC_DOCS), "effective": LIMIT}
    assert report["n-samples"]["kimi_tiny_ppl"] == {"original": len(PPL_DOCS), "effective": len(PPL_DOCS)}
    for key in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert math.isfinite(ppl[key]) and ppl[key] > 0, (key, ppl)

    # every loglikelihood lm_eval logged equals the in-process model's, and acc follows from them
    (mc_samples,) = glob.glob(str(tmp_path / "out" / "*" / "samples_kimi_tiny_mc_*.jsonl"))
    samples = [json.loads(line) for line in open(mc_samples)]
    assert [s["doc_id"] for s in samples] == list(range(LIMIT))
    correct = []
    for s in samples:
        pairs = [(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]
        assert len(pairs) == len(s["doc"]["choices"])
        got = [float(r[0][0]) for r in s["resps"]]
        want = [loglikelihood(model, tok, c, x) for c, x in pairs]
        assert all(math.isfinite(g) for g in got)
        assert got == pytest.approx(want, abs=1e-4), (pairs, got, want)
        correct.append(float(max(range(len(got)), key=got.__getitem__) == s["doc"]["label"]))
        assert s["acc"] == correct[-1]
    assert mc["acc,none"] == pytest.approx(sum(correct) / LIMIT)
    (ppl_samples,) = glob.glob(str(tmp_path / "out" / "*" / "samples_kimi_tiny_ppl_*.jsonl"))
    for s in map(json.loads, open(ppl_samples)):
        got = float(s["resps"][0][0])
        assert got == pytest.approx(loglikelihood(model, tok, "", s["doc"]["text"]), abs=1e-4)

    # the same command without trust_remote_code fails, and says why
    assert untrusted.returncode != 0
    assert "trust_remote_code=True" in untrusted_log, untrusted_log[-4000:]
