"""The reward pool's wait on its workers (actors/reward_pool.py) on a local Ray cluster. Its workers (actors/reward.py)
return within their share of reward.deadline_s whatever the functions do (tests/unit/test_rewards.py), so a worker
that never answers is a stand-in here: the pool is what is tested."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlpipe.rewards import RewardResult
from rlpipe.types import Completion, Group, Prompt

ray = pytest.importorskip("ray")


@ray.remote(num_cpus=0, max_restarts=1, max_task_retries=1)
class FirstLifeStalls:
    """Scores every sample 1.0; the first process it runs in never answers (a later one, after a restart, does)."""

    def __init__(self, marker: str):
        self.stalls = not Path(marker).exists()
        Path(marker).touch()

    def score(self, prompts, completions, columns, group_sizes, completion_ids, trainer_state) -> RewardResult:
        while self.stalls:
            time.sleep(3600)
        return RewardResult([1.0] * len(completions), {"answer": [1.0] * len(completions)}, {"answer": 0})


def _groups(count: int) -> list[Group]:
    def completion(index: int) -> Completion:
        return Completion(token_ids=[index], logprobs=[0.0], text=str(index), finish_reason="stop", policy_version=0)

    return [Group(Prompt(n, f"q{n}", [n], {"answer": str(n)}), [completion(0), completion(1)]) for n in range(count)]


@pytest.mark.heavy
def test_a_worker_that_does_not_answer_by_the_deadline_is_restarted_and_its_share_unscored(tmp_path):
    from rlpipe.actors.reward_pool import RewardPool
    from rlpipe.types import StepScores

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        answering = tmp_path / "answering"
        answering.touch()  # this one is past its first life
        workers = [FirstLifeStalls.remote(str(answering)), FirstLifeStalls.remote(str(tmp_path / "stalling"))]
        pool = RewardPool(workers, max_tokens=8, max_restarts=1, deadline_s=2.0, names=["answer"])
        groups = _groups(4)
        scores = pool.score(groups)
        assert [g.rewards for g in groups] == [[1.0, 1.0]] * 2 + [[None, None]] * 2
        assert [g.reward_parts for g in groups[2:]] == [{"answer": [None, None]}] * 2
        assert scores.failures == {"answer": 4}
        assert scores.errors == {"answer": "answer: reward worker 1 did not answer within reward.deadline_s=2s: restarted, "
                                    "its 4 samples unscored"}
        # The restarted worker (a new process: give it time to start) answers the next step.
        pool.deadline_s = 60.0
        groups = _groups(4)
        assert pool.score(groups) == StepScores({"answer": 0}, {}, {})
        assert [g.rewards for g in groups] == [[1.0, 1.0]] * 4
    finally:
        ray.shutdown()


class _Answered:
    """A reward worker's handle whose calls have answered already: `score.remote` is the result itself."""

    def __init__(self, scores: list[float], timeouts: int):
        result = RewardResult(list(scores), {"answer": list(scores)}, {"answer": 0}, timeouts={"answer": timeouts})
        self.score = type("Method", (), {"remote": staticmethod(lambda *args: result)})()


def test_the_step_counts_each_workers_timeouts(monkeypatch):
    from rlpipe.actors import reward_pool
    from rlpipe.actors.reward_pool import RewardPool

    # No cluster: the futures are the results, as they would be once every worker answered.
    monkeypatch.setattr(reward_pool, "ray", type("Ray", (), {"wait": staticmethod(lambda f, **_: (f, [])),
                                                             "get": staticmethod(lambda result: result)}))
    workers = [_Answered([1.0, 0.0, 1.0, 0.0], timeouts=2), _Answered([0.0, 1.0, 1.0, 1.0], timeouts=1)]
    pool = RewardPool(workers, max_tokens=8, max_restarts=0, deadline_s=1.0, names=["answer"])
    groups = _groups(4)
    scores = pool.score(groups)
    assert scores.timeouts == {"answer": 3} and scores.failures == {"answer": 0}
    assert [g.rewards for g in groups] == [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
