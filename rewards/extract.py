"""Pull a final answer out of free-form model text.

Plain regex/string code with no third-party imports, shared by the built-in rewards.
"""

from __future__ import annotations

import re

_BOXED_OPENING = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# A minus sign or digit glued to a word ("x2", "10-3") is not the start of a number; a comma group
# must be exactly three digits so "1,2345" is not read as 1234.
_NUMBER = re.compile(
    r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
    r"|(?<![\w.])-?\.\d+"
)
_ANSWER_PREFIX = re.compile(
    r"^\s*(?:\*\*)?(?:final\s+answer|the\s+answer\s+is|answer)\b\s*(?:\*\*)?\s*[:=\-]?\s*(?:\*\*)?\s*",
    re.IGNORECASE,
)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) whose braces balance."""
    for opening in reversed(list(_BOXED_OPENING.finditer(text))):
        content = _balanced_group(text, opening.end())
        if content is not None:
            return content.strip()
    return None


def _balanced_group(text: str, start: int) -> str | None:
    depth = 1
    index = start
    while index < len(text):
        char = text[index]
        if char == "\\":
            # `\{` and `\}` are literal braces in LaTeX, not grouping.
            index += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:index]
        index += 1
    return None


def after_hashes(text: str) -> str | None:
    """The rest of the line after the last `####` (GSM8K's answer marker)."""
    _, marker, tail = text.rpartition("####")
    if not marker:
        return None
    lines = tail.strip().splitlines()
    return lines[0].strip() if lines else ""


def last_answer_tag(text: str) -> str | None:
    """Content of the last `<answer>...</answer>` pair."""
    contents = _ANSWER_TAG.findall(text)
    return contents[-1].strip() if contents else None


def last_number(text: str) -> str | None:
    """The last number in the text, with thousands separators removed ("1,234" -> "1234")."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def last_line(text: str) -> str | None:
    """The last non-empty line, without a leading "Answer:" / "Final answer:" style prefix."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    return _ANSWER_PREFIX.sub("", lines[-1], count=1).strip()


def extract_answer(text: str) -> str | None:
    """The model's final answer: last `\\boxed{}`, else after `####`, else `<answer>` tags, else the
    last number. None when the text has none of these."""
    for extractor in (last_boxed, after_hashes, last_answer_tag, last_number):
        found = extractor(text)
        if found is not None:
            return found
    return None


def gold_answer(answer: str) -> str:
    """The reference answer of a dataset row: text after `####` (GSM8K style), else the whole string."""
    after_marker = after_hashes(answer)
    return (after_marker if after_marker is not None else answer).strip()
