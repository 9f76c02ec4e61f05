"""Chat-templated text to token ids with the messages' own texts kept as text: the template's markers (`<|im_start|>`,
`<|im_end|>`) are the special tokens they are, while a special token's text inside a message (a tool's answer that
prints `<|im_end|>`, a dataset row that holds one) is tokenized as plain text, so it cannot end a turn or open one.
Pure functions of a tokenizer and text; it imports nothing of rlpipe."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

# Stands in for a held-back text in the rendered conversation: private-use characters, which no template writes.
_HELD = re.compile("(\ue000[0-9]+\ue001)")


def special_token_texts(tokenizer) -> list[str]:
    """The texts the tokenizer reads as one special token wherever they appear: its added tokens marked special (what
    transformers' `split_special_tokens` tokenizes as text instead)."""
    return [token.content for token in tokenizer.added_tokens_decoder.values() if token.special and token.content]


def valid_text(text: str) -> str:
    """`text` with each lone surrogate (a JSON escape such as "\\ud800", or undecodable bytes read with Python's
    surrogateescape) replaced by U+FFFD: a tokenizer refuses such a string, and UTF-8 cannot carry it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def touches_special_token(text: str, specials: list[str]) -> bool:
    """Whether `text`, rendered between other text, can make part of a special token: it holds a special token's text,
    lies inside one, or begins with the end of one or ends with the beginning of one."""
    if not text or not specials:
        return False
    whole, heads, tails, longest = _special_pieces(tuple(specials))
    if whole.search(text) or (len(text) < longest and any(text in special for special in specials)):
        return True
    return any(text[-size:] in heads or text[:size] in tails for size in range(1, min(longest, len(text) + 1)))


@functools.lru_cache(maxsize=8)
def _special_pieces(specials: tuple[str, ...]) -> tuple[re.Pattern, set[str], set[str], int]:
    """For touches_special_token, once per tokenizer: a pattern finding any special token's text, the beginnings and
    the ends of those texts, the longest's length."""
    whole = re.compile("|".join(re.escape(special) for special in sorted(specials, key=len, reverse=True)))
    heads = {special[:cut] for special in specials for cut in range(1, len(special))}
    tails = {special[cut:] for special in specials for cut in range(1, len(special))}
    return whole, heads, tails, max(len(special) for special in specials)


def kept_contents(messages: list[dict], keep: Callable[[str], str]) -> list[dict]:
    """The messages with each one's content passed through `keep` (templated_ids)."""
    return [{**message, "content": keep(message["content"])} if "content" in message else message
            for message in messages]


def templated_ids(tokenizer, render: Callable[[Callable[[str], str]], str], texts_as_text: bool = True) -> list[int]:
    """Token ids of the text `render(keep)` returns. `render` builds a conversation, passing each text that is not
    the template's own (a tool's answer or name, a prompt's message) through `keep`, and renders it with the chat
    template. Each kept text that could make part of a special token is held back while the template renders and
    tokenized alone as plain text; the rest is tokenized as the tokenizer reads it, markers included. Texts that
    could not reach a special token are rendered in place, so their ids are what tokenizing the whole text gives.
    `texts_as_text` False: no text is held back (a special token's text in a message reads as the token)."""
    if not texts_as_text:
        return tokenizer(valid_text(render(lambda text: text)), add_special_tokens=False)["input_ids"]
    specials = special_token_texts(tokenizer)
    held: dict[str, str] = {}

    def keep(text):
        # A text holding the marker's first character is held back too, so no marker is forged.
        if not isinstance(text, str) or not (touches_special_token(text, specials) or "\ue000" in text):
            return text
        marker = f"\ue000{len(held)}\ue001"
        held[marker] = text
        return marker

    text = render(keep)
    if not held:
        return tokenizer(valid_text(text), add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    for part in _HELD.split(text):
        if part in held:
            ids += tokenizer(valid_text(held[part]), add_special_tokens=False, split_special_tokens=True)["input_ids"]
        elif part:
            ids += tokenizer(valid_text(part), add_special_tokens=False)["input_ids"]
    return ids
