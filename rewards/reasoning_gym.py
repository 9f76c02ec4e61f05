"""Built-in reward for reasoning-gym datasets, scored by reasoning-gym's own per-dataset scorer.

Answer extraction, in order:
  1. the last `<answer>...</answer>` — the format reasoning-gym prompts ask for; when present it is the
     only candidate, since the model stated its answer explicitly;
  2. else the last `\\boxed{...}`, likewise the only candidate;
  3. else the last non-empty line without an "Answer:"-style prefix, and, if the scorer does not accept
     that line, the last number in the completion (for "... so the result is 42." endings).
The reward is binary: 1.0 only when the scorer gives exactly 1.0. Many scorers grant partial credit for
answers that merely contain the reference, which a policy learns to exploit by padding its answer.
An entry whose answer is an integer takes only candidates that write an integer plainly
(`rlpipe.rewards.extract.integer_literal`): scorers that compare floats would accept "5E1" or "50.0" for 50.
`strict_integers=False` leaves every candidate to the scorer.
A candidate that writes a number too costly to compute (`rlpipe.rewards.extract.explosive_number`: `9**9**9`,
`1e9999999`) is wrong without reaching the scorer: several scorers hand the answer to sympy, which would compute it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

try:
    import reasoning_gym
except ModuleNotFoundError as err:  # an optional dependency: say which extra brings it
    if err.name != "reasoning_gym":
        raise
    raise ModuleNotFoundError(
        "this reward needs the 'reasoning-gym' extra, which is not installed: pip install 'rlpipe[reasoning-gym]'",
        name="reasoning_gym",
    ) from None

from rlpipe.rewards.contract import completion_text
from rlpipe.rewards.extract import explosive_number, integer_literal, last_answer_tag, last_boxed, last_line
from rlpipe.rewards.extract import last_number

logger = logging.getLogger("rewards")


def verifier(
    completions: list, entry: list[Any], task: str | None = None, strict_integers: bool = True, **_: Any
) -> list[float]:
    """1.0 when reasoning-gym's scorer fully accepts the completion's answer for that entry, else 0.0.

    `entry` holds reasoning-gym entries (dicts with `question`, `answer`, `metadata`), or their JSON text, as
    datasets often store the heterogeneous `metadata` serialized. The scorer is that of the task named by
    `task` (any reasoning-gym dataset name), by default the entry's `metadata.source_dataset`. An answer the
    scorer cannot parse (it raises) is wrong: 0.0. With `strict_integers`, see the module's docstring.
    """
    return [
        _score(completion_text(completion), _as_entry(item), task, strict_integers)
        for completion, item in zip(completions, entry, strict=True)
    ]


def _score(completion: str, entry: Mapping[str, Any], task: str | None, strict_integers: bool) -> float:
    score_answer = _scorer(task or entry["metadata"]["source_dataset"])
    candidates = [candidate for candidate in _candidates(completion) if not explosive_number(candidate)]
    if strict_integers and integer_literal(str(entry.get("answer"))) is not None:
        candidates = [candidate for candidate in candidates if integer_literal(candidate) is not None]
    return float(any(_accepts(score_answer, candidate, entry) for candidate in candidates))


def _accepts(score_answer: Callable[[str | None, dict], float], candidate: str, entry: Mapping[str, Any]) -> bool:
    # Some scorers raise on answers they cannot parse (prime_factorization on words): that answer is wrong, and
    # scoring it 0 rather than None keeps the policy from escaping the task's reward by writing garbage.
    try:
        return score_answer(candidate, entry) == 1.0
    except Exception:
        logger.debug("reasoning-gym scorer raised on answer %r", candidate, exc_info=True)
        return False


def _candidates(completion: str) -> list[str]:
    for explicit in (last_answer_tag, last_boxed):
        found = explicit(completion)
        if found is not None:
            return [found]
    return [found for found in (last_line(completion), last_number(completion)) if found is not None]


@lru_cache(maxsize=None)
def _scorer(dataset_name: str) -> Callable[[str | None, dict], float]:
    # The scorer is a method of a dataset built with its default config; building one per dataset name
    # once is the cheapest correct way (the scorers read what they need from the entry).
    return reasoning_gym.get_score_answer_fn(dataset_name)


def _as_entry(item: Any) -> Mapping[str, Any]:
    return json.loads(item) if isinstance(item, str) else item
