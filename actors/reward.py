"""Ray actor running the configured reward functions (rewards/runner.py does the work)."""

from __future__ import annotations

import ray

from rewards import RewardResult, RewardRunner
from rlpipe.logs import LogSetup, configure_worker


@ray.remote
class RewardActor:
    def __init__(self, specs: list[dict], timeout_s: float, log: LogSetup | None = None):
        if log is not None:
            configure_worker(log)
        self.runner = RewardRunner(specs, timeout_s=timeout_s)

    def score(
        self, prompts: list[str], completions: list[str], columns: dict[str, list], group_sizes: list[int]
    ) -> RewardResult:
        return self.runner.score(prompts, completions, columns, group_sizes)

    def names(self) -> list[str]:
        return self.runner.names
