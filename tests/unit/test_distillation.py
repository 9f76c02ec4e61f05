"""On-policy distillation (algo.distill_teacher): the reverse-KL term against TRL's own divergence on the same tensors,
its importance weighting, the teacher's log-probs through the train batch, the objective and config it comes with,
and the teacher's one-line refusals. The teacher on a vLLM engine and a whole step are
tests/integration/test_distillation.py."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
import torch

from rlpipe.algo.objective import TeacherKL, build_objective
from rlpipe.config import ConfigError, load_config
from rlpipe.types import LossInputs, ModelOutputs, TrainBatch


def _algo(*overrides):
    return load_config(None, ["rollout.group_size=2", "train.prompts_per_step=4", *overrides]).algo


def _term_loss(objective, student: torch.Tensor, teacher: torch.Tensor, old: torch.Tensor | None = None):
    """The objective's loss and stats on one row of the given per-token log-probs (all tokens trained)."""
    rows = student.view(1, -1)
    inputs = LossInputs(
        mask=torch.ones_like(rows, dtype=torch.bool), advantages=torch.zeros(1, dtype=rows.dtype),
        rollout_logprobs=rows.detach(), total_tokens=torch.tensor(float(rows.numel())), total_seqs=torch.tensor(1.0),
        teacher_logprobs=teacher.view(1, -1), old_logprobs=None if old is None else old.view(1, -1),
    )
    return objective(ModelOutputs(logprobs=rows, entropy=torch.zeros_like(rows)), inputs)


def test_the_teacher_term_is_trls_reverse_kl_over_the_tokens_the_policy_samples():
    """In expectation over the sampled token (every token of a small vocabulary, weighted by the policy's
    probability), the term's value is TRL's reverse KL (its `_jsd_divergence` at beta 1, the top-1 server
    distillation's divergence) and its gradient that KL's gradient, at every position."""
    from trl.experimental.server_distillation.server_distillation_trainer import _jsd_divergence

    torch.manual_seed(0)
    positions, vocab = 4, 9
    logits = torch.randn(positions, vocab, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(positions, vocab, dtype=torch.float64) * 2, dim=-1)
    student = torch.log_softmax(logits, dim=-1)
    reverse_kl = _jsd_divergence(student, teacher, beta=1.0).sum(-1)  # [positions], TRL's
    (expected_grad,) = torch.autograd.grad(reverse_kl.sum(), logits)

    objective = build_objective(_algo("algo.distill_teacher=teacher", "algo.distill_coef=1.0", "algo.tis_cap=null"),
                                max_tokens=8)
    assert any(isinstance(term, TeacherKL) for term in objective.terms) and objective.every_row_counts
    value, grad = torch.zeros(positions, dtype=torch.float64), torch.zeros_like(logits)
    for position in range(positions):
        for token in range(vocab):
            student = torch.log_softmax(logits, dim=-1)  # the policy's graph, fresh for each sampled token
            loss, stats = _term_loss(objective, student[position, token], teacher[position, token])
            weight = student[position, token].exp().detach()
            (token_grad,) = torch.autograd.grad(loss, logits)
            grad += weight * token_grad
            value[position] += weight * stats.teacher_kl
    assert value == pytest.approx(reverse_kl.detach(), abs=1e-12)
    assert torch.allclose(grad, expected_grad, atol=1e-12)
    assert float(reverse_kl.min()) > 0.05  # the two distributions differ: the check has something to find


def test_the_teacher_term_is_weighted_by_the_importance_ratio_once_the_policy_moved_and_scaled_by_its_coef():
    objective = build_objective(_algo("algo.distill_teacher=teacher", "algo.distill_coef=0.5", "algo.tis_cap=null"),
                                max_tokens=8)
    current = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    old, teacher = torch.tensor([-1.2, -1.5, -0.5], dtype=torch.float64), torch.tensor([-2.0, -1.0, -3.0],
                                                                                         dtype=torch.float64)
    loss, stats = _term_loss(objective, current, teacher, old)
    log_ratio = old - teacher
    expected = 0.5 * (log_ratio * torch.exp(current.detach() - old)).mean()
    assert float(loss) == pytest.approx(float(expected))  # the policy term is 0: advantages are 0
    assert float(stats.teacher_kl) == pytest.approx(float(log_ratio.sum()))
    (grad,) = torch.autograd.grad(loss, current)
    assert torch.allclose(grad, 0.5 * log_ratio * torch.exp(current.detach() - old) / 3)


def test_teacher_log_probs_travel_with_the_batch_and_a_sample_without_them_has_no_signal():
    batch = TrainBatch.from_sequences(
        [[1, 2], [3]], [[4, 5, 6], [7, 8]], [[-0.1, -0.2, -0.3], [-0.4, -0.5]], [1.0, -1.0],
        teacher_logprobs=[[-1.0, -2.0, -3.0], None],
    )
    assert batch.teacher_logprobs[0, 2:5].tolist() == [-1.0, -2.0, -3.0]
    assert batch.teacher_logprobs[1, 1:3].tolist() == pytest.approx([-0.4, -0.5])  # the rollout's: log-ratio 0
    again = pickle.loads(pickle.dumps(batch))
    assert torch.equal(again.teacher_logprobs, batch.teacher_logprobs)
    assert torch.equal(batch.take(torch.tensor([1])).teacher_logprobs, batch.teacher_logprobs[1:, :3])
    plain = TrainBatch.from_sequences([[1]], [[2]], [[-0.1]], [0.5])
    assert plain.teacher_logprobs is None and pickle.loads(pickle.dumps(plain)).teacher_logprobs is None


def test_the_distillation_keys_are_checked_when_the_config_loads():
    assert TeacherKL not in map(type, build_objective(_algo(), max_tokens=8).terms)
    with pytest.raises(ConfigError, match="^algo.distill_coef: must be > 0"):
        _algo("algo.distill_teacher=teacher", "algo.distill_coef=0")


def test_a_teacher_with_another_tokenizer_or_too_few_token_ids_is_refused_in_one_line(tmp_path):
    from transformers import AutoTokenizer

    from bench.tiny_model import build_tiny_model
    from rlpipe.scoring.teacher import check_teacher
    from rlpipe.usercode.callables import RewardConfigError

    student = build_tiny_model(tmp_path / "student", "qwen3")
    tokenizer = AutoTokenizer.from_pretrained(student)
    same = build_tiny_model(tmp_path / "teacher", "qwen3", seed=1)
    check_teacher(same, tokenizer)  # the same tokenizer, other weights: a teacher

    other = build_tiny_model(tmp_path / "other", "qwen3", seed=2)
    theirs = AutoTokenizer.from_pretrained(other)
    theirs.add_tokens(["<extra>"])
    theirs.save_pretrained(other)
    with pytest.raises(RewardConfigError, match=r"^algo.distill_teacher: the teacher's tokenizer is not the "
                                                r"policy's: 0 of the policy's \d+ tokens .* the teacher has \d+;"):
        check_teacher(other, tokenizer)

    narrow = Path(build_tiny_model(tmp_path / "narrow", "qwen3", seed=3))
    config = json.loads((narrow / "config.json").read_text())
    config["vocab_size"] = 10
    (narrow / "config.json").write_text(json.dumps(config))
    with pytest.raises(RewardConfigError, match=r"^algo.distill_teacher: the teacher's model has 10 token ids"):
        check_teacher(str(narrow), tokenizer)


def test_the_teacher_is_counted_in_the_scorers_memory_and_the_clusters_cpus(tmp_path):
    from bench.tiny_model import build_tiny_model
    from rlpipe.models.checks import stored_tensors
    from rlpipe.plan import plan
    from rlpipe.startup.preflight import actors_needed

    teacher = build_tiny_model(tmp_path / "teacher", "qwen3", seed=1)
    cfg = load_config(None, ["rollout.group_size=2", "train.prompts_per_step=4", f"algo.distill_teacher={teacher}"])
    peak = plan(cfg).peak("scorer_host")
    params = sum(math.prod(tensor.shape) for tensor in stored_tensors(teacher).values())
    assert peak.part(f"weights:{teacher}").bytes == params * 4  # scorer.dtype float32
    assert peak.part(f"kv_cache:{teacher}").bytes == cfg.scorer.kv_cache_gib * 2**30
    assert actors_needed(cfg) == actors_needed(load_config(None, ["rollout.group_size=2",
                                                                   "train.prompts_per_step=4"])) + 1
