"""Run as a script by test_hub_kimi.py: loads saved folders with stock transformers and trust_remote_code
in a process where kimi_hf (and its kernels) cannot be imported, and checks them against the
expected outputs the test saved.  Usage: remote_load_worker.py EXPECTED.pt NAME_OR_PATH [...]"""

import os
import sys
import tempfile


for blocked in ("kimi_hf", "kimi_hf_kernels", "fla"):
    sys.modules[blocked] = None  # `import kimi_hf` raises ImportError here

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
)


def check_remote(obj):
    assert type(obj).__module__.startswith("transformers_modules"), type(obj).__module__


def check_processor(source, want):
    proc = AutoProcessor.from_pretrained(source, trust_remote_code=True)
    check_remote(proc)
    check_remote(proc.image_processor)
    inputs = proc(images=[want["image"]], text=want["text"])
    assert torch.equal(inputs["input_ids"], want["input_ids"]), source
    return inputs


def check_resave(model, source):
    """A model loaded from remote code saves its own code again (the exporter runs from the flat module cache):
    the same files as the folder it came from, minus the processors' (saved by the processor)."""
    if not os.path.isdir(source):
        return
    with tempfile.TemporaryDirectory() as out:
        model.save_pretrained(out)
        saved = {f for f in os.listdir(out) if f.endswith(".py")}
    assert saved and saved <= {f for f in os.listdir(source) if f.endswith(".py")}, (source, sorted(saved))
    assert "modeling_kimi_hybrid.py" in saved, sorted(saved)


def main():
    expected = torch.load(sys.argv[1])
    for source in sys.argv[2:]:
        want = expected[source]
        check_remote(AutoConfig.from_pretrained(source, trust_remote_code=True))
        if want["kind"] == "vision":  # a tower alone: AutoModel, the merged patch features
            model = AutoModel.from_pretrained(source, trust_remote_code=True).eval()
            check_remote(model)
            assert type(model).__name__ == want["class"], type(model).__name__
            with torch.no_grad():
                out = model(pixel_values=want["pixel_values"], grid_thw=want["image_grid_thw"])
            assert torch.allclose(out.last_hidden_state, want["features"], atol=1e-5), source
            check_resave(model, source)
            print(f"ok {source}")
            continue
        if want["kind"] in ("multimodal", "k3"):
            autos = (AutoModelForImageTextToText, AutoModelForCausalLM)
            model = AutoModel.from_pretrained(source, trust_remote_code=True)
            assert type(model).__name__ == want["base_class"], type(model).__name__
        else:  # a text model
            autos = (AutoModelForCausalLM,)
        inputs = check_processor(source, want) if "image" in want else {"input_ids": want["input_ids"]}
        for auto in autos:
            model = auto.from_pretrained(source, trust_remote_code=True).eval()
            check_remote(model)
            with torch.no_grad():
                logits = model(**inputs).logits
            assert torch.allclose(logits, want["logits"], atol=1e-5), (source, auto.__name__)
            out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
            assert torch.equal(out, want["generated"]), (source, auto.__name__)
        check_resave(model, source)
        print(f"ok {source}")


if __name__ == "__main__":
    main()
