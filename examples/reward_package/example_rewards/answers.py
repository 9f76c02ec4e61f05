"""Reward functions written to TRL's contract, the one rlpipe calls them by: keyword arguments, one list entry per
sample, `**kwargs` for everything a function does not use, one score per sample back (None: cannot score).

Completions arrive as text for a plain-text dataset and as `[{"role": "assistant", "content": text}]` for a
conversational one (chat-message prompts); both are read here.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    return "".join(message.get("content") or "" for message in completion if message.get("role") == "assistant")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def final_number(completions, solution, **kwargs):
    """1.0 when the last number in the completion equals the `solution` column's number, else 0.0; None for a row
    whose solution is not a number."""
    scores = []
    for completion, expected in zip(completions, solution):
        gold = _number(str(expected).strip())
        if gold is None:
            scores.append(None)
            continue
        found = _NUMBER.findall(_text(completion))
        scores.append(1.0 if found and _number(found[-1]) == gold else 0.0)
    return scores


def brevity(completion_ids, target_tokens=128, **kwargs):
    """1.0 for an empty completion down to 0.0 at `target_tokens` tokens and beyond (a recipe sets `target_tokens`
    in the function's kwargs)."""
    return [max(0.0, 1.0 - len(ids) / target_tokens) for ids in completion_ids]
