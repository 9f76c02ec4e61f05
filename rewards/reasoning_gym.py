"""Built-in reward for reasoning-gym datasets, scored by reasoning-gym's own per-dataset scorer.

Answer extraction, in order:
  1. the last `<answer>...</answer>` — the format reasoning-gym prompts ask for; when present it is the
     only candidate, since the model stated its answer explicitly;
  2. else the last `\\boxed{...}`, likewise the only candidate;
  3. else the last non-empty line without an "Answer:"-style prefix, and, if the scorer does not accept
     that line, the last number in the completion (for "... so the result is 42." endings).
The reward is binary: 1.0 only when the scorer gives exactly 1.0. Many scorers grant partial credit for
answers that merely contain the reference, which a policy learns to exploit by padding its answer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

import reasoning_gym

from rewards.extract import last_answer_tag, last_boxed, last_line, last_number

logger = logging.getLogger("rewards")


def verifier(prompts: list[str], completions: list[str], entry: list[Any], **_: Any) -> list[float | None]:
    """1.0 when reasoning-gym's scorer fully accepts the completion's answer for that entry, else 0.0.

    `entry` holds reasoning-gym entries (dicts with `question`, `answer`, `metadata.source_dataset`), or
    their JSON text, as datasets often store the heterogeneous `metadata` serialized. An entry whose
    scorer raises scores None (that sample only).
    """
    return [_score(completion, _as_entry(item)) for completion, item in zip(completions, entry, strict=True)]


def _score(completion: str, entry: Mapping[str, Any]) -> float | None:
    score_answer = _scorer(entry["metadata"]["source_dataset"])
    try:
        accepted = any(score_answer(candidate, entry) == 1.0 for candidate in _candidates(completion))
    except Exception:
        logger.debug("reasoning-gym scorer raised on entry %r", entry.get("question"), exc_info=True)
        return None
    return float(accepted)


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
