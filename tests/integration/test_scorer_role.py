"""A reward model in reward.functions, run by the scorer role: its own Ray actor, started and stopped with the run,
called by the reward worker with the step's samples and weighed with the functions; the scores in the run are the
model's own on those very samples, as TRL renders them."""

from __future__ import annotations

import pytest

from rlpipe.bench.tiny_model import build_tiny_reward_model
from rlpipe.scoring.reward_model import RewardModel
from tests.integration.test_grpo_e2e import _one_step
from tests.tiny_judge import SCORED, TEMPLATE, UNSCORED, build_tiny_judge

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_judge(tmp_path_factory) -> str:
    return build_tiny_judge(tmp_path_factory.mktemp("tiny-judge") / "judge")


def test_a_reward_model_and_a_judge_score_a_runs_samples_beside_a_function(tmp_path, tiny_qwen3, tiny_judge,
                                                                           ray_cluster):
    reward_model = build_tiny_reward_model(tmp_path / "tiny-rm")
    rows = [{"question": "Calculate 1 + 2.", "answer": "3"}, {"question": "Calculate 20 + 2.", "answer": "22"}]
    judge = f"{{model: '{tiny_judge}', template: '{TEMPLATE}', max_tokens: 24}}"
    record, groups = _one_step(tmp_path, tiny_qwen3, "scored-by-models", rows, [
        f"{{name: '{reward_model}', weight: 0.5}}", f"{{name: judge, kwargs: {judge}}}",
        "{name: 'tests.unit.reward_fixtures:length', weight: 0.01}",
    ], ["scorer.max_model_len=256"])
    assert record["reward/failures/tiny-rm"] == 0 and record["reward/failures/judge"] == 0
    assert record["reward/unscored"] == 0
    model = RewardModel(reward_model)
    scores = []
    for group in groups:  # plain-text prompts: TRL scores prompt + completion
        expected = model.score([rows[group["sample_id"]]["question"]] * 4, group["completions"])
        assert group["reward_parts"]["tiny-rm"] == pytest.approx(expected, abs=1e-5)
        # The judge replied to each (non-empty) completion as it was trained to; its reply is kept with the sample.
        assert all(text for text in group["completions"])
        assert group["reward_parts"]["judge"] == [0.7] * 4
        assert group["reward_extras"]["judge/reply"] == [SCORED] * 4
        assert group["rewards"] == pytest.approx(
            [0.5 * score + 0.7 + 0.01 * len(text) for score, text in zip(expected, group["completions"])], abs=1e-5
        )
        scores += expected
    assert len(set(scores)) > 1
    assert record["reward/tiny-rm"] == pytest.approx(sum(scores) / len(scores), abs=1e-5)


def test_a_judge_on_its_vllm_engine_answers_repeats_from_its_cache_and_leaves_unrated_samples_unscored(
        tiny_judge, monkeypatch):
    from rlpipe.config import ScorerConfig
    from rlpipe.scoring.judge import Judge, judge_spec, start_judge_engine

    # The engine's variables, set in this process as in a scorer actor's, are this test's alone.
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(name, "0")
    llm = start_judge_engine(tiny_judge, ScorerConfig(max_model_len=128))
    asked = []
    generate = llm.generate

    def counted(prompts, *args, **kwargs):  # the real engine, its requests counted
        asked.append(len(prompts))
        return generate(prompts, *args, **kwargs)

    llm.generate = counted
    judge = Judge(llm, judge_spec({"model": tiny_judge, "template": TEMPLATE, "max_tokens": 24}, "judge"), 128)
    prompts = ["Calculate 3 + 4."] * 5
    completions = ["The answer is 7.", "", "12 12", "The answer is 7.", "7 " * 200]  # the last: past 128 tokens
    first = judge.score(prompts, completions, {})
    assert [answer["score"] for answer in first] == [0.7, None, 0.7, 0.7, None]
    assert first[1]["reply"] == UNSCORED and first[4]["reply"].startswith("(not asked: longer than")
    assert asked == [3]  # the repeated request asked once, the one too long not at all
    assert judge.score(prompts[:2], completions[:2], {}) == first[:2] and asked == [3]  # both from the cache


def test_a_scorer_that_dies_mid_call_is_started_again_and_answers_the_call(tmp_path, ray_cluster):
    import threading
    import time

    import ray

    from rlpipe.actors.scorer import ScorerActor, scorer_call
    from rlpipe.config import ScorerConfig
    from rlpipe.rewards.child import CallFailed
    from rlpipe.scoring.served import ServedModel

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    reward_model = build_tiny_reward_model(tmp_path / "tiny-rm")
    scorer = ScorerActor.options(num_cpus=0, max_restarts=1).remote({"rm": ServedModel(reward_model)}, ScorerConfig())
    call = scorer_call(scorer)
    prompts, completions = ["Calculate 1 + 2."] * 4, [" 3", " The answer is 3.", "", " 4"]
    expected = RewardModel(reward_model).score(prompts, completions)
    assert call("rm", prompts, completions, {}, 120.0) == pytest.approx(expected, abs=1e-6)
    long_call = []
    busy = threading.Thread(
        target=lambda: long_call.append(call("rm", ["x" * 200] * 1500, [" 3"] * 1500, {}, 300.0))
    )
    busy.start()
    time.sleep(0.5)
    assert busy.is_alive()  # the long call is under way
    ray.kill(scorer, no_restart=False)
    busy.join(timeout=300)
    # The call waited for the new process, which scored it (scoring is pure, so sending it again is safe).
    assert len(long_call) == 1 and len(long_call[0]) == 1500 and all(isinstance(v, float) for v in long_call[0])
    assert call("rm", prompts, completions, {}, 120.0) == pytest.approx(expected, abs=1e-6)
    ray.kill(scorer, no_restart=True)  # its restarts spent: the call fails in one line, costing its samples only
    with pytest.raises(CallFailed, match="^the scorer stopped"):
        call("rm", prompts, completions, {}, 120.0)
