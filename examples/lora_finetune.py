"""LoRA fine-tuning of a hybrid KDA/MLA model with PEFT and transformers' Trainer, offline on CPU.

    python examples/lora_finetune.py                                   # a fresh small model, ~1 minute
    python examples/lora_finetune.py --model outputs/quickstart/model  # the quickstart's model
    python examples/lora_finetune.py --model K3_DIR                    # a Kimi K3 folder, MXFP4 experts resident

Task: name the standard-library module a docstring line comes from (chat format; loss on the
assistant's reply only). LoRA adapters on the KDA / MLA / MLP projections (kimi_hf.LORA_TARGET_MODULES;
K3_LORA_TARGET_MODULES for a Kimi K3 folder); everything else frozen (a memorisation task: the point is
the PEFT mechanics). Prints trainable parameters, the answer accuracy on the training lines before /
after, saves the adapter (a few hundred KB), reloads it from its folder alone with
AutoPeftModelForCausalLM (same logits) and merges it.

A Kimi K3 folder whose routed experts are stored in MXFP4 (the release's layout) loads them resident by default
(`experts_format="mxfp4"`: the packed bytes stay in memory, frozen, dequantised on the fly; QLoRA for K3): LoRA trains
around them (attention, MLA's q LoRA chain, shared experts and the LatentMoE bridges), and the adapter reloads onto
and merges into the same resident model. `--experts-format dense` dequantises them at load instead.

The LoRA config says task_type="CAUSAL_LM": PEFT then records the task in adapter_config.json, and
`AutoPeftModelForCausalLM.from_pretrained(adapter)` loads the base model with transformers'
AutoModelForCausalLM (every Kimi class is registered there once kimi_hf is imported: Kimi Linear text and
multimodal, K3 text and K3). Without a task type PEFT records the base class's module instead, and
AutoPeftModel* refuse to import it (kimi_hf is not in PEFT's import allowlist; such an adapter loads with
`import_allowlist=["kimi_hf"]`). The adapter points at the base model by `base_model_name_or_path`: a
fresh model is saved (with its processor) under OUT/base first and trained from there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import random
import sys
import warnings

import torch
from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, Trainer, TrainingArguments

import kimi_hf
from kimi_hf.chat import generate_replies
from kimi_hf.cli_args import ArgumentParser, check_output_folder, check_positive
from kimi_hf.collators import KimiHybridVisionCollator
from kimi_hf.model_folder import check_model_folder
from kimi_hf.presets import small_multimodal_model
from kimi_hf.tokenization import train_tokenizer


MODULES = ["json", "csv", "random", "string", "textwrap", "heapq", "bisect", "fractions"]
QUESTION = "Which module is this from?\n"
# the folders --model takes: image-text models with a processor (Kimi Linear's multimodal model, Kimi K3)
MODEL_TYPES = (kimi_hf.KimiHybridConfig.model_type, kimi_hf.KimiK3Config.model_type)


def examples(seed: int) -> list[dict]:
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in MODULES:
            lines = [
                line.strip()
                for line in (importlib.import_module(name).__doc__ or "").splitlines()
                if len(line.strip()) > 20
            ]
            rows += [
                {"messages": [{"role": "user", "content": QUESTION + line}, {"role": "assistant", "content": name}]}
                for line in lines[:12]
            ]
    random.Random(seed).shuffle(rows)
    return rows


def check_args(args) -> str | None:
    """Bad input, found before any work (ValueError / OSError naming the argument). Returns --model's model_type."""
    check_positive(args, "steps", "rank")
    check_positive(args, "lr", number="number")
    check_output_folder(args.out)
    if args.model is None:
        return None
    model_type = check_model_folder(args.model, what="--model", model_types=MODEL_TYPES)["model_type"]
    if not any(
        os.path.isfile(os.path.join(args.model, f)) for f in ("processor_config.json", "preprocessor_config.json")
    ):
        raise FileNotFoundError(f"--model {args.model!r} has no processor (processor_config.json): save one beside it")
    return model_type


def load_base(model_dir: str | None, model_type: str | None, rows, out: str, experts_format: str = "auto"):
    """The base model and its processor: from model_dir (checked: its model_type), or a fresh tiny model saved
    under OUT/base and loaded back from there (so that the adapter's base_model_name_or_path names a folder
    AutoPeftModel can load)."""
    if model_dir:
        model_dir = os.path.abspath(model_dir)  # recorded in the adapter's config: loadable from any directory
        processor = AutoProcessor.from_pretrained(model_dir)
        multimodal = model_type == kimi_hf.KimiHybridConfig.model_type
        auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
        k3 = model_type == kimi_hf.KimiK3Config.model_type
        kwargs = {"experts_format": experts_format} if k3 else {}  # K3: routed experts MXFP4-resident or dense
        return auto.from_pretrained(model_dir, **kwargs), processor
    tokenizer = train_tokenizer(
        [r["messages"][0]["content"] + " " + r["messages"][1]["content"] for r in rows] * 4, vocab_size=400
    )
    processor = kimi_hf.KimiHybridProcessor(kimi_hf.KimiHybridImageProcessor(), tokenizer)
    base_dir = os.path.abspath(os.path.join(out, "base"))
    small_multimodal_model(tokenizer, "tiny").save_pretrained(base_dir)
    processor.save_pretrained(base_dir)
    return load_base(base_dir, kimi_hf.KimiHybridConfig.model_type, rows, out)


@contextlib.contextmanager
def quiet_peft_deprecation():
    """PEFT (0.21) reads the model's `is_gradient_checkpointing` when it wraps one (get_peft_model, PeftModel loading);
    transformers 5.25 deprecates that property for `is_activation_checkpointing` with a FutureWarning about PEFT's
    code, which nothing here can change: that one warning is hidden, any other shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def lora_targets(model) -> list[str]:
    """The package's recommended LoRA targets: K3's (its q LoRA chain and LatentMoE bridges too) for a K3 model."""
    if isinstance(model.config, (kimi_hf.KimiK3Config, kimi_hf.KimiK3TextConfig)):
        from kimi_hf.models.kimi_k3.modeling_kimi_k3 import K3_LORA_TARGET_MODULES

        return K3_LORA_TARGET_MODULES
    return kimi_hf.LORA_TARGET_MODULES


def accuracy(model, processor, rows) -> float:
    model.eval()
    # replies stop at the end of the turn; K3's open with `<|close|>think<|sep|><|open|>response<|sep|>` (4 tokens)
    replies = generate_replies(model, processor, [r["messages"][:1] for r in rows], max_new_tokens=16)
    return sum(a == r["messages"][1]["content"] for a, r in zip(replies, rows)) / len(rows)


def main(argv=None) -> dict:
    # one-line usage errors (`PROG: error: ...`, exit 2), for argparse's checks and for check_args'
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default=None,
        help=f"a save_pretrained directory with a processor, model_type {' or '.join(MODEL_TYPES)} "
        "(default: a fresh tiny model)",
    )
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="outputs/lora")
    p.add_argument(
        "--experts-format",
        default="auto",
        choices=["auto", "mxfp4", "dense"],
        help="Kimi K3's routed experts: kept in MXFP4 (auto for an MXFP4 folder) or dequantised at load",
    )
    args = p.parse_args(argv)
    try:
        model_type = check_args(args)
    except (ValueError, TypeError, OSError) as e:
        p.error(" ".join(str(e).split()))
    torch.manual_seed(args.seed)
    rows = examples(args.seed)
    base, processor = load_base(args.model, model_type, rows, args.out, args.experts_format)
    experts_format = getattr(base, "experts_format", "dense")
    experts_mb = sum(p.numel() * p.element_size() for n, p in base.named_parameters() if ".experts." in n) / 2**20
    print(f"routed experts: {experts_format} ({experts_mb:.3g} MB in memory)")
    before = accuracy(base, processor, rows)

    targets = lora_targets(base)
    # task_type="CAUSAL_LM": what AutoPeftModelForCausalLM.from_pretrained(adapter) needs (see the docstring)
    lora = LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"
    )
    with quiet_peft_deprecation():
        model = get_peft_model(base, lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print(f"LoRA r={args.rank} on {targets}: {trainable:,} trainable of {total:,} ({100 * trainable / total:.1f}%)")
    targs = TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"),
        per_device_train_batch_size=16,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=10,
        logging_steps=25,
        report_to=[],
        remove_unused_columns=False,
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        seed=args.seed,
        disable_tqdm=True,
    )
    Trainer(model=model, args=targs, train_dataset=rows, data_collator=KimiHybridVisionCollator(processor)).train()
    after = accuracy(model, processor, rows)

    adapter = os.path.join(args.out, "adapter")
    model.save_pretrained(adapter)
    size_kb = sum(os.path.getsize(os.path.join(adapter, f)) for f in os.listdir(adapter)) / 1024
    probe = processor(
        text=[processor.apply_chat_template(rows[0]["messages"], tokenize=False)], return_tensors="pt"
    ).to(model.device)
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=probe["input_ids"]).logits
        # the adapter folder alone: the base model comes from its base_model_name_or_path
        with quiet_peft_deprecation():
            reloaded = AutoPeftModelForCausalLM.from_pretrained(adapter)
        reloaded = reloaded.to(model.device).eval()  # Trainer may use CUDA
        reload_diff = (reloaded(input_ids=probe["input_ids"]).logits - expected).abs().max().item()
        merged = reloaded.merge_and_unload()
        merge_diff = (merged(input_ids=probe["input_ids"]).logits - expected).abs().max().item()
    print(f"\n| | answer accuracy on the {len(rows)} training lines ({len(MODULES)} modules) |\n|---|---|")
    print(f"| base | {before:.2f} |\n| + LoRA ({args.steps} steps) | {after:.2f} |")
    print(
        f"\nadapter: {adapter} ({size_kb:.0f} KB); reloaded logits differ by {reload_diff:.1e}, merged by {merge_diff:.1e}"
    )
    return {
        "adapter": adapter,
        "before": before,
        "after": after,
        "reload_diff": reload_diff,
        "merge_diff": merge_diff,
        "adapter_kb": size_kb,
        "experts_format": experts_format,
    }


if __name__ == "__main__":
    main()
    sys.exit(0)
