"""Ray actor owning one vLLM engine (rlpipe/rollout.py does the work)."""

from __future__ import annotations

import ray

from rlpipe.config import RolloutConfig
from rlpipe.rollout import RolloutEngine
from rlpipe.types import Completion, Prompt


@ray.remote
class RolloutActor:
    def __init__(self, model_path: str, cfg: RolloutConfig, seed: int, tokenizer_path: str | None = None):
        self.engine = RolloutEngine(model_path, cfg, seed, tokenizer_path)

    def generate(self, prompts: list[Prompt], n: int, **sampling) -> list[list[Completion]]:
        return self.engine.generate(prompts, n, **sampling)

    def update_weights(self, payload: bytes, version: int) -> int:
        return self.engine.update_weights(payload, version)

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        return self.engine.sequence_logprobs(token_ids)

    def policy_version(self) -> int:
        return self.engine.policy_version
