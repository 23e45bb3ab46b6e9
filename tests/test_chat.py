"""Chat replies end at the end of the turn: saved generation configs stop at <|im_end|>, replies are parsed up
to it (batched pipelines pad), saved tokenizers pad on the left, and TRL fine-tunes (assistant-only loss
included) give models that stop.

Untrained models are made to write a chosen reply with `generate(sequence_bias=...)` keyed on the end of
each prompt: after the reply's <|im_end|> nothing is forced, so a model that does not stop there writes
more tokens (and the test sees them)."""

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from kimi_hf import KimiHybridForCausalLM
from kimi_hf.chat import TURN_END, chat_stop_token_ids, generate_replies
from kimi_hf.quickstart import small_multimodal_model
from kimi_hf.scenes import render_scene

from .chat_helpers import reply_bias
from .models.kimi_hybrid.helpers import tiny_config, tiny_processor, tiny_tokenizer


def chat_text_model(tok, eos=None):
    torch.manual_seed(0)
    eos = chat_stop_token_ids(tok) if eos is None else eos
    return KimiHybridForCausalLM(
        tiny_config(
            vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=eos
        )
    ).eval()


def test_stop_ids_are_eos_and_turn_end():
    tok = tiny_tokenizer()
    assert chat_stop_token_ids(tok) == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]


def test_saved_multimodal_model_stops_at_turn_end_in_generate_and_the_pipeline(tmp_path):
    """Issue: the README snippet decoded '4les' and the image-text-to-text pipeline returned 'les'."""
    proc = tiny_processor()
    tok = proc.tokenizer
    torch.manual_seed(0)
    model = small_multimodal_model(tok, "tiny", image_size=28).eval()
    model.save_pretrained(tmp_path)
    proc.save_pretrained(tmp_path)
    eos = json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"]
    assert tok.convert_tokens_to_ids(TURN_END) in eos and tok.eos_token_id in eos

    image = render_scene(random.Random(0), 28, circles=2)
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
    prompt = proc.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    bias = reply_bias(tok, [prompt], ["4"])
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert generate_replies(loaded, proc, [question], images=[image], max_new_tokens=8, sequence_bias=bias) == ["4"]

    pipe = pipeline("image-text-to-text", model=str(tmp_path))
    msgs = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "How many?"}]}]
    out = pipe(text=msgs, generate_kwargs={"max_new_tokens": 8, "sequence_bias": bias})
    assert out[0]["generated_text"][-1] == {"role": "assistant", "content": "4"}


def test_batched_image_pipeline_matches_single_runs(tmp_path):
    """Issue: the saved tokenizer padded on the right, so batched replies differed from single ones."""
    proc = tiny_processor()
    torch.manual_seed(0)
    small_multimodal_model(proc.tokenizer, "tiny", image_size=28).save_pretrained(tmp_path)
    proc.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).padding_side == "left"
    pipe = pipeline("image-text-to-text", model=str(tmp_path))
    rng = random.Random(1)
    chats = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": render_scene(rng, 28, circles=c)},
                    {"type": "text", "text": text},
                ],
            }
        ]
        for c, text in ((1, "Count."), (3, "How many circles are there in this picture, please?"))
    ]
    single = [pipe(text=c, max_new_tokens=4)[0]["generated_text"][-1] for c in chats]
    batched = [o[0]["generated_text"][-1] for o in pipe(text=chats, max_new_tokens=4, batch_size=2)]
    assert batched == single and all(m["role"] == "assistant" for m in single)


def test_batched_text_pipeline_replies_stop_and_drop_padding(tmp_path):
    """Issue: the shorter reply of a batch came back as '[PAD][PAD]...' (parsed past the turn end)."""
    tok = tiny_tokenizer.__wrapped__()  # a fresh one: not saved with a processor
    chat_text_model(tok).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    pipe = pipeline("text-generation", model=str(tmp_path))
    chats = [[{"role": "user", "content": "Hi."}], [{"role": "user", "content": "What is two plus one, spelt out?"}]]
    prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    bias = reply_bias(tok, prompts, ["yes", "three, it is three"])
    out = pipe(chats, batch_size=2, max_new_tokens=12, sequence_bias=bias)
    assert [o[0]["generated_text"][-1] for o in out] == [
        {"role": "assistant", "content": "yes"},
        {"role": "assistant", "content": "three, it is three"},
    ]


def test_parse_response_stops_at_the_turn_end():
    tok = tiny_tokenizer()
    prefix = "[PAD][PAD]<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    for text in (
        "three<|im_end|>[PAD][PAD]",
        "three[EOS][PAD]",
        "three<|im_end|><|im_assistant|>assistant<|im_middle|>more",
    ):
        assert tok.parse_response(text, prefix=prefix) == {"role": "assistant", "content": "three"}, text
    call = (
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1}'
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>[PAD]"
    )
    assert tok.parse_response(call, prefix=prefix) == {
        "role": "assistant",
        "content": "",  # always there, as in transformers' own parsed messages
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
    }
    assert tok.decode(tok("x")["input_ids"] + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == "x"


def test_processor_save_makes_a_plain_eos_model_stop_at_turn_end(tmp_path):
    proc = tiny_processor()
    chat_text_model(proc.tokenizer, eos=proc.tokenizer.eos_token_id).save_pretrained(tmp_path)
    proc.save_pretrained(tmp_path)
    eos = json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"]
    assert eos == chat_stop_token_ids(proc.tokenizer)


def test_plain_text_model_keeps_stopping_at_eos_only():
    tok = tiny_tokenizer()
    model = chat_text_model(tok, eos=tok.eos_token_id)
    assert model.generation_config.eos_token_id == tok.eos_token_id


def test_assistant_tokens_mask_covers_replies_and_their_turn_end():
    tok = tiny_tokenizer()
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Ciao"},
    ]
    enc = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "Hello<|im_end|>Ciao<|im_end|>"


def sft_rows(n: int = 8):
    return [
        {"messages": [{"role": "user", "content": f"Count to {w}."}, {"role": "assistant", "content": w}]}
        for w in ("one", "two", "three", "four")[:n]
    ]


@pytest.mark.parametrize("assistant_only_loss", [False, True])
def test_trl_sft_fine_tune_stops_at_turn_end(tmp_path, assistant_only_loss):
    """Issue: after TRL SFT the model wrote `three.<|im_end|><|im_assistant|>assistant...` to max_new_tokens;
    and assistant_only_loss=True was refused ("chat template is not training-compatible")."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    tok = tiny_tokenizer.__wrapped__()
    model = chat_text_model(tok)
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=60,
        learning_rate=1e-2,
        per_device_train_batch_size=4,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=20,
        disable_tqdm=True,
        assistant_only_loss=assistant_only_loss,
    )
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(sft_rows()), processing_class=tok)
    trainer.train()
    trainer.save_model(str(tmp_path / "model"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    tok2 = AutoTokenizer.from_pretrained(tmp_path / "model")
    prompt = tok2.apply_chat_template(
        [{"role": "user", "content": "Count to three."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = loaded.generate(**prompt, max_new_tokens=20, do_sample=False)[0, prompt["input_ids"].shape[1] :]
    assert out[-1].item() == tok2.convert_tokens_to_ids(TURN_END) and len(out) < 20
    assert tok2.decode(out, skip_special_tokens=True) == "three"
