"""Ray actor running the configured reward functions (rewards/runner.py does the work)."""

from __future__ import annotations

import ray

from rlpipe.actors.scorer import scorer_call
from rlpipe.config import RewardConfig
from rlpipe.rewards import RewardResult, RewardRunner
from rlpipe.reporting.logs import LogSetup, configure_worker

WORKER_SHARE_OF_DEADLINE = 0.9
"""The worker stops calling functions at this share of reward.deadline_s, so that its reply reaches the driver,
which waits the whole of it, in time."""


@ray.remote
class RewardActor:
    """`scorer`: the scorer actor that runs this worker's entries of `specs` that a model scores (reward models, the
    judge); None where there are none."""

    def __init__(
        self, specs: list[dict], reward: RewardConfig, columns: list[str] | None = None, log: LogSetup | None = None,
        scorer=None,
    ):
        if log is not None:
            configure_worker(log)
        self.runner = RewardRunner(
            specs, timeout_s=reward.timeout_s, columns=columns, sample_timeout_s=reward.sample_timeout_s,
            deadline_s=reward.deadline_s * WORKER_SHARE_OF_DEADLINE,
            score_with_model=None if scorer is None else scorer_call(scorer),
        )
        self.runner.start()  # the functions' process loads them while the first step generates

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
