"""The controller's lookahead: which generations are in flight when, and where a checkpoint resumes the sampler.
The roles are a stand-in recording calls (the real ones run in tests/integration/test_grpo_e2e.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlpipe.config import load_config
from rlpipe.run.controller import Lookahead
from rlpipe.data.prompts import Sampler


class RecordingRoles:
    def __init__(self):
        self.calls: list[tuple] = []

    def seed(self, step):
        self.calls.append(("seed", step))

    def start_generation(self, prompts, n):
        self.calls.append(("start", tuple(prompts)))
        return tuple(prompts)

    def finish_generation(self, generation):
        self.calls.append(("finish", generation))
        return list(generation)


def _lookahead(staleness: int, steps: int = 4, first_step: int = 1):
    cfg = load_config(None, [f"train.steps={steps}", "train.prompts_per_step=2", f"train.max_staleness={staleness}"])
    run = SimpleNamespace(first_step=first_step, sampler=Sampler(100, seed=0),
                          train_set=SimpleNamespace(prompts=lambda indices: list(indices)))
    roles = RecordingRoles()
    return Lookahead(run, roles, cfg), roles, run


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_generation_runs_at_most_max_staleness_steps_ahead(staleness):
    ahead, roles, _ = _lookahead(staleness)
    for step in range(1, 5):
        ahead.take(step)
        ahead.start(until=step + staleness)
        started = sum(1 for call in roles.calls if call[0] == "start")
        # While step `step` trains, generations for steps up to step + staleness are in flight (never past the end).
        assert started == min(4, step + staleness)
        assert len(ahead.pending) == min(4, step + staleness) - step
    assert [call[1] for call in roles.calls if call[0] == "seed"] == [1, 2, 3, 4]  # each step seeded once, in order


def test_a_checkpoint_resumes_the_sampler_before_generations_in_flight():
    ahead, roles, run = _lookahead(staleness=1)
    ahead.take(1)
    before_step_2 = run.sampler.state_dict()
    ahead.start(until=2)  # step 2's prompts are drawn and in flight
    assert run.sampler.state_dict() != before_step_2
    assert ahead.sampler_state() == before_step_2  # a checkpoint after step 1 draws step 2's prompts again
    prompts_of_step_2 = roles.calls[-1][1]
    resumed = Sampler(100, seed=0)
    resumed.load_state_dict(ahead.sampler_state())
    assert tuple(resumed.next(2)) == prompts_of_step_2


def test_reward_functions_get_the_step_as_a_trainer_state():
    from rlpipe.run.controller import reward_state

    cfg = load_config(None, ["train.steps=10", "train.prompts_per_step=4", "run.name=r"])
    run = SimpleNamespace(train_set=[None] * 8)
    state = reward_state(cfg, run, 3)  # step 4's samples: 3 steps, 12 prompts drawn before them
    assert state == {"global_step": 3, "max_steps": 10, "epoch": 1.5, "run_name": "r", "mode": "train"}
    assert state.global_step == 3 and reward_state(cfg, run, 10, "eval").mode == "eval"
