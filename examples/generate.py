"""Generation with a saved model of this package: streamed text, and questions about images.

    python examples/generate.py                                        # the quickstart's model
    python examples/generate.py --model DIR --prompt "Write some Python." --image scene.png --question "How many circles are there?"

Loads through the Auto classes (AutoProcessor + AutoModelForImageTextToText, or AutoTokenizer +
AutoModelForCausalLM for a text-only model), streams tokens with TextStreamer, greedy by default
(--sample for temperature / top-p sampling). The hybrid cache keeps KDA's fixed-size state and MLA's
latent: memory grows only with the MLA layers.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer, TextStreamer

import kimi_hf  # noqa: F401  (registers the Auto classes; without it pass trust_remote_code=True)
from kimi_hf.chat import K3ReplyStreamer, has_k3_markup, reply_text
from kimi_hf.cli_args import ArgumentParser, check_positive
from kimi_hf.model_folder import check_model_folder
from kimi_hf.serving import served_model_types


DEFAULT_MODEL = "outputs/quickstart/model"


def check_args(args) -> bool:
    """Bad input, found before anything loads (ValueError / OSError naming the argument). Returns whether --model
    is an image-text model."""
    check_positive(args, "max_new_tokens")
    if args.model == DEFAULT_MODEL and not os.path.exists(args.model):
        raise FileNotFoundError(
            f"--model {args.model!r} does not exist: run `kimi-hf quickstart` first or pass --model"
        )
    types = served_model_types()  # the model types with a generation class, and which of them read images
    model_type = check_model_folder(args.model, what="--model", model_types=types)["model_type"]
    multimodal = "AutoModelForImageTextToText" in types[model_type]
    if args.image:
        if not multimodal:
            raise ValueError(f"--image needs an image-text model; --model {args.model!r} is a {model_type} model")
        if not os.path.isfile(args.image):
            raise FileNotFoundError(f"--image {args.image!r} does not exist or is not a file")
        from PIL import Image

        try:
            with Image.open(args.image) as img:
                img.verify()  # the header and the file's structure, without decoding the pixels
        except (OSError, SyntaxError, ValueError) as e:  # SyntaxError: how some of PIL's decoders say "corrupt"
            raise ValueError(f"--image {args.image!r} is not a readable image ({e})") from None
    return multimodal


def main(argv=None) -> dict:
    # one-line usage errors (`PROG: error: ...`, exit 2), for argparse's checks and for check_args'
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompt", default="Write some Python.")
    p.add_argument("--image", help="an image file to ask about")
    p.add_argument("--question", default="How many circles are there?")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--sample", action="store_true", help="sample (temperature 0.8, top-p 0.95) instead of greedy")
    p.add_argument("--no-stream", action="store_true")
    args = p.parse_args(argv)
    try:
        multimodal = check_args(args)
    except (ValueError, TypeError, OSError) as e:
        p.error(" ".join(str(e).split()))
    if multimodal:
        model, processor = (
            AutoModelForImageTextToText.from_pretrained(args.model),
            AutoProcessor.from_pretrained(args.model),
        )
        tokenizer = processor.tokenizer
    else:
        model, processor = AutoModelForCausalLM.from_pretrained(args.model), None
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    model.eval()
    sampling = dict(do_sample=True, temperature=0.8, top_p=0.95) if args.sample else dict(do_sample=False)
    k3 = has_k3_markup(tokenizer)  # Kimi K3's chat format: the reply is its response channel

    def streamer(prompt):
        if args.no_stream:
            return None
        if k3:
            return K3ReplyStreamer(tokenizer, prefix=prompt)
        return TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)

    def reply(ids, prompt) -> str:
        text = reply_text(tokenizer, ids, prompt)
        # K3: as the streamer shows it, the response channel up to markup it could not parse
        return text.split("<|")[0].strip() if k3 else text

    results = {}
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True
    )
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    print(f"> {args.prompt}")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=args.max_new_tokens, streamer=streamer(text), repetition_penalty=1.2, **sampling
        )
    results["text"] = reply(out[0, inputs["input_ids"].shape[1] :], text)
    if args.no_stream:
        print(results["text"])

    if args.image:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": args.question}]}]
        prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = processor(images=[args.image], text=[prompt], return_tensors="pt")
        print(f"\n> [{args.image}] {args.question}")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=24 if k3 else 8, streamer=streamer(prompt), **sampling)
        results["answer"] = reply(out[0, inputs["input_ids"].shape[1] :], prompt)
        if args.no_stream:
            print(results["answer"])
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
