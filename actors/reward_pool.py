"""The reward workers as a pool: a step's groups split over them, scored in parallel, joined back in order."""

from __future__ import annotations

import ray

from rlpipe.actors.engine_pool import split
from rlpipe.rewards import RewardResult
from rlpipe.rewards import trainer_state as start_state
from rlpipe.types import Group, StepScores


class RewardPool:
    """`workers`: the reward actors; `max_tokens` and `max_restarts` are rollout.max_tokens and
    reward.max_restarts (a worker that dies is restarted by Ray and its call run again, at most that often);
    `deadline_s` is reward.deadline_s, how long a step waits for the workers' results; `names` the reward
    functions' names (rewards.specs.reward_names), by which an unanswered share's failures are counted."""

    def __init__(self, workers: list, max_tokens: int, max_restarts: int, deadline_s: float, names: list[str]):
        self.workers, self.max_tokens, self.max_restarts = workers, max_tokens, max_restarts
        self.deadline_s, self.names = deadline_s, list(names)

    def score(self, groups: list[Group], trainer_state: dict | None = None) -> StepScores:
        """Fill each group's rewards (and what the functions kept per sample); returns failures per reward function,
        the first error of each, the step's means of what they gave `log_metric`, and timeouts per function.
        `trainer_state`: what reward functions get as `trainer_state` (default: a run's start)."""
        state = dict(trainer_state or start_state())
        shares = [s for s in split(groups, len(self.workers)) if s]
        futures = []
        for worker, share in zip(self.workers, shares):
            samples = [(g, c) for g in share for c in g.completions]
            columns = {key: [g.prompt.columns[key] for g, _ in samples] for key in share[0].prompt.columns}
            columns.update(
                completion_tokens=[c.model_tokens for _, c in samples],
                finish_reason=[c.finish_reason for _, c in samples],
                max_tokens=[self.max_tokens] * len(samples),
            )
            if any(c.environment is not None for _, c in samples):  # TRL's `environments`
                columns["environments"] = [c.environment for _, c in samples]
            # An episode's completion is its conversation after the prompt, as TRL passes it.
            prompts = [g.prompt.for_rewards for g, _ in samples]
            texts = [c.text if c.messages is None else c.messages for _, c in samples]
            ids, sizes = [c.token_ids for _, c in samples], [len(g.completions) for g in share]
            futures.append(worker.score.remote(prompts, texts, columns, sizes, ids, state))
        failures: dict[str, int] = {}
        timeouts: dict[str, int] = {}
        errors: dict[str, str] = {}
        logged: dict[str, list[float]] = {}
        results = self._results(futures, [sum(len(g.completions) for g in share) for share in shares])
        for share, result in zip(shares, results):
            start = 0
            for group in share:
                window = slice(start, start + len(group.completions))
                group.rewards = result.totals[window]
                group.reward_parts = {name: values[window] for name, values in result.per_function.items()}
                group.reward_extras = {key: values[window] for key, values in result.extras.items()}
                start = window.stop
            for name, count in result.failures.items():
                failures[name] = failures.get(name, 0) + count
            for name, count in result.timeouts.items():
                timeouts[name] = timeouts.get(name, 0) + count
            for name, message in result.first_errors.items():
                errors.setdefault(name, message)
            for name, values in result.metrics.items():
                logged.setdefault(name, []).extend(values)
        means = {name: sum(values) / len(values) for name, values in logged.items()}
        return StepScores(failures, errors, means, timeouts)

    def _results(self, futures: list, sizes: list[int]) -> list[RewardResult]:
        """Each worker's result; a worker that has not answered within deadline_s is restarted, and its share
        comes back unscored, counted as a failure of every function."""
        if not futures:
            return []
        _, late = ray.wait(futures, num_returns=len(futures), timeout=self.deadline_s)
        results = []
        for index, (worker, future, size) in enumerate(zip(self.workers, futures, sizes)):
            if future in late:
                # Cancelled first, so that Ray does not run the call again in the restarted worker.
                ray.cancel(future)
                ray.kill(worker, no_restart=False)
                message = (
                    f"reward worker {index} did not answer within reward.deadline_s={self.deadline_s:g}s: "
                    f"restarted, its {size} samples unscored"
                )
                results.append(
                    RewardResult([None] * size, {name: [None] * size for name in self.names},
                                 dict.fromkeys(self.names, size), {name: f"{name}: {message}" for name in self.names})
                )
                continue
            try:
                results.append(ray.get(future))
            except ray.exceptions.RayActorError as err:
                raise RuntimeError(
                    f"a reward worker died more than reward.max_restarts={self.max_restarts} times while "
                    f"scoring ({str(err).splitlines()[0]})"
                ) from None
        return results
