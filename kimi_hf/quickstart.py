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

# the presets' old home: SIZES and the small models stay importable from here
from .atomic_io import atomic_write
from .presets import SIZES, small_k3_config, small_k3_model, small_multimodal_model


TEXT_PROMPT = "Write some Python."
ARCHS = {"k3": "Kimi K3", "kimi-linear": "Kimi Linear"}  # --arch: the architecture trained
# what run_quickstart writes under `out`: directories, then files
OUTPUT_DIRS = {"model": "the trained model and processor", "trainer": "the Trainer's output_dir"}
OUTPUT_FILES = {
    "loss.png": "the loss plot",
    "question.png": "the question image",
    "summary.json": "the summary",
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

    from .models.kimi_k3.chat_template_kimi_k3 import K3_CHAT_TEMPLATE
    from .models.kimi_k3.xtml_kimi_k3 import K3_MEDIA_TOKENS, XTML_TOKENS

    rendered, _ = render_jinja_template(conversations, chat_template=K3_CHAT_TEMPLATE, **chat_template_kwargs)
    split = re.compile("|".join(re.escape(t) for t in XTML_TOKENS + K3_MEDIA_TOKENS))
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


def check_arguments(
    steps: int, batch_size: int, text_examples_n: int, image_examples_n: int, eval_images: int, size: str, arch: str
) -> None:
    """Raises ValueError naming the first bad argument of run_quickstart (counts, size, arch)."""
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


@dataclass(frozen=True)
class ChatFormat:
    """How run_quickstart talks to one architecture: its chat template's kwargs, the new tokens an answer to
    the counting question needs, and the markup's name (printed at step 2)."""

    k3: bool
    chat_kwargs: dict
    answer_tokens: int
    markup: str


def chat_format(arch: str) -> ChatFormat:
    """K3: its XTML format with the think channel, without the thinking-effort preamble (a long system message);
    a reply closes the think channel and opens the response one before its answer. Kimi Linear: K2's markup."""
    if arch == "k3":
        return ChatFormat(True, {"thinking_effort": None}, 16, "Kimi K3's XTML chat / media")
    return ChatFormat(False, {}, 2, "Kimi's chat / media / tool")


@dataclass
class QuickstartData:
    texts: list[dict]  # text chat examples (standard-library chunks)
    scenes: list[dict]  # counting examples (generated scenes)
    held_out: list[dict]  # counting examples of other seeds, for evaluation
    train: list[dict]  # texts + scenes in one-kind batches (one_kind_batches)


def build_data(
    text_examples_n: int, image_examples_n: int, eval_images: int, image_size: int, batch_size: int, seed: int
) -> QuickstartData:
    """Step 1: the text and scene examples, the held-out scenes and the training order."""
    from .scenes import counting_examples

    print(
        f"[1/6] data: {text_examples_n} text chunks of the standard library, {image_examples_n} generated scenes "
        f"(batches of one kind, about 1 text : {image_examples_n / max(1, text_examples_n):.0f} scenes)"
    )
    texts = text_examples(text_examples_n, seed)
    scenes = counting_examples(image_examples_n, seed=seed, size=image_size)
    held_out = counting_examples(eval_images, seed=seed + 10_000, size=image_size)
    return QuickstartData(texts, scenes, held_out, one_kind_batches(texts, scenes, batch_size, seed))


def build_tokenizer(data: QuickstartData, size: str, fmt: ChatFormat):
    """Step 2: a byte-level BPE of SIZES[size]'s vocabulary trained on the replies (and, for K3, the words of its
    markup), with the architecture's chat markup tokens."""
    from .scenes import QUESTION
    from .tokenization import train_tokenizer

    print(f"[2/6] tokenizer: byte-level BPE, {SIZES[size]['vocab']} tokens, {fmt.markup} tokens")
    corpus = [ex["messages"][1]["content"] for ex in data.texts]
    corpus += [f"{QUESTION} {ex['answer']}" for ex in data.scenes[:200]]
    if fmt.k3:  # K3's markup is words between its tokens (message role="assistant", think, response): merge them too
        corpus += markup_text([ex["messages"] for ex in data.texts[:100] + data.scenes[:100]], fmt.chat_kwargs)
    return train_tokenizer(corpus, vocab_size=SIZES[size]["vocab"], markup="k3" if fmt.k3 else "kimi")


def build_model(tokenizer, size: str, image_size: int, arch: str):
    """Step 3: (model, processor) of the architecture at that size, described on one line."""
    from . import KimiHybridImageProcessor, KimiHybridProcessor, KimiK3ImageProcessor, KimiK3Processor

    k3 = arch == "k3"
    if k3:
        processor = KimiK3Processor(KimiK3ImageProcessor(), tokenizer)
        model = small_k3_model(tokenizer, size, image_size)
    else:
        processor = KimiHybridProcessor(KimiHybridImageProcessor(), tokenizer)
        model = small_multimodal_model(tokenizer, size, image_size)
    tc = model.config.text_config
    k3_parts = f"; SiTU LatentMoE, Block AttnRes (blocks of {tc.attn_residual_block_size} sublayers)" if k3 else ""
    print(
        f"[3/6] model: {ARCHS[arch]}, {_parameters(model) / 1e6:.2f}M parameters; decoder {tc.layer_types} "
        f"({tc.num_experts} experts, top-{tc.num_experts_per_tok}{k3_parts}), "
        f"vision tower {model.config.vision_config.num_hidden_layers} layers"
    )
    return model, processor


def _parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def training_arguments(out: str, steps: int, batch_size: int, lr: float, device: str, seed: int, progress: bool):
    """Step 4's TrainingArguments: a cosine schedule with a short warmup, about 20 logged losses, no
    checkpoints, the batches in one_kind_batches' order (sequential sampling, partial batches dropped)."""
    from transformers import TrainingArguments

    return TrainingArguments(
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


def train_model(model, processor, data: QuickstartData, fmt: ChatFormat, args, device: str):
    """Step 4: args.max_steps Trainer steps with MuonClip (QK-Clip on); returns the LossHistory of the logged
    losses."""
    from transformers import Trainer

    from .collators import KimiHybridVisionCollator
    from .optim import MuonClip, MuonClipCallback
    from .plotting import LossHistory

    lr = args.learning_rate
    print(
        f"[4/6] training: {args.max_steps} steps x {args.per_device_train_batch_size} examples, MuonClip lr {lr}, "
        f"Trainer on {device}"
    )
    history = LossHistory()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data.train,
        data_collator=KimiHybridVisionCollator(processor, chat_template_kwargs=fmt.chat_kwargs),
        optimizer_cls_and_kwargs=(MuonClip, dict(model=model, lr=lr, weight_decay=0.01, qk_clip_tau=100.0)),
        callbacks=[history, MuonClipCallback()],
    )
    trainer.train()
    return history


def plot_loss(out: str, history, size: str, steps: int) -> str | None:
    """The loss curve as out/loss.png (None when no loss was logged)."""
    from .plotting import save_loss_plot

    if not history.losses:
        return None
    title = f"quickstart training loss ({size}, {steps} steps)"
    return save_loss_plot(os.path.join(out, "loss.png"), history.steps, history.losses, title=title)


def round_experts_to_mxfp4(model) -> float:
    """Rounds the routed experts' stacked weights (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I])
    in place to the nearest MXFP4 value, as `save_pretrained(saved_experts="mxfp4")` writes them; returns the
    largest absolute change."""
    import torch

    from .ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    change = 0.0
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                packed, scale = quantize_mxfp4(weight, name=name, exact=False)
                rounded = dequantize_mxfp4(packed, scale, dtype=weight.dtype, name=name)
                change = max(change, (rounded - weight).abs().max().item())
                weight.copy_(rounded)
    return change


def save_and_reload(model, processor, out: str, device: str, probe_example: dict, chat_kwargs: dict):
    """Step 5: save_pretrained model and processor to out/model, reload both through the Auto classes and
    check the reloaded logits match the trained model's on `probe_example` (RuntimeError past 1e-4).
    Returns (model_dir, reloaded model, reloaded processor, max logit difference)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_dir = os.path.join(out, "model")
    k3 = model.config.model_type == "kimi_k3"
    released = " (routed experts in MXFP4, as K3 is released)" if k3 else ""
    print(f"[5/6] save_pretrained -> {model_dir}{released}; reload with AutoModelForImageTextToText / AutoProcessor")
    if k3:  # the reload check below compares against the experts as saved: rounded onto the MXFP4 grid
        from .models.kimi_k3.chat_template_kimi_k3 import DEFAULT_THINKING_EFFORT, k3_chat_template

        print(f"      experts rounded to MXFP4: largest change {round_experts_to_mxfp4(model):.2e}")
        model.save_pretrained(model_dir, saved_experts="mxfp4")
        # the saved template prompts as training did (no thinking-effort preamble): serve, generate and pipelines
        # use its defaults
        template = k3_chat_template(chat_kwargs.get("thinking_effort", DEFAULT_THINKING_EFFORT))
        processor.chat_template = processor.tokenizer.chat_template = template
    else:
        model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    reloaded = AutoModelForImageTextToText.from_pretrained(model_dir).to(device).eval()  # K3: MXFP4 resident
    processor = AutoProcessor.from_pretrained(model_dir)
    model.eval()
    probe = processor(
        images=probe_example["images"],
        text=[processor.apply_chat_template(probe_example["messages"], tokenize=False, **chat_kwargs)],
        return_tensors="pt",
    ).to(device)
    with torch.no_grad():
        max_diff = (model(**probe).logits - reloaded(**probe).logits).abs().max().item()
    if max_diff > 1e-4:
        raise RuntimeError(f"the reloaded model's logits differ from the trained one's by {max_diff:.2e}")
    return model_dir, reloaded, processor, max_diff


def evaluate(model, processor, held_out: list[dict], fmt: ChatFormat, out: str, seed: int, image_size: int) -> dict:
    """Step 6: greedy text for TEXT_PROMPT, the chat about a new scene (saved as out/question.png, 3 circles +
    1 square) and the held-out counting accuracy; returns them as the summary's entries."""
    from .chat import generate_replies
    from .scenes import QUESTION, counting_accuracy, render_scene

    print("[6/6] generation with the reloaded model")
    text = generate_replies(
        model,
        processor,
        [[{"role": "user", "content": TEXT_PROMPT}]],
        max_new_tokens=48 + fmt.answer_tokens - 2,
        chat_template_kwargs=fmt.chat_kwargs,
        repetition_penalty=1.2,
    )[0]
    image = render_scene(random.Random(seed + 20_000), image_size, circles=3, squares=1)
    image.save(os.path.join(out, "question.png"))
    transcript = chat_transcript(model, processor, image, fmt.answer_tokens, fmt.chat_kwargs)
    answer = transcript.pop("answer")
    accuracy, per_count = counting_accuracy(
        model, processor, held_out, max_new_tokens=fmt.answer_tokens, chat_template_kwargs=fmt.chat_kwargs
    )
    return {
        "generated_text": text,
        "image_question": QUESTION,
        "image_true_count": 3,
        "image_answer": answer,
        "chat_transcript": transcript,
        "held_out_counting_accuracy": accuracy,
        "held_out_per_count": per_count,
        "chance": 1 / len(per_count),
    }


def loss_summary(losses: list[float]) -> dict:
    """The summary's first and last logged loss, and the mean of the last 5 (None without losses): text and
    scene batches alternate at random, so the mean is the steadier number."""
    if not losses:
        return {"first_loss": None, "last_loss": None, "last_loss_mean_of_5": None}
    return {
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "last_loss_mean_of_5": sum(losses[-5:]) / len(losses[-5:]),
    }


def write_summary(out: str, summary: dict) -> str:
    """out/summary.json, written atomically (never half written); returns its path."""
    return atomic_write(os.path.join(out, "summary.json"), json.dumps(summary, indent=2))


def print_report(result: QuickstartResult, held_out_n: int) -> None:
    """The closing report: loss, generated text, the chat, the answer about question.png, the accuracy, the paths."""
    s = result.summary
    print("\n== quickstart done in {:.0f} s ==".format(s["seconds"]))
    print(
        f"loss {s['first_loss']:.3f} -> {s['last_loss_mean_of_5']:.3f} (mean of the last 5 logs)"
        if s["first_loss"] is not None
        else "no loss logged"
    )
    print(f"generated for {TEXT_PROMPT!r}:\n    {s['generated_text'][:300]!r}")
    print(
        f"chat ({ARCHS[s['arch']]}'s format; the prompt as the template writes it, the reply as the model wrote it):"
    )
    print(f"    prompt: {s['chat_transcript']['prompt']!r}\n    reply:  {s['chat_transcript']['reply']!r}")
    image_path = os.path.join(result.out, "question.png")
    print(f"{s['image_question']} ({image_path}, 3 circles + 1 square): model answers {s['image_answer']!r}")
    print(
        f"held-out counting accuracy {s['held_out_counting_accuracy']:.2f} on {held_out_n} new scenes "
        f"(chance {s['chance']:.2f}; counting is slow to learn: examples/multimodal_finetune.py's 1500 image-only "
        "steps reach 0.83-0.89)"
    )
    print(
        f"model + processor: {result.model_dir}\nloss plot:         {result.loss_plot}\n"
        f"summary:           {result.summary_path}"
    )
    print(
        f"load it:  AutoModelForImageTextToText.from_pretrained({result.model_dir!r}) "
        "(trust_remote_code=True without kimi_hf)"
    )


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
    check_arguments(steps, batch_size, text_examples_n, image_examples_n, eval_images, size, arch)
    check_outputs(out)  # before the minutes of work, not after them
    device = _device(device)

    import torch

    t0 = time.time()
    torch.manual_seed(seed)
    torch.set_flush_denormal(True)
    os.makedirs(out, exist_ok=True)

    fmt = chat_format(arch)
    data = build_data(text_examples_n, image_examples_n, eval_images, image_size, batch_size, seed)
    tokenizer = build_tokenizer(data, size, fmt)
    model, processor = build_model(tokenizer, size, image_size, arch)
    args = training_arguments(out, steps, batch_size, lr, device, seed, progress)
    history = train_model(model, processor, data, fmt, args, device)
    loss_plot = plot_loss(out, history, size, steps)
    model_dir, reloaded, processor, max_diff = save_and_reload(
        model, processor, out, device, data.held_out[0], fmt.chat_kwargs
    )
    results = evaluate(reloaded, processor, data.held_out, fmt, out, seed, image_size)

    summary = {
        "arch": arch,
        "size": size,
        "parameters": _parameters(model),
        "steps": steps,
        "device": device,
        **loss_summary(history.losses),
        "reload_max_logit_diff": max_diff,
        **results,
        "seconds": round(time.time() - t0, 1),
    }
    result = QuickstartResult(out, model_dir, loss_plot, write_summary(out, summary), summary)
    print_report(result, len(data.held_out))
    return result


__all__ = [
    "run_quickstart",
    "check_outputs",
    "small_multimodal_model",
    "small_k3_model",
    "small_k3_config",
    "chat_transcript",
    "ARCHS",
    "text_examples",
    "SIZES",
    "QuickstartResult",
]
