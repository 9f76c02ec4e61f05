"""Ray actor of the scorer role: the models that score entries of reward.functions (rlpipe/scoring/), loaded once —
reward models with transformers, judges on a vLLM engine per judge model — and called by the reward workers with
their whole share of a step; and a distillation teacher (algo.distill_teacher) on a vLLM engine, called by the
driver with its share of a step's samples."""

from __future__ import annotations

import time

import ray

from rlpipe.config import ScorerConfig
from rlpipe.reporting.logs import LogSetup, configure_worker
from rlpipe.rewards.child import CallFailed
from rlpipe.scoring.judge import Judge, start_judge_engine
from rlpipe.scoring.reward_model import RewardModel
from rlpipe.scoring.served import ServedModel
from rlpipe.scoring.teacher import Teacher

RESTART_POLL_S = 0.5


@ray.remote
class ScorerActor:
    """`served`: what it scores, by the name the scores go by (rlpipe/scoring/served.py, checked by the driver)."""

    def __init__(self, served: dict[str, ServedModel], scorer: ScorerConfig, log: LogSetup | None = None):
        if log is not None:
            configure_worker(log)
        engines = {}  # model folder -> its engine, shared by the judges (and the teacher) of that model
        self.models = {}
        for name, model in served.items():
            if model.judge is None and not model.teacher:
                self.models[name] = RewardModel(model.folder, scorer.dtype, scorer.batch_size)
                continue
            if model.folder not in engines:
                engines[model.folder] = start_judge_engine(model.folder, scorer)
            self.models[name] = (Teacher(engines[model.folder], scorer.max_model_len) if model.teacher else
                                 Judge(engines[model.folder], model.judge, scorer.max_model_len))

    def score(self, name: str, prompts: list, completions: list, columns: dict[str, list]) -> list:
        return self.models[name].score(prompts, completions, columns)

    def teacher_logprobs(self, name: str, sequences: list[tuple[list[int], list[int]]]) -> list:
        return self.models[name].logprobs(sequences)

    def names(self) -> list[str]:
        return list(self.models)


def scorer_call(scorer):
    """The reward runner's `score_with_model` (rewards/runner.py) for one scorer actor: the call within its time
    limit, every way it can fail as a CallFailed naming it. While the actor is being started again the call waits for
    it, within the same limit (scoring is pure: a call sent twice scores the same)."""

    def call(name: str, prompts: list, completions: list, columns: dict[str, list], limit_s: float) -> list:
        return answer(lambda: scorer.score.remote(name, prompts, completions, columns), limit_s)

    return call


def teacher_call(scorer):
    """The teacher's log-probs from one scorer actor, `call(name, sequences, limit_s)`, failing as `scorer_call`'s
    calls do."""

    def call(name: str, sequences: list, limit_s: float) -> list:
        return answer(lambda: scorer.teacher_logprobs.remote(name, sequences), limit_s)

    return call


def answer(send, limit_s: float):
    """What the call `send()` makes answers within `limit_s`: sent again while its actor is being started again,
    every way it can fail a CallFailed."""
    deadline = time.monotonic() + max(limit_s, 0.0)
    while True:
        ref = send()
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
