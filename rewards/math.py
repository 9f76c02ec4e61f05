"""Built-in rewards for math problems with a single final answer (GSM8K, MATH style datasets).

The model's answer is taken from the completion by `rlpipe.rewards.extract.extract_answer` (last `\\boxed{}`,
else after `####`, else `<answer>` tags, else the last number); the reference from the `answer` column
(after `####` if present, else the whole string).

An integer reference accepts an integer written plainly only (`rlpipe.rewards.extract.integer_literal`: "50",
" 50 ", "50.", "1,000"), not another spelling of its value ("50.0", "5E1", "0x32", "50/1", "\\frac{100}{2}"), so
that a policy cannot earn the reward with a notation that hides the number; `strict_integers=False` compares
such answers by value.

An answer whose value is costly to compute scores 0, decided from its text in microseconds before any Fraction,
sympy or math-verify work (`rlpipe.rewards.extract.costly_answer`: `9^{9^{9^{9}}}`, `1e9999999`, a 50-deep
`\\frac`): such work cannot be interrupted, so it would take a reward call's whole time limit, and leaving the
sample unscored would never teach the policy not to write it.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from math_verify import parse, verify

from rlpipe.rewards.contract import completion_text
from rlpipe.rewards.extract import costly_answer, extract_answer, gold_answer, integer_literal

# Plain numbers are compared exactly, up to float printing noise (0.30000000000000004 == 0.3); a looser
# relative tolerance would accept a wrong last digit in a large integer.
_FLOAT_NOISE = 1e-9


def numeric_answer(
    completions: list, answer: list[Any], strict_integers: bool = True, **_: Any
) -> list[float | None]:
    """1.0 when the extracted answer equals the reference numerically or symbolically (`\\frac{1}{2}` ==
    `0.5`), else 0.0; None for a row without a reference answer. With `strict_integers` an integer reference
    takes an integer written plainly only (see the module's docstring)."""
    return [
        None
        if gold is None
        else float(_equivalent(extract_answer(completion_text(c)), gold_answer(str(gold)), strict_integers))
        for c, gold in zip(completions, answer, strict=True)
    ]


def exact_match(completions: list, answer: list[Any], **_: Any) -> list[float | None]:
    """1.0 when the extracted answer equals the reference string exactly (after stripping), else 0.0;
    None for a row without a reference answer."""
    scores: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        if gold is None:
            scores.append(None)
            continue
        predicted = extract_answer(completion_text(completion))
        scores.append(float(predicted is not None and predicted.strip() == gold_answer(str(gold))))
    return scores


def _equivalent(predicted: str | None, gold: str, strict_integers: bool = True) -> bool:
    if predicted is None:
        return False
    gold_integer = integer_literal(gold) if strict_integers else None
    if gold_integer is not None:
        return integer_literal(predicted) == gold_integer
    if costly_answer(predicted):
        return False
    predicted_number, gold_number = _as_number(predicted), _as_number(gold)
    if predicted_number is not None and gold_number is not None:
        # Two plain numbers: skip sympy, which is orders of magnitude slower and agrees here.
        return predicted_number == gold_number or math.isclose(
            predicted_number, gold_number, rel_tol=_FLOAT_NOISE, abs_tol=_FLOAT_NOISE
        )
    return _math_verify_equal(predicted, gold)


def _as_number(text: str) -> Fraction | None:
    cleaned = text.strip().replace(",", "").replace("\\$", "").replace("$", "").rstrip(".").strip()
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def _math_verify_equal(predicted: str, gold: str) -> bool:
    # Timeouts off: math-verify's own timeout uses signal.alarm, which raises outside the main thread, and could
    # not end sympy stuck in C anyway; the reward runner bounds each call and kills the process that overruns.
    # Wrapping in \boxed{} makes math-verify read the whole extracted string as one LaTeX expression ("x+1" is
    # not found in bare text).
    parsed_gold = parse(_as_boxed(gold), parsing_timeout=None)
    parsed_predicted = parse(_as_boxed(predicted), parsing_timeout=None)
    if not parsed_gold or not parsed_predicted:
        return False
    return verify(parsed_gold, parsed_predicted, timeout_seconds=None)


def _as_boxed(answer: str) -> str:
    # Dollar signs are either math delimiters or currency; neither may end up inside \boxed{}.
    return "\\boxed{" + answer.replace("\\$", "").replace("$", "") + "}"
