"""Length shaping: DAPO's soft overlong punishment (Yu et al., 2025, "DAPO", section 3.4)."""

from __future__ import annotations


def overlong(
    completion_tokens: list[int],
    max_tokens: list[int] | int,
    buffer_tokens: int | None = None,
    **_: object,
) -> list[float]:
    """0 up to `max_tokens - buffer_tokens` tokens, then a penalty growing linearly to -1 at `max_tokens` (where
    sampling cut the completion off), so the policy learns to finish before the limit rather than being
    punished only for a cliff it cannot see. `buffer_tokens` defaults to a fifth of the limit (DAPO's 4k of 20k).

    `completion_tokens` and `max_tokens` are set by the reward pool for every sample; add this function with a
    weight next to a correctness reward.
    """
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(completion_tokens)
    scores = []
    for length, limit in zip(completion_tokens, limits, strict=True):
        buffer = buffer_tokens if buffer_tokens is not None else max(1, limit // 5)
        if not 0 < buffer <= limit:
            raise ValueError(f"buffer_tokens must be in 1..{limit} (the completion limit), got {buffer}")
        expected = limit - buffer
        scores.append(max(-1.0, min(0.0, (expected - length) / buffer)))
    return scores
