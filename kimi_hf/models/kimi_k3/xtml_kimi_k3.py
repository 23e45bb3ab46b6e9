"""Kimi K3's XTML markup, its token table: the tokens K3's tokenizer adds (by offset from its BPE ranks) and the
markup's elements built from them, for the chat template (chat_template_kimi_k3.py), the reply parser
(reply_parser_kimi_k3.py) and the tiktoken reader (tokenization_kimi_k3.py).

XTML's own tokens are declared here: `<|open|>` TAG attributes `<|sep|>` ... `<|close|>` TAG `<|sep|>`, and
`<|end_of_msg|>` after every message. The document tokens ([BOS], [EOS], [PAD], [UNK]) and the media tokens are
Kimi's, declared in chat_markup_kimi_hybrid.py (K3's tokenizer has the same strings) and imported from there.

Part of the flat, Hub-copyable model folder: imports only chat_markup_kimi_hybrid.py.
"""

from __future__ import annotations

from ..kimi_hybrid.chat_markup_kimi_hybrid import BOS, EOS, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, PAD, UNK
from ..kimi_hybrid.chat_markup_kimi_hybrid import IMAGE_TOKEN as MEDIA_PAD


OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
K3_STOP_TOKEN = END_OF_MSG  # K3's config eos (163586): the end of every message; the tokenizer's own eos is [EOS]
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"  # plain text, not a token (it may merge with a following "\n")
XTML_TOKENS = [END_OF_MSG, OPEN, CLOSE, SEP]  # in K3's id order (offsets 2..5)
K3_MEDIA_TOKENS = [MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD]  # in K3's id order (offsets 18..21)
# Kimi K3's added tokens by offset from the number of BPE ranks (163584 in the released tiktoken.model):
# offset -> (content, special); the offsets not listed are `<|reserved_token_{id}|>` (special). The one table:
# tokenization_kimi_k3 builds K3's fast tokenizer from it. Tokens no markup uses are named only here.
K3_TOKEN_OFFSETS = {
    0: (BOS, True),
    1: (EOS, True),  # the tokenizer's eos: end of document
    2: (END_OF_MSG, True),  # end of a chat message: K3's config / generation eos
    3: (OPEN, True),
    4: (CLOSE, False),  # not special: `<|close|>message<|sep|>` survives skip_special_tokens
    5: (SEP, False),
    6: ("[start_header_id]", True),
    7: ("[end_header_id]", True),
    9: ("[EOT]", True),
    18: (MEDIA_BEGIN, True),
    19: (MEDIA_CONTENT, True),
    20: (MEDIA_END, True),
    21: (MEDIA_PAD, True),  # the image placeholder (media_placeholder_token_id)
    65: ("<osagent_mode>", True),
    254: (UNK, True),
    255: (PAD, True),
}
# the markup's elements, as the encoder writes them
ASSISTANT_HEADER = OPEN + 'message role="assistant"' + SEP
THINK_OPEN, THINK_CLOSE = OPEN + "think" + SEP, CLOSE + "think" + SEP
RESPONSE_OPEN, RESPONSE_CLOSE = OPEN + "response" + SEP, CLOSE + "response" + SEP
MESSAGE_CLOSE = CLOSE + "message" + SEP
GENERATION_PROMPT = ASSISTANT_HEADER + THINK_OPEN  # with thinking off: ASSISTANT_HEADER + RESPONSE_OPEN


__all__ = [
    "OPEN",
    "CLOSE",
    "SEP",
    "END_OF_MSG",
    "K3_STOP_TOKEN",
    "IMAGE_PLACEHOLDER",
    "XTML_TOKENS",
    "K3_MEDIA_TOKENS",
    "K3_TOKEN_OFFSETS",
    "MEDIA_BEGIN",
    "MEDIA_CONTENT",
    "MEDIA_END",
    "MEDIA_PAD",
    "ASSISTANT_HEADER",
    "THINK_OPEN",
    "THINK_CLOSE",
    "RESPONSE_OPEN",
    "RESPONSE_CLOSE",
    "MESSAGE_CLOSE",
    "GENERATION_PROMPT",
]
