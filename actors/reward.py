"""Ray actor running the configured reward functions (rewards/runner.py does the work)."""

from __future__ import annotations

import ray

from rlpipe.rewards import RewardResult, RewardRunner


@ray.remote
class RewardActor:
    def __init__(self, specs: list[dict], timeout_s: float):
        self.runner = RewardRunner(specs, timeout_s=timeout_s)

    def score(
        self, prompts: list[str], completions: list[str], columns: dict[str, list], group_sizes: list[int]
    ) -> RewardResult:
        return self.runner.score(prompts, completions, columns, group_sizes)

    def names(self) -> list[str]:
        return self.runner.names
