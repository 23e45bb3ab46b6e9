"""Kimi K3's classes as transformers' Auto classes and the experts interface see them (issue 24 items 10, 11)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM

import kimi_hf
from kimi_hf import KimiK3Config

from .release_format import tiny_k3_config


ROOT = Path(__file__).resolve().parents[3]  # the checkout: the child imports `tests` from it, whatever pytest's cwd


def test_k3_classes_are_importable_from_the_package():
    for name in ("KimiK3Model", "KimiK3ForCausalLM", "KimiK3TextModel", "KimiK3ForConditionalGeneration"):
        assert name in kimi_hf.__all__ and getattr(kimi_hf, name).__name__ == name


def test_the_text_config_has_a_causal_lm_and_it_round_trips(tmp_path):
    text = KimiK3Config(**tiny_k3_config()).text_config
    text.dtype = "float32"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(text)
    assert type(model) is kimi_hf.KimiK3ForCausalLM and type(model.model) is kimi_hf.KimiK3TextModel
    assert type(AutoModel.from_config(text)) is kimi_hf.KimiK3TextModel
    model.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(back) is kimi_hf.KimiK3ForCausalLM
    ids = torch.randint(0, text.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model.eval()(ids).logits, rtol=1e-5, atol=1e-6)
    mine, theirs = model.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_experts_implementation_of_a_k3_text_model_built_first_in_a_process():
    """transformers decides whether a class may switch experts implementations from its module's source and caches
    the answer on the class: KimiK3TextModel (whose module has no @use_experts_implementation) asked first got False
    and ran eager experts whatever was asked, and its subclasses' answers depended on which class asked first."""
    script = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, sys.argv[1])  # the checkout (ROOT)
        import torch
        from tests.models.kimi_k3.release_format import tiny_k3_config
        from kimi_hf import KimiK3Config, KimiK3TextModel

        text = KimiK3Config(**tiny_k3_config()).text_config
        assert KimiK3TextModel._can_set_experts_implementation()
        outs = {}
        for impl in ("eager", "batched_mm", "grouped_mm"):
            torch.manual_seed(0)
            model = KimiK3TextModel._from_config(text, experts_implementation=impl, dtype=torch.float32).eval()
            assert model.config._experts_implementation == impl, (impl, model.config._experts_implementation)
            with torch.no_grad():
                outs[impl] = model(torch.arange(12)[None] % text.vocab_size).last_hidden_state
        torch.testing.assert_close(outs["batched_mm"], outs["eager"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs["grouped_mm"], outs["eager"], rtol=1e-5, atol=1e-5)
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script, str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
