"""The smoke set of an installed kimi_hf (a wheel in a fresh environment), run from outside the checkout.

    cd /tmp && /path/to/venv/bin/python /path/to/checkout/scripts/smoke_installed.py

What users of the wheel do first, on whichever transformers that environment has (CI: the version the suite does
not run, scripts/wheel_smoke.sh): every module imports; the console script answers; `kimi-hf quickstart` (tiny)
builds, trains a few steps, saves in K3's released layout and reloads (load, forward, generate, save); `kimi-hf
plan` reads the saved folder; `kimi-hf serve` answers one chat request on 127.0.0.1; TRL's SFTTrainer runs two
steps on the saved model. Prints one line per check; exits non-zero at the first failure.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        raise SystemExit(1)


def run(*argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def import_every_module() -> None:
    import kimi_hf
    import kimi_hf_kernels

    site = sysconfig.get_paths()["purelib"]
    for package in (kimi_hf, kimi_hf_kernels):
        where = os.path.dirname(package.__file__)
        check(f"{package.__name__} is the installed one", where.startswith(site), where)
        # __main__ runs the command line when imported
        names = [
            m.name
            for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
            if not m.name.endswith(".__main__")
        ]
        for name in names:
            importlib.import_module(name)
        check(f"every module of {package.__name__} imports", True, f"{len(names)} modules")
    for sub in ("distributed", "plan", "conversion", "models.kimi_k3", "optim", "swarm", "ops"):
        importlib.import_module(f"kimi_hf.{sub}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_one_request(script: str, model: str) -> None:
    port = free_port()
    server = subprocess.Popen(
        [script, "serve", model, "--port", str(port), "--device", "cpu", "--dtype", "float32",
         "--served-model-name", "smoke"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 300
        while True:
            if server.poll() is not None:
                check("kimi-hf serve starts", False, server.stdout.read()[-2000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if time.time() > deadline:
                    check("kimi-hf serve starts within 300 s", False)
                time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
            listed = [m["id"] for m in json.loads(r.read())["data"]]
        check("/v1/models lists the alias", listed == ["smoke"], str(listed))
        body = {"model": "smoke", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as r:
            reply = json.loads(r.read())
        check("kimi-hf serve answers a chat request", reply["choices"][0]["finish_reason"] in ("stop", "length"))
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def trl_sft_two_steps(model_dir: str, out: str) -> None:
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kimi_hf  # noqa: F401  (registers the Auto classes)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # the quickstart saves K3 as released, with MXFP4 experts: full fine-tuning trains them dense
    model = AutoModelForCausalLM.from_pretrained(model_dir, experts_format="dense")
    rows = [
        {"messages": [{"role": "user", "content": f"Count to {n}."}, {"role": "assistant", "content": str(n)}]}
        for n in range(8)
    ]
    args = trl.SFTConfig(
        output_dir=out,
        max_steps=2,
        per_device_train_batch_size=2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
    )
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    result = trainer.train()
    check("TRL SFTTrainer, two steps", result.global_step == 2, f"loss {result.training_loss:.3f}")


def main() -> None:
    import transformers

    import kimi_hf

    print(f"kimi_hf {kimi_hf.__version__}, transformers {transformers.__version__}, python {sys.version.split()[0]}")
    import_every_module()
    script = os.path.join(os.path.dirname(sys.executable), "kimi-hf")
    r = run(script, "--version")
    check("kimi-hf --version", r.returncode == 0 and kimi_hf.__version__ in r.stdout, r.stdout.strip())
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "qs")
        r = run(
            script, "quickstart", "--size", "tiny", "--steps", "3", "--batch-size", "4", "--text-examples", "16",
            "--image-examples", "16", "--eval-images", "4", "--out", out, "--no-progress",
        )  # fmt: skip
        check("kimi-hf quickstart (tiny: train, save, reload, generate)", r.returncode == 0, r.stderr[-2000:])
        summary = json.load(open(os.path.join(out, "summary.json")))
        check("the reloaded model's logits match", summary["reload_max_logit_diff"] < 1e-4)
        model = os.path.join(out, "model")
        r = run(script, "plan", model, "--task", "lora", "--json")
        check("kimi-hf plan of the saved model", r.returncode == 0 and json.loads(r.stdout)["fits"], r.stderr[-500:])
        serve_one_request(script, model)
        trl_sft_two_steps(model, os.path.join(tmp, "sft"))
    print("smoke: all checks passed")


if __name__ == "__main__":
    main()
