"""The probe a weight sync is checked against: after writing, the engine's log-probs must match the learner's.

Engines that return the log-probs of a given sequence (vLLM's prompt log-probs) replay the probe sequence. Engines
that return none (vLLM on TorchTPU) decode instead: engine and learner each continue the probe sequence greedily
for DECODE_TOKENS tokens, and their log-probs of those tokens are compared up to and including the first token
where the two continuations part (there each side's value is its top token's, which agree whenever the weights
do; after it the contexts differ).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

DECODE_TOKENS = 16
# Where the probe is checked on its mean gap (a bf16 engine, whose kernels differ from the float32 learner a little on
# every token), the bound on any one token's gap, in multiples of the tolerance: clean bf16 syncs stay within about 2x
# (max 0.32 at a mean tolerance of 0.15 on SmolLM2-135M), while a weight blown up to a huge value moves the few tokens
# that see it by nats and a long sequence's mean hardly at all.
MEAN_PROBE_MAX_FACTOR = 10.0


@dataclass
class DecodedProbe:
    """A greedy continuation of the probe sequence and each continued token's log-prob (temperature 1);
    `sequence_logprobs`, from the learner only: its log-probs of the probe sequence itself."""

    tokens: list[int]
    logprobs: list[float]
    sequence_logprobs: list[float] | None = None


def decode_probe(
    token_ids: list[int], next_token: Callable[[list[int]], int], sequence_logprobs: Callable[[list[int]], list[float]],
    count: int = DECODE_TOKENS,
) -> DecodedProbe:
    """A model's decoded probe: `count` tokens continued greedily after `token_ids` (`next_token`: the model's most
    likely token after a sequence), with the log-probs of the continued tokens and of `token_ids` themselves from
    `sequence_logprobs`, as a replayed probe's are."""
    tokens = list(token_ids)
    for _ in range(count):
        tokens.append(next_token(tokens))
    logprobs = sequence_logprobs(tokens)
    return DecodedProbe(tokens[len(token_ids):], logprobs[len(token_ids):], logprobs[: len(token_ids)])


def decoded_gaps(engine: DecodedProbe, learner: DecodedProbe) -> list[float]:
    parted = next((i for i, (a, b) in enumerate(zip(engine.tokens, learner.tokens)) if a != b), len(engine.tokens))
    compared = min(parted + 1, len(engine.tokens), len(learner.tokens))
    return [abs(a - b) for a, b in zip(engine.logprobs[:compared], learner.logprobs[:compared])]


def probe_gaps(
    engine: list[float] | DecodedProbe, learner: list[float] | DecodedProbe
) -> tuple[list[float], list[float]]:
    """|engine - learner| per compared token, and the probe sequence's log-probs under the new weights: the engine's
    own where it replays the sequence, the learner's where it decodes (it returns none of its own)."""
    if isinstance(engine, DecodedProbe):
        return decoded_gaps(engine, learner), learner.sequence_logprobs
    return [abs(a - b) for a, b in zip(engine[1:], learner[1:])], engine
