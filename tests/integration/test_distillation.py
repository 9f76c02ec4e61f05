"""On-policy distillation for real: the teacher's log-probs from its vLLM engine (prompt log-probs of the sampled
sequence) are transformers' own for the same tokens, and a GRPO step with a teacher has the scorer role compute them
for every sample and the learner train on them."""

from __future__ import annotations

import pytest
import torch

from rlpipe.bench.tiny_model import build_tiny_model
from tests.integration.test_grpo_e2e import _one_step

pytestmark = pytest.mark.integration


def test_the_teacher_on_its_vllm_engine_gives_transformers_log_probs_of_the_sampled_tokens(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from rlpipe.config import ScorerConfig
    from rlpipe.scoring.judge import start_judge_engine
    from rlpipe.scoring.teacher import Teacher

    # The engine's variables, set in this process as in a scorer actor's, are this test's alone.
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(name, "0")
    folder = build_tiny_model(tmp_path / "teacher", "qwen3", seed=1)
    teacher = Teacher(start_judge_engine(folder, ScorerConfig(max_model_len=64)), 64)
    sequences = [([11, 12, 13], [40, 41, 42, 43]), ([90, 80], [70]), ([5], []), ([1] * 40, [2] * 30)]
    found = teacher.logprobs(sequences)
    assert found[2] is None and found[3] is None  # nothing sampled; longer than the teacher's context
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for (prompt, completion), logprobs in zip(sequences[:2], found[:2]):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0].log_softmax(-1)
        expected = [float(logits[len(prompt) + i - 1, token]) for i, token in enumerate(completion)]
        assert logprobs == pytest.approx(expected, abs=1e-4)
        assert len(logprobs) == len(completion)


def test_a_step_distilled_from_the_policy_itself_has_every_sample_taught_and_no_reverse_kl(tmp_path, tiny_qwen3,
                                                                                            ray_cluster):
    """The teacher is the policy's own model: every sample gets the teacher's log-probs, and their log-ratio to the
    learner's is float noise (a token misaligned by one position would give whole nats)."""
    rows = [{"question": "Calculate 1 + 2.", "answer": "3"}, {"question": "Calculate 20 + 2.", "answer": "22"}]
    record, _ = _one_step(tmp_path, tiny_qwen3, "distilled", rows, ["{name: 'tests.unit.reward_fixtures:length'}"],
                          [f"algo.distill_teacher={tiny_qwen3}", "scorer.max_model_len=256"])
    assert record["distill/untaught_samples"] == 0 and record["samples_trained"] == 8
    assert abs(record["distill/teacher_kl"]) < 1e-3
    assert record["completion_tokens"] > 0
