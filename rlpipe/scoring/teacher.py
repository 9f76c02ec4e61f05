"""A teacher for on-policy distillation (algo.distill_teacher): its log-prob of every token the policy sampled, given
the tokens before it, computed by vLLM on the scorer role (the sequence as a prompt, its prompt log-probs; nothing
generated). The teacher reads the policy's own token ids, so the two tokenizers must be one (`check_teacher`).
"""

from __future__ import annotations

import json
from pathlib import Path

from rlpipe.scoring.reward_model import checked_tokenizer
from rlpipe.usercode.callables import RewardConfigError

# The teacher's name among the scorer's models: no reward function's name has an "@".
TEACHER = "@teacher"
WHERE = "algo.distill_teacher"


def check_teacher(folder: str, policy_tokenizer) -> None:
    """Refuse, in one line, a teacher whose tokenizer is not the policy's (the same text for every token id, the
    same special tokens) or whose model has fewer token ids than that vocabulary, or whose folder vLLM cannot
    start from (weights outside the folder, no safetensors)."""
    from rlpipe.models.checks import ModelFileError, check_links, safetensors_files

    try:
        check_links(folder)
        safetensors_files(folder)
    except ModelFileError as err:
        raise RewardConfigError(f"{WHERE}: {err}") from None
    teacher = checked_tokenizer(folder, WHERE)
    ours, theirs = policy_tokenizer.get_vocab(), teacher.get_vocab()
    differing = [token for token, index in ours.items() if theirs.get(token) != index]
    if differing or len(theirs) != len(ours):
        example = f" (e.g. {differing[0]!r})" if differing else ""
        raise RewardConfigError(
            f"{WHERE}: the teacher's tokenizer is not the policy's: {len(differing)} of the policy's {len(ours)} "
            f"tokens have another id or none{example}, and the teacher has {len(theirs)}; on-policy distillation "
            f"scores the policy's own token ids, so the two must share one tokenizer"
        )
    config = json.loads((Path(folder) / "config.json").read_text())
    vocab = config.get("text_config", config).get("vocab_size")
    if isinstance(vocab, int) and vocab < len(ours):
        raise RewardConfigError(f"{WHERE}: the teacher's model has {vocab} token ids, fewer than the tokenizer's "
                                f"{len(ours)}")


class Teacher:
    """The teacher's log-probs from a vLLM engine in this process (`llm`, rlpipe/scoring/judge.py's
    `start_judge_engine`): `context` tokens at most per sequence (scorer.max_model_len)."""

    def __init__(self, llm, context: int):
        self.llm, self.context = llm, context

    def logprobs(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float] | None]:
        """Per (prompt ids, completion ids): the teacher's log-prob of each completion token given every token before
        it; None for a sequence longer than its context or with no completion."""
        from rlpipe.rollout.engine import given_sequence_logprobs

        asked = [index for index, (prompt, completion) in enumerate(sequences)
                 if prompt and completion and len(prompt) + len(completion) < self.context]
        whole = [sequences[index][0] + sequences[index][1] for index in asked]
        found: list[list[float] | None] = [None] * len(sequences)
        for index, logprobs in zip(asked, given_sequence_logprobs(self.llm, whole) if whole else []):
            found[index] = None if logprobs is None else logprobs[len(sequences[index][0]):]
        return found
