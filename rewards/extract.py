"""Pull a final answer out of free-form model text.

Plain regex/string code with no third-party imports, shared by the built-in rewards. Every extractor takes time
linear in the text: a completion is model output, and a megabyte of unclosed `\\boxed{` must not stall a worker.
So does the check of whether an answer is too costly to compare by value (`costly_answer`, `explosive_number`).
"""

from __future__ import annotations

import re

# One pass over the text: a box's opening, an escaped character (`\{` is a literal brace in LaTeX), a brace.
_BRACE_TOKEN = re.compile(r"(\\(?:boxed|fbox)\s*\{)|\\.|[{}]", re.DOTALL)
_ANSWER_OPENING = re.compile(r"<answer>", re.IGNORECASE)
_ANSWER_CLOSING = re.compile(r"</answer>", re.IGNORECASE)
# A minus sign or digit glued to a word ("x2", "10-3") is not the start of a number; a comma group
# must be exactly three digits so "1,2345" is not read as 1234. A number may not run on into more of a numeral
# ("5E1", "0x32", "1.5e3"): a part of one is no number (the lookahead also keeps backtracking from taking the "5"
# of "55E1").
_NUMBER = re.compile(
    r"(?:(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
    r"|(?<![\w.])-?\.\d+)"
    r"(?!\.?\d|,\d|[eE][+-]?\d|[xXbBoO][0-9a-fA-F])"
)
# Any numeral, plain or not ("1.5e3", "0x32" too): the last one is the text's final number, or there is none.
_NUMERAL = re.compile(r"(?<![\w.])-?(?:0[xXbBoO][0-9a-fA-F]+|\d[\d,]*(?:\.\d+)?(?:[eE][+-]?\d+)?|\.\d+)")
# An integer written plainly: digits, a sign, thousands separators, a full stop ending the sentence.
_INTEGER_LITERAL = re.compile(r"([+-]?)(\d{1,3}(?:,\d{3})+|\d+)\.?")
# An exponent of scientific notation (`1e9999999`: Fraction builds the ten-million-digit power of ten); a decimal
# numeral's, not the digits of a hexadecimal one (`0x9e6436`).
_SCIENTIFIC_EXPONENT = re.compile(r"(?<![\w.])(?:\d+(?:\.\d*)?|\.\d+)[eE][+-]?(\d+)")
# A power (LaTeX's `^`, Python's `**`) or a factorial (not LaTeX's `\!`, nor `!=`): the operations whose value can
# outgrow any time limit from a few characters.
_GROWTH = re.compile(r"\^|\*\*|(?<!\\)!(?!=)")
_DIGITS = re.compile(r"\d+")
_COMMAND = re.compile(r"\\[a-zA-Z]+")
_VARIABLE = re.compile(r"[a-zA-Z]")
_OPENING, _CLOSING = "([{", ")]}"

MAX_ANSWER_CHARS = 500
"""Longer answers are no number or expression a task asks for; math-verify takes seconds over 1000 characters of sum."""
MAX_NESTING = 8
"""Brackets within brackets: math-verify's cost grows with each level (a 14-deep `\\frac` took seconds, 20 deep
minutes)."""
MAX_GROWTH_DIGITS = 3
"""Digits of a number in an exponent (`2^{999}`), of a factorial's operand (`999!`) and of a scientific exponent
(`1e999`): a few thousand digits of result at most."""
_ANSWER_PREFIX = re.compile(
    r"^\s*(?:\*\*)?(?:final\s+answer|the\s+answer\s+is|answer)\b\s*(?:\*\*)?\s*[:=\-]?\s*(?:\*\*)?\s*",
    re.IGNORECASE,
)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) whose braces balance."""
    # Brace matching with a stack, once through the text: each box's closing brace is found as its group ends,
    # rather than by scanning on from every opening (quadratic in a text of many unclosed boxes).
    open_groups: list[int | None] = []  # per open brace: where its box's content starts, None for a plain brace
    last: tuple[int, int] | None = None
    for token in _BRACE_TOKEN.finditer(text):
        if token.group(1) is not None:
            open_groups.append(token.end())
        elif token.group() == "{":
            open_groups.append(None)
        elif token.group() == "}" and open_groups:
            content_start = open_groups.pop()
            if content_start is not None and (last is None or content_start > last[0]):
                last = (content_start, token.start())
    return None if last is None else text[last[0] : last[1]].strip()


def after_hashes(text: str) -> str | None:
    """The rest of the line after the last `####` (GSM8K's answer marker)."""
    _, marker, tail = text.rpartition("####")
    if not marker:
        return None
    lines = tail.strip().splitlines()
    return lines[0].strip() if lines else ""


def last_answer_tag(text: str) -> str | None:
    """Content of the last `<answer>...</answer>` pair: from the last `<answer>` that a `</answer>` follows to the
    first `</answer>` after it."""
    closings = [match.start() for match in _ANSWER_CLOSING.finditer(text)]
    if not closings:
        return None
    openings = [match.end() for match in _ANSWER_OPENING.finditer(text, 0, closings[-1])]
    if not openings:
        return None
    closing = _ANSWER_CLOSING.search(text, openings[-1])
    return text[openings[-1] : closing.start()].strip()


def last_number(text: str) -> str | None:
    """The last number in the text, with thousands separators removed ("1,234" -> "1234"). None when the text's last
    numeral is not a plain number ("... 500 each, so 1.5e3"): never a number written before it."""
    last = None
    for last in _NUMBER.finditer(text):
        pass
    if last is None:
        return None
    final = None
    for final in _NUMERAL.finditer(text, last.start()):
        pass
    if final is not None and final.start() > last.start():
        return None
    return last.group().replace(",", "")


def last_line(text: str) -> str | None:
    """The last non-empty line, without a leading "Answer:" / "Final answer:" style prefix."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    return _ANSWER_PREFIX.sub("", lines[-1], count=1).strip()


def _without_unit(text: str) -> str:
    """`text` less a final `\\text{...}` (or `\\mbox`, `\\mathrm`) holding no braces; found by position, not a
    backtracking pattern, so that a long text costs one pass."""
    stripped = text.rstrip()
    if stripped.endswith("}"):
        for command in ("\\text{", "\\mbox{", "\\mathrm{"):
            start = stripped.rfind(command)
            inside = stripped[start + len(command):-1]
            if start >= 0 and "{" not in inside and "}" not in inside:
                return stripped[:start]
    return text


def integer_literal(text: str) -> str | None:
    """The integer `text` writes plainly, as canonical digits ("-50"): digits with an optional sign, thousands
    separators, dollar signs, surrounding whitespace and a full stop ending a sentence ("50", " 50 ", "$1,000",
    "+7", "50."). None for anything else, other spellings of an integer's value among them ("50.0", "5E1",
    "0x32", "50/1", "\\frac{100}{2}"): an integer answer is expected to be written as one."""
    # LaTeX's thousands separators ("1{,}000", "1,\\!000", "1\\,000") read as plain commas; a unit after the number
    # ("18 \\text{ dollars}") is not part of it.
    text = _without_unit(text.replace("{,}", ",").replace(",\\!", ",").replace("\\,", ","))
    match = _INTEGER_LITERAL.fullmatch(text.replace("\\$", "").replace("$", "").strip())
    if match is None:
        return None
    digits = match.group(2).replace(",", "").lstrip("0") or "0"
    return "-" + digits if match.group(1) == "-" and digits != "0" else digits


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


def explosive_number(text: str) -> bool:
    """Whether `text` writes a number too costly to compute, for Fraction, sympy or a scorer: a power or factorial in
    another's base or exponent (`9^{9^{9}}`, `(9^{99})^{99}`, `9**9**9`, `(9!)!`), a number of more than
    MAX_GROWTH_DIGITS digits in an exponent or as a factorial's operand (`2^{1000}`, `1000!`), a factorial of a
    bracketed expression of numbers alone (`(9*9*9*9)!`), a scientific exponent of more than MAX_GROWTH_DIGITS
    digits (`1e9999999`). Decided from the text alone; `x^{2}`, `n!`, `(n+1)!` and `1.5e-3` are not."""
    if any(len(match.group(1)) > MAX_GROWTH_DIGITS for match in _SCIENTIFIC_EXPONENT.finditer(text)):
        return True
    groups = _bracket_groups(text)
    return any(_explosive(text, operation, groups) for operation in _GROWTH.finditer(text))


def costly_answer(text: str) -> bool:
    """Whether comparing `text` by value (Fraction, sympy, math-verify) may cost more than a reward call should:
    longer than MAX_ANSWER_CHARS, brackets nested deeper than MAX_NESTING, or an explosive_number. Decided in
    microseconds, before any such work."""
    return len(text) > MAX_ANSWER_CHARS or _nesting(text) > MAX_NESTING or explosive_number(text)


def _explosive(text: str, operation: re.Match, groups: dict[int, int]) -> bool:
    before = text[_operand_start(text, operation.start(), groups) : operation.start()]
    if operation.group() == "!":
        return _grows(before) or _bracketed_numbers(before)
    if not before.strip():  # no base, no power: Markdown's bold (`**1234**`)
        return False
    after_end = _operand_end(text, operation.end(), groups)
    exponent = text[operation.end() : after_end]
    tower = _GROWTH.match(text, _skip(text, after_end)) is not None  # `a^b^c`, `a**b**c`: raised to a power
    return _GROWTH.search(before) is not None or _grows(exponent) or tower


def _grows(operand: str) -> bool:
    """Whether an exponent or a factorial's operand holds a power or factorial itself, or a number of more than
    MAX_GROWTH_DIGITS digits."""
    return _GROWTH.search(operand) is not None or any(
        len(digits) > MAX_GROWTH_DIGITS for digits in _DIGITS.findall(operand)
    )


def _bracketed_numbers(operand: str) -> bool:
    """Whether a factorial's operand is a bracketed expression of numbers alone, whose value may be of any size (one
    with a variable stays symbolic)."""
    has_number = _DIGITS.search(operand) is not None
    return operand.rstrip()[-1:] in _CLOSING and has_number and _VARIABLE.search(_COMMAND.sub("", operand)) is None


def _nesting(text: str) -> int:
    """How deep brackets of any kind nest (`[0, 1)` opens with one kind and closes with another)."""
    depth = deepest = 0
    for character in text:
        if character in _OPENING:
            depth += 1
            deepest = max(deepest, depth)
        elif character in _CLOSING:
            depth = max(0, depth - 1)
    return deepest


def _bracket_groups(text: str) -> dict[int, int]:
    """Each bracket's partner, both ways: opening position -> closing position and back (any kinds pair, as in
    intervals); an unclosed opening's partner is the end of the text."""
    partners: dict[int, int] = {}
    open_at: list[int] = []
    for position, character in enumerate(text):
        if character in _OPENING:
            open_at.append(position)
        elif character in _CLOSING and open_at:
            opening = open_at.pop()
            partners[opening], partners[position] = position, opening
    for opening in open_at:
        partners[opening] = len(text)
    return partners


def _skip(text: str, position: int) -> int:
    """`position` past any whitespace."""
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def _operand_start(text: str, end: int, groups: dict[int, int]) -> int:
    """Where the operand ending at `end` starts: a bracketed group's opening, else the start of the run of word
    characters, dots and factorials before it."""
    end_of_operand = end
    while end_of_operand and text[end_of_operand - 1].isspace():
        end_of_operand -= 1
    if end_of_operand and text[end_of_operand - 1] in _CLOSING and end_of_operand - 1 in groups:
        return groups[end_of_operand - 1]
    start = end_of_operand
    while start and (text[start - 1].isalnum() or text[start - 1] in "._!"):
        start -= 1
    return start


def _operand_end(text: str, start: int, groups: dict[int, int]) -> int:
    """Where the operand starting at `start` ends: after a sign, a bracketed group, else a LaTeX command or a run of
    word characters and dots."""
    position = _skip(text, start)
    if position < len(text) and text[position] in "+-":
        position = _skip(text, position + 1)
    if position < len(text) and text[position] in _OPENING:
        return min(groups[position] + 1, len(text))
    end = position + 1 if position < len(text) and text[position] == "\\" else position
    while end < len(text) and (text[end].isalnum() or text[end] in "._"):
        end += 1
    return end
