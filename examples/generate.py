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
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer, TextStreamer

import kimi_hf  # noqa: F401  (registers the Auto classes; without it pass trust_remote_code=True)
from kimi_hf.chat import K3ReplyStreamer, has_k3_markup, reply_text


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="outputs/quickstart/model")
    p.add_argument("--prompt", default="Write some Python.")
    p.add_argument("--image", help="an image file to ask about")
    p.add_argument("--question", default="How many circles are there?")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--sample", action="store_true", help="sample (temperature 0.8, top-p 0.95) instead of greedy")
    p.add_argument("--no-stream", action="store_true")
    args = p.parse_args(argv)
    if not os.path.exists(os.path.join(args.model, "config.json")):
        raise SystemExit(f"{args.model} has no config.json: run `kimi-hf quickstart` first or pass --model")
    multimodal = json.load(open(os.path.join(args.model, "config.json")))["model_type"] in ("kimi_hybrid", "kimi_k3")
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
        if not multimodal:
            raise SystemExit("--image needs a multimodal model (model_type kimi_hybrid or kimi_k3)")
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": args.question}]}]
        prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = processor(images=[args.image], text=[prompt], return_tensors="pt")  # errors name a bad file
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
