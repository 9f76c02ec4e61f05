"""Ray actor running the configured reward functions (rewards/runner.py does the work)."""

from __future__ import annotations

import ray

from rlpipe.rewards import RewardResult, RewardRunner
from rlpipe.logs import LogSetup, configure_worker


@ray.remote
class RewardActor:
    def __init__(
        self, specs: list[dict], timeout_s: float, columns: list[str] | None = None, log: LogSetup | None = None
    ):
        if log is not None:
            configure_worker(log)
        self.runner = RewardRunner(specs, timeout_s=timeout_s, columns=columns)

    def score(
        self,
        prompts: list,
        completions: list[str],
        columns: dict[str, list],
        group_sizes: list[int],
        completion_ids: list[list[int]],
        trainer_state: dict,
    ) -> RewardResult:
        return self.runner.score(
            prompts, completions, columns, group_sizes, completion_ids=completion_ids, trainer_state=trainer_state
        )

    def names(self) -> list[str]:
        return self.runner.names
