"""Run as a script by test_hub.py: loads saved folders with stock transformers and trust_remote_code
in a process where kimi_hf (and its kernels) cannot be imported, and checks them against the
expected outputs the test saved.  Usage: remote_load_worker.py EXPECTED.pt NAME_OR_PATH [...]"""

import sys


for blocked in ("kimi_hf", "kimi_hf_kernels", "fla"):
    sys.modules[blocked] = None  # `import kimi_hf` raises ImportError here

import torch  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor  # noqa: E402


def main():
    expected = torch.load(sys.argv[1])
    for source in sys.argv[2:]:
        want = expected[source]
        if want["kind"] == "multimodal":
            proc = AutoProcessor.from_pretrained(source, trust_remote_code=True)
            assert type(proc).__module__.startswith("transformers_modules"), type(proc).__module__
            inputs = proc(images=[want["image"]], text=want["text"])
            assert torch.equal(inputs["input_ids"], want["input_ids"])
            autos = (AutoModelForImageTextToText, AutoModelForCausalLM)
            assert type(AutoModel.from_pretrained(source, trust_remote_code=True)).__name__ == "KimiHybridModel"
        elif want["kind"] == "k3":  # Kimi K3 in its released layout, saved by KimiK3ForConditionalGeneration
            inputs = {"input_ids": want["input_ids"]}
            autos = (AutoModelForImageTextToText, AutoModelForCausalLM)
        else:
            inputs = {"input_ids": want["input_ids"]}
            autos = (AutoModelForCausalLM,)
        for auto in autos:
            model = auto.from_pretrained(source, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            with torch.no_grad():
                logits = model(**inputs).logits
            assert torch.allclose(logits, want["logits"], atol=1e-5), (source, auto.__name__)
            out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
            assert torch.equal(out, want["generated"]), (source, auto.__name__)
        print(f"ok {source}")


if __name__ == "__main__":
    main()
