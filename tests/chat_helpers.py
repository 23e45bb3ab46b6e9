"""Making untrained models write a chosen reply (test_chat, test_serving)."""

from kimi_hf.chat import TURN_END


def reply_bias(tok, prompts: list[str], replies: list[str], context: int = 12) -> dict:
    """sequence_bias that makes each prompt (text with the generation prompt) continue with its reply and
    then <|im_end|>; keyed on the prompt's last `context` tokens, so different prompts get different replies."""
    end = tok.convert_tokens_to_ids(TURN_END)
    bias = {}
    for prompt, reply in zip(prompts, replies):
        head = tok(prompt, add_special_tokens=False)["input_ids"][-context:]
        ids = tok(reply, add_special_tokens=False)["input_ids"] + [end]
        bias.update({tuple(head + ids[: i + 1]): 100.0 for i in range(len(ids))})
    return bias
