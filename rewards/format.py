"""Format rewards: does the completion have the required shape (a pattern, or tags in a given order)?"""

from __future__ import annotations

import re
from collections.abc import Sequence

from rlpipe.rewards.contract import completion_text


def regex(completions: list, pattern: str, full: bool = False, **_: object) -> list[float]:
    """1.0 where `pattern` is found in the completion (with `full`, where it matches the whole completion)."""
    compiled = re.compile(pattern, re.DOTALL)
    match = compiled.fullmatch if full else compiled.search
    return [1.0 if match(completion_text(completion)) else 0.0 for completion in completions]


def tags(completions: list, names: Sequence[str] = ("think", "answer"), **_: object) -> list[float]:
    """1.0 where the completion is exactly the tags in `names`, in that order, each once and not nested in
    itself, with only whitespace around them: by default `<think>...</think><answer>...</answer>`."""
    parts = [rf"<{name}>(?:(?!</?{name}>).)*</{name}>" for name in names]
    compiled = re.compile(r"\s*" + r"\s*".join(parts) + r"\s*", re.DOTALL)
    return [1.0 if compiled.fullmatch(completion_text(completion)) else 0.0 for completion in completions]
