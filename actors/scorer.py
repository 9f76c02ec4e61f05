"""Ray actor of the scorer role: the reward models named in reward.functions (rlpipe/scoring/reward_model.py), loaded
once and called by the reward workers with their whole share of a step, batched `scorer.batch_size` samples at a
time."""

from __future__ import annotations

import time

import ray

from rlpipe.config import ScorerConfig
from rlpipe.reporting.logs import LogSetup, configure_worker
from rlpipe.rewards.child import CallFailed
from rlpipe.scoring.reward_model import RewardModel

RESTART_POLL_S = 0.5


@ray.remote
class ScorerActor:
    """`folders`: each reward model's name in reward.functions -> its local folder (checked by the driver)."""

    def __init__(self, folders: dict[str, str], scorer: ScorerConfig, log: LogSetup | None = None):
        if log is not None:
            configure_worker(log)
        self.models = {
            name: RewardModel(folder, scorer.dtype, scorer.batch_size) for name, folder in folders.items()
        }

    def score(self, name: str, prompts: list, completions: list) -> list[float | None]:
        return self.models[name].score(prompts, completions)

    def names(self) -> list[str]:
        return list(self.models)


def scorer_call(scorer):
    """The reward runner's `score_with_model` (rewards/runner.py) for one scorer actor: the call within its time
    limit, every way it can fail as a CallFailed naming it. While the actor is being started again the call waits for
    it, within the same limit (scoring is pure: a call sent twice scores the same)."""

    def call(name: str, prompts: list, completions: list, limit_s: float) -> list:
        deadline = time.monotonic() + max(limit_s, 0.0)
        while True:
            ref = scorer.score.remote(name, prompts, completions)
            try:
                return ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
            except ray.exceptions.GetTimeoutError:
                ray.cancel(ref)
                raise CallFailed(f"the scorer did not answer within {limit_s:.3g} s (reward.timeout_s)") from None
            except ray.exceptions.ActorUnavailableError:  # restarting: the call waits for the new process
                if time.monotonic() + RESTART_POLL_S >= deadline:
                    raise CallFailed(f"the scorer was starting again for the whole {limit_s:.3g} s") from None
                time.sleep(RESTART_POLL_S)
            except ray.exceptions.RayActorError as err:
                raise CallFailed(f"the scorer stopped ({str(err).splitlines()[0]})") from None
            except ray.exceptions.RayTaskError as err:
                raise CallFailed(f"the scorer failed: {str(err.cause or err).splitlines()[0]}") from None

    return call
