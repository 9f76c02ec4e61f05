"""A reward model in reward.functions, run by the scorer role: its own Ray actor, started and stopped with the run,
called by the reward worker with the step's samples and weighed with the functions; the scores in the run are the
model's own on those very samples, as TRL renders them."""

from __future__ import annotations

import pytest

from rlpipe.bench.tiny_model import build_tiny_reward_model
from rlpipe.scoring.reward_model import RewardModel
from tests.integration.test_grpo_e2e import _one_step

pytestmark = pytest.mark.integration


def test_a_reward_model_scores_a_runs_samples_beside_a_function(tmp_path, tiny_qwen3, ray_cluster):
    reward_model = build_tiny_reward_model(tmp_path / "tiny-rm")
    rows = [{"question": "Calculate 1 + 2.", "answer": "3"}, {"question": "Calculate 20 + 2.", "answer": "22"}]
    record, groups = _one_step(tmp_path, tiny_qwen3, "scored-by-a-model", rows, [
        f"{{name: '{reward_model}', weight: 0.5}}", "{name: 'tests.unit.reward_fixtures:length', weight: 0.01}",
    ])
    assert record["reward/failures/tiny-rm"] == 0 and record["reward/unscored"] == 0
    model = RewardModel(reward_model)
    scores = []
    for group in groups:  # plain-text prompts: TRL scores prompt + completion
        expected = model.score([rows[group["sample_id"]]["question"]] * 4, group["completions"])
        assert group["reward_parts"]["tiny-rm"] == pytest.approx(expected, abs=1e-5)
        assert group["rewards"] == pytest.approx(
            [0.5 * score + 0.01 * len(text) for score, text in zip(expected, group["completions"])], abs=1e-5
        )
        scores += expected
    assert len(set(scores)) > 1
    assert record["reward/tiny-rm"] == pytest.approx(sum(scores) / len(scores), abs=1e-5)


def test_a_scorer_that_dies_mid_call_is_started_again_and_answers_the_call(tmp_path, ray_cluster):
    import threading
    import time

    import ray

    from rlpipe.actors.scorer import ScorerActor, scorer_call
    from rlpipe.config import ScorerConfig
    from rlpipe.rewards.child import CallFailed

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    reward_model = build_tiny_reward_model(tmp_path / "tiny-rm")
    scorer = ScorerActor.options(num_cpus=0, max_restarts=1).remote({"rm": reward_model}, ScorerConfig())
    call = scorer_call(scorer)
    prompts, completions = ["Calculate 1 + 2."] * 4, [" 3", " The answer is 3.", "", " 4"]
    expected = RewardModel(reward_model).score(prompts, completions)
    assert call("rm", prompts, completions, 120.0) == pytest.approx(expected, abs=1e-6)
    long_call = []
    busy = threading.Thread(target=lambda: long_call.append(call("rm", ["x" * 200] * 3000, [" 3"] * 3000, 300.0)))
    busy.start()
    time.sleep(1.0)  # the long call is under way
    ray.kill(scorer, no_restart=False)
    busy.join(timeout=300)
    # The call waited for the new process, which scored it (scoring is pure, so sending it again is safe).
    assert len(long_call) == 1 and len(long_call[0]) == 3000 and all(isinstance(v, float) for v in long_call[0])
    assert call("rm", prompts, completions, 120.0) == pytest.approx(expected, abs=1e-6)
    ray.kill(scorer, no_restart=True)  # its restarts spent: the call fails in one line, costing its samples only
    with pytest.raises(CallFailed, match="^the scorer stopped"):
        call("rm", prompts, completions, 120.0)
