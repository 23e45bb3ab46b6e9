"""`kimi-hf quickstart`: the whole package end to end, on CPU, offline, in a few minutes.

1. data: chunks of the Python standard library's sources (text) and generated scenes with a counting
   question (images), as chat examples;
2. a byte-level BPE tokenizer with Kimi K3's chat markup (XTML) and media tokens, trained on that text;
3. a small model of the Kimi K3 architecture (`--arch k3`, the default): safe-gate KDA 3 : 1 gated MLA, SiTU
   Stable LatentMoE, K3's Block Attention Residuals, K3's MoonViT3d tower (early fusion); `--arch kimi-linear`
   trains the previous one (Kimi Linear's decoder, K2's chat markup);
4. training with MuonClip through transformers' Trainer (progress bar; loss curve as PNG);
5. save_pretrained (K3: the official K3 checkpoint layout; + processor), reload through the Auto classes, check
   the logits match;
6. generate text, chat about a new image in the model's chat format, measure held-out counting accuracy.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass


SIZES = {  # hidden, layers (3 KDA : 1 MLA), experts, vision hidden, vocabulary
    "tiny": dict(hidden=64, layers=4, experts=4, vision_hidden=32, vocab=512),
    "small": dict(hidden=128, layers=4, experts=4, vision_hidden=64, vocab=1024),
    "base": dict(hidden=256, layers=8, experts=8, vision_hidden=128, vocab=2048),
}
TEXT_PROMPT = "Write some Python."
ARCHS = {"k3": "Kimi K3", "kimi-linear": "Kimi Linear"}  # --arch: the architecture trained
# what run_quickstart writes under `out`: directories, then files (summary.json goes through a temporary file)
OUTPUT_DIRS = {"model": "the trained model and processor", "trainer": "the Trainer's output_dir"}
OUTPUT_FILES = {
    "loss.png": "the loss plot",
    "question.png": "the question image",
    "summary.json": "the summary",
    "summary.json.tmp": "the summary's temporary file",
}


@dataclass
class QuickstartResult:
    out: str
    model_dir: str
    loss_plot: str
    summary_path: str
    summary: dict


def text_examples(n: int, seed: int, chars: int = 240) -> list[dict]:
    """n chat examples whose assistant reply is a chunk of a standard-library source file."""
    from .data import stdlib_source_files

    rng = random.Random(seed)
    files = stdlib_source_files()
    out = []
    while len(out) < n:
        with open(rng.choice(files), encoding="utf-8", errors="replace") as f:
            text = f.read()
        if len(text) < 2 * chars:
            continue
        start = text.find("\n", rng.randrange(0, len(text) - chars)) + 1
        chunk = text[start : start + chars].strip()
        if chunk:
            out.append(
                {
                    "messages": [{"role": "user", "content": TEXT_PROMPT}, {"role": "assistant", "content": chunk}],
                    "images": [],
                }
            )
    return out


def small_multimodal_model(tokenizer, size: str = "small", image_size: int = 84, attn_residual: str = "none"):
    """A KimiHybridForConditionalGeneration of one of SIZES for `tokenizer` (Kimi Linear's 3:1
    KDA:MLA layout and a dense first layer, then MoE; MoonViT tower with positions for image_size)."""
    from . import KimiHybridConfig, KimiHybridForConditionalGeneration
    from .chat import IMAGE_TOKEN, chat_stop_token_ids

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    s, side = SIZES[size], image_size // 14 + 1
    h = s["hidden"]
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=h,
        intermediate_size=2 * h,
        moe_intermediate_size=h // 2,
        num_hidden_layers=s["layers"],
        first_k_dense_replace=1,
        num_attention_heads=2,
        kv_lora_rank=h // 4,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=s["experts"],
        num_experts_per_tok=2,
        n_shared_experts=1,
        linear_num_heads=2,
        linear_head_dim=h // 2,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=chat_stop_token_ids(tokenizer),
        attn_residual=attn_residual,
    )  # replies stop at the turn end
    vision = dict(
        hidden_size=s["vision_hidden"],
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * s["vision_hidden"],
        pos_emb_height=side,
        pos_emb_width=side,
    )
    config = KimiHybridConfig(
        text_config=text, vision_config=vision, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    )
    return KimiHybridForConditionalGeneration(config)


def small_k3_model(tokenizer, size: str = "small", image_size: int = 84):
    """A KimiK3ForConditionalGeneration of one of SIZES for a K3-markup `tokenizer` (train_tokenizer(...,
    markup="k3")): the K3 architecture of `small_k3_config` (safe-gate KDA 3 : 1 gated MLA, SiTU LatentMoE,
    K3 Block AttnRes, the K3 MoonViT3d tower, two blocks) at that size; eos <|end_of_msg|>."""
    from . import KimiK3ForConditionalGeneration
    from .models.kimi_k3.chat_template_kimi_k3 import K3_STOP_TOKEN, MEDIA_PAD

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    s = SIZES[size]
    config = small_k3_config(
        hidden=s["hidden"],
        layers=s["layers"],
        vocab_size=len(tokenizer),
        experts=s["experts"],
        vision_hidden=s["vision_hidden"],
        vision_layers=2,
        vision_pos_emb=image_size // 14 + 1,
        media_token_id=tokenizer.convert_tokens_to_ids(MEDIA_PAD),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids(K3_STOP_TOKEN),
        pad_token_id=tokenizer.pad_token_id,
    )
    return KimiK3ForConditionalGeneration(config)


def small_k3_config(
    hidden: int = 96,
    layers: int = 6,
    *,
    vocab_size: int = 259,
    heads: int = 2,
    mla_head_dim: int = 16,
    experts: int = 8,
    top_k: int = 2,
    attn_res_block_size: int = 2,
    k3_parts: bool = True,
    vision_hidden: int = 32,
    vision_layers: int = 1,
    vision_pos_emb: int = 8,
    media_token_id: int = 258,
    bos_token_id: int = 256,
    eos_token_id: int = 257,
    pad_token_id: int = 258,
):
    """A small Kimi K3-architecture KimiK3Config, in the released config's field names: K3's layer pattern (KDA
    at 1-based layers not divisible by 4, MLA there and last), a dense layer 0, the safe gate and full-rank KDA
    output gate, gated MLA with q LoRA (nope = v = mla_head_dim, rope = half), SiTU, Stable LatentMoE (latent
    hidden / 2, one shared expert) and Block AttnRes every attn_res_block_size layers, a MoonViT3d tower of
    vision_layers blocks. k3_parts=False turns Attention Residuals and LatentMoE off (experts at the full width), the rest
    unchanged: the comparison benchmarks/k3.py makes."""
    from . import KimiK3Config

    kda = [i + 1 for i in range(layers) if (i + 1) % 4 and i < layers - 1]
    text = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        q_lora_rank=hidden // 2,
        kv_lora_rank=hidden // 2,
        qk_nope_head_dim=mla_head_dim,
        qk_rope_head_dim=mla_head_dim // 2,
        v_head_dim=mla_head_dim,
        num_experts=experts,
        num_experts_per_token=top_k,
        num_shared_experts=1,
        linear_attn_config=dict(
            num_heads=heads,
            head_dim=hidden // heads,
            short_conv_kernel_size=4,
            use_full_rank_gate=True,
            gate_lower_bound=-5.0,
            kda_layers=kda,
            full_attn_layers=[i + 1 for i in range(layers) if i + 1 not in kda],
        ),
        first_k_dense_replace=1,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    if k3_parts:
        text.update(attn_res_block_size=attn_res_block_size, routed_expert_hidden_size=hidden // 2)
        text.update(latent_moe_use_norm=True)
    else:
        text.update(attn_residual="none", routed_expert_hidden_size=None, latent_moe_use_norm=False)
    vision = dict(
        vt_hidden_size=vision_hidden,
        vt_num_hidden_layers=vision_layers,
        vt_num_attention_heads=2,
        qkv_hidden_size=vision_hidden,
        vt_intermediate_size=2 * vision_hidden,
        init_pos_emb_height=vision_pos_emb,
        init_pos_emb_width=vision_pos_emb,
        text_hidden_size=hidden,
    )
    return KimiK3Config(
        text_config=text,
        vision_config=vision,
        media_placeholder_token_id=media_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def one_kind_batches(texts: list[dict], scenes: list[dict], batch_size: int, seed: int) -> list[dict]:
    """texts + scenes ordered so that each run of `batch_size` examples is of one kind, the runs in a seeded
    random order (train with train_sampling_strategy="sequential"): a batch is padded to its longest example,
    and a scene example is a third of a text one, so mixed batches would cost every scene a text's length."""
    rng = random.Random(seed)
    runs = []
    for group in (list(texts), list(scenes)):  # a partial run would misalign every batch after it: dropped
        rng.shuffle(group)
        runs += [group[i : i + batch_size] for i in range(0, len(group) - batch_size + 1, batch_size)]  # full runs
    rng.shuffle(runs)
    return [example for run in runs for example in run]


def markup_text(conversations: list[list[dict]], chat_template_kwargs: dict) -> list[str]:
    """The text between K3's markup tokens in these conversations as K3's chat template renders them (the
    tokens themselves are added whole: a BPE trained on this learns the words of the markup)."""
    import re

    from transformers.utils.chat_template_utils import render_jinja_template

    from .models.kimi_k3.chat_template_kimi_k3 import K3_CHAT_TEMPLATE, MEDIA_TOKENS, XTML_TOKENS

    rendered, _ = render_jinja_template(conversations, chat_template=K3_CHAT_TEMPLATE, **chat_template_kwargs)
    split = re.compile("|".join(re.escape(t) for t in XTML_TOKENS + MEDIA_TOKENS))
    return [piece for text in rendered for piece in split.split(text) if piece]


def chat_transcript(model, processor, image, max_new_tokens: int, chat_template_kwargs: dict) -> dict:
    """{"prompt", "reply", "answer"}: the counting question about `image` as the chat template renders it (before
    the processor expands the image), the model's greedy reply decoded with its markup (special tokens kept), and
    the answer read from it (chat.reply_text, as scenes.ask reads one)."""
    import torch

    from .chat import reply_text
    from .scenes import QUESTION

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt = processor.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **chat_template_kwargs
    )
    inputs = processor(images=[image], text=[prompt], return_tensors="pt").to(model.device)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    reply = processor.decode(new, skip_special_tokens=False)
    return {"prompt": prompt, "reply": reply, "answer": reply_text(processor.tokenizer, new, prompt)}


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def check_outputs(out: str) -> None:
    """Raises ValueError naming the first path under `out` that run_quickstart could not write: `out` and
    its subdirectories must be (or become) writable directories, its files writable files. Creates nothing."""
    if not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"out must be a path, got {type(out).__name__}")
    out = os.fspath(out)
    if not os.path.isdir(out):
        if os.path.lexists(out):
            raise ValueError(f"out: {out!r} exists and is not a directory")
        parent = _nearest_existing(out)
        if not os.path.isdir(parent):
            raise ValueError(f"out: cannot create {out!r}: {parent!r} is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"out: cannot create {out!r}: {parent!r} is not writable")
        return  # everything below out will be new
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"out: {out!r} is not writable")
    for name, what in {**OUTPUT_DIRS, **OUTPUT_FILES}.items():
        path = os.path.join(out, name)
        if not os.path.lexists(path):
            continue
        if name in OUTPUT_DIRS and not os.path.isdir(path):
            raise ValueError(f"out: {path!r} exists and is not a directory (quickstart writes {what} there)")
        if name in OUTPUT_FILES and not os.path.isfile(path):
            raise ValueError(f"out: {path!r} exists and is not a file (quickstart writes {what} there)")
        if not os.access(path, os.W_OK | (os.X_OK if name in OUTPUT_DIRS else 0)):
            raise ValueError(f"out: {path!r} is not writable (quickstart writes {what} there)")


def _device(device: str) -> str:
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available")
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def run_quickstart(
    out: str = "outputs/quickstart",
    size: str = "small",
    steps: int = 500,
    batch_size: int = 16,
    lr: float = 5e-3,
    device: str = "auto",
    seed: int = 0,
    text_examples_n: int = 1000,
    image_examples_n: int = 4000,
    eval_images: int = 256,
    image_size: int = 84,
    progress: bool = True,
    arch: str = "k3",
) -> QuickstartResult:
    """Runs the six steps (module docstring), writing OUTPUT_DIRS and OUTPUT_FILES under `out`. The arguments
    and the output paths are checked first: a bad one raises before any work is done."""
    for name, v in (
        ("steps", steps),
        ("batch_size", batch_size),
        ("text_examples_n", text_examples_n),
        ("image_examples_n", image_examples_n),
        ("eval_images", eval_images),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if text_examples_n < batch_size and image_examples_n < batch_size:
        raise ValueError(
            f"text_examples_n ({text_examples_n}) or image_examples_n ({image_examples_n}) must be at least "
            f"batch_size ({batch_size}): batches are of one kind and partial ones are dropped, so no step would run"
        )
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    check_outputs(out)  # before the minutes of work, not after them
    device = _device(device)

    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, Trainer, TrainingArguments

    from . import KimiHybridImageProcessor, KimiHybridProcessor, KimiK3ImageProcessor, KimiK3Processor
    from .chat import generate_replies
    from .collators import KimiHybridVisionCollator
    from .optim import MuonClip, MuonClipCallback
    from .plotting import LossHistory, save_loss_plot
    from .scenes import QUESTION, counting_accuracy, counting_examples, render_scene
    from .tokenization import train_tokenizer

    t0 = time.time()
    torch.manual_seed(seed)
    torch.set_flush_denormal(True)
    os.makedirs(out, exist_ok=True)

    print(
        f"[1/6] data: {text_examples_n} text chunks of the standard library, {image_examples_n} generated scenes "
        f"(batches of one kind, about 1 text : {image_examples_n / max(1, text_examples_n):.0f} scenes)"
    )
    texts = text_examples(text_examples_n, seed)
    scenes = counting_examples(image_examples_n, seed=seed, size=image_size)
    held_out = counting_examples(eval_images, seed=seed + 10_000, size=image_size)
    train = one_kind_batches(texts, scenes, batch_size, seed)

    k3 = arch == "k3"
    # K3's format with its think channel, without the thinking-effort preamble (a long system message)
    chat_kwargs = {"thinking_effort": None} if k3 else {}
    answer_tokens = 16 if k3 else 2  # K3's reply closes the think channel and opens the response one first
    markup = "Kimi K3's XTML chat / media" if k3 else "Kimi's chat / media / tool"
    print(f"[2/6] tokenizer: byte-level BPE, {SIZES[size]['vocab']} tokens, {markup} tokens")
    corpus = [ex["messages"][1]["content"] for ex in texts] + [f"{QUESTION} {ex['answer']}" for ex in scenes[:200]]
    if k3:  # K3's markup is words between its tokens (message role="assistant", think, response): merge them too
        corpus += markup_text([ex["messages"] for ex in texts[:100] + scenes[:100]], chat_kwargs)
    tokenizer = train_tokenizer(corpus, vocab_size=SIZES[size]["vocab"], markup="k3" if k3 else "kimi")
    if k3:
        processor = KimiK3Processor(KimiK3ImageProcessor(), tokenizer)
        model = small_k3_model(tokenizer, size, image_size)
    else:
        processor = KimiHybridProcessor(KimiHybridImageProcessor(), tokenizer)
        model = small_multimodal_model(tokenizer, size, image_size)
    n_params = sum(p.numel() for p in model.parameters())
    tc = model.config.text_config
    k3_parts = f"; SiTU LatentMoE, Block AttnRes (blocks of {tc.attn_residual_block_size} sublayers)" if k3 else ""
    print(
        f"[3/6] model: {ARCHS[arch]}, {n_params / 1e6:.2f}M parameters; decoder {tc.layer_types} "
        f"({tc.num_experts} experts, top-{tc.num_experts_per_tok}{k3_parts}), "
        f"vision tower {model.config.vision_config.num_hidden_layers} layers"
    )

    print(f"[4/6] training: {steps} steps x {batch_size} examples, MuonClip lr {lr}, Trainer on {device}")
    history = LossHistory()
    args = TrainingArguments(
        output_dir=os.path.join(out, "trainer"),
        per_device_train_batch_size=batch_size,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        warmup_steps=min(20, steps // 10),
        logging_steps=max(1, min(10, steps // 20)),
        report_to=[],
        remove_unused_columns=False,
        save_strategy="no",
        use_cpu=device == "cpu",
        dataloader_drop_last=True,
        seed=seed,
        disable_tqdm=not progress,
        train_sampling_strategy="sequential",  # the order one_kind_batches made
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        data_collator=KimiHybridVisionCollator(processor, chat_template_kwargs=chat_kwargs),
        optimizer_cls_and_kwargs=(MuonClip, dict(model=model, lr=lr, weight_decay=0.01, qk_clip_tau=100.0)),
        callbacks=[history, MuonClipCallback()],
    )
    trainer.train()
    loss_plot = (
        save_loss_plot(
            os.path.join(out, "loss.png"),
            history.steps,
            history.losses,
            title=f"quickstart training loss ({size}, {steps} steps)",
        )
        if history.losses
        else None
    )

    model_dir = os.path.join(out, "model")
    print(f"[5/6] save_pretrained -> {model_dir}; reload with AutoModelForImageTextToText / AutoProcessor")
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    reloaded = AutoModelForImageTextToText.from_pretrained(model_dir).to(device).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    model.eval()
    probe = processor(
        images=held_out[0]["images"],
        text=[processor.apply_chat_template(held_out[0]["messages"], tokenize=False, **chat_kwargs)],
        return_tensors="pt",
    ).to(device)
    with torch.no_grad():
        max_diff = (model(**probe).logits - reloaded(**probe).logits).abs().max().item()
    if max_diff > 1e-4:
        raise RuntimeError(f"the reloaded model's logits differ from the trained one's by {max_diff:.2e}")

    print("[6/6] generation with the reloaded model")
    text = generate_replies(
        reloaded,
        processor,
        [[{"role": "user", "content": TEXT_PROMPT}]],
        max_new_tokens=48 + answer_tokens - 2,
        chat_template_kwargs=chat_kwargs,
        repetition_penalty=1.2,
    )[0]
    image = render_scene(random.Random(seed + 20_000), image_size, circles=3, squares=1)
    image_path = os.path.join(out, "question.png")
    image.save(image_path)
    transcript = chat_transcript(reloaded, processor, image, answer_tokens, chat_kwargs)
    answer = transcript.pop("answer")
    accuracy, per_count = counting_accuracy(
        reloaded, processor, held_out, max_new_tokens=answer_tokens, chat_template_kwargs=chat_kwargs
    )

    summary = {
        "arch": arch,
        "size": size,
        "parameters": n_params,
        "steps": steps,
        "device": device,
        "first_loss": history.losses[0] if history.losses else None,
        "last_loss": history.losses[-1] if history.losses else None,
        # text and scene batches alternate at random: the last 5 logged losses' mean is the steadier number
        "last_loss_mean_of_5": sum(history.losses[-5:]) / len(history.losses[-5:]) if history.losses else None,
        "reload_max_logit_diff": max_diff,
        "generated_text": text,
        "image_question": QUESTION,
        "image_true_count": 3,
        "image_answer": answer,
        "chat_transcript": transcript,
        "held_out_counting_accuracy": accuracy,
        "held_out_per_count": per_count,
        "chance": 1 / len(per_count),
        "seconds": round(time.time() - t0, 1),
    }
    summary_path = os.path.join(out, "summary.json")
    with open(summary_path + ".tmp", "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(summary_path + ".tmp", summary_path)

    print("\n== quickstart done in {:.0f} s ==".format(summary["seconds"]))
    print(
        f"loss {summary['first_loss']:.3f} -> {summary['last_loss_mean_of_5']:.3f} (mean of the last 5 logs)"
        if history.losses
        else "no loss logged"
    )
    print(f"generated for {TEXT_PROMPT!r}:\n    {text[:300]!r}")
    print(f"chat ({ARCHS[arch]}'s format; the prompt as the template writes it, the reply as the model wrote it):")
    print(f"    prompt: {transcript['prompt']!r}\n    reply:  {transcript['reply']!r}")
    print(f"{QUESTION} ({image_path}, 3 circles + 1 square): model answers {answer!r}")
    print(
        f"held-out counting accuracy {accuracy:.2f} on {len(held_out)} new scenes (chance {summary['chance']:.2f}; "
        "counting is slow to learn: examples/multimodal_finetune.py's 1500 image-only steps reach 0.83-0.89)"
    )
    print(f"model + processor: {model_dir}\nloss plot:         {loss_plot}\nsummary:           {summary_path}")
    print(
        f"load it:  AutoModelForImageTextToText.from_pretrained({model_dir!r}) (trust_remote_code=True without kimi_hf)"
    )
    return QuickstartResult(out, model_dir, loss_plot, summary_path, summary)


__all__ = [
    "run_quickstart",
    "check_outputs",
    "small_multimodal_model",
    "small_k3_model",
    "chat_transcript",
    "ARCHS",
    "text_examples",
    "SIZES",
    "QuickstartResult",
]
