"""The loss objects of rlpipe/algo/objective.py on a tiny batch, against values computed by hand, and GSPO's
gradient against finite differences of its definition."""

from __future__ import annotations

import math

import pytest
import torch

from rlpipe.algo import DAPOLoss, DrGRPOLoss, GRPOLoss, GSPOLoss, KLPenalty, MaskedImportance, ModelOutputs
from rlpipe.algo import Objective, TruncatedImportance, build_objective, loss_defaults
from rlpipe.config import ConfigError, load_config
from rlpipe.types import LossInputs

# Two sequences: the first with 2 valid tokens, the second with 1 (its second position is padding).
LOGPROBS = [[math.log(0.5), math.log(0.3)], [math.log(0.2), 0.0]]
OLD = [[math.log(0.4), math.log(0.3)], [math.log(0.25), 0.0]]
MASK = [[True, True], [True, False]]
ADVANTAGES = [1.0, -1.0]


def _micro(**extra) -> LossInputs:
    micro = {
        "mask": torch.tensor(MASK),
        "advantages": torch.tensor(ADVANTAGES, dtype=torch.float64),
        "old_logprobs": torch.tensor(OLD, dtype=torch.float64),
        "rollout_logprobs": torch.tensor(OLD, dtype=torch.float64),
        "total_tokens": torch.tensor(3.0),
        "total_seqs": torch.tensor(2.0),
    }
    micro.update(extra)
    return LossInputs(**micro)


def _outputs(logprobs=None):
    logprobs = torch.tensor(LOGPROBS, dtype=torch.float64) if logprobs is None else logprobs
    return ModelOutputs(logprobs, torch.zeros_like(logprobs))


def _value(policy, **extra) -> float:
    loss, _ = Objective(policy)(_outputs(), _micro(**extra))
    return float(loss)


# Ratios: sequence 1 tokens 0.5/0.4 = 1.25 and 1.0; sequence 2 token 0.2/0.25 = 0.8.
def test_grpo_token_mean_clips_each_token():
    # A=+1: 1.25 clipped to 1.2 (clip_high 0.2) -> -1.2; 1.0 -> -1.0. A=-1: 0.8 kept (floor 0.8) -> +0.8.
    expected = (-1.2 - 1.0 + 0.8) / 3
    assert _value(GRPOLoss(clip_low=0.2, clip_high=0.2)) == pytest.approx(expected)
    # Clip-higher: the ceiling 1.28 keeps 1.25.
    assert _value(GRPOLoss(clip_low=0.2, clip_high=0.28)) == pytest.approx((-1.25 - 1.0 + 0.8) / 3)


def test_grpo_sequence_mean():
    expected = ((-1.2 - 1.0) / 2 + 0.8 / 1) / 2
    assert _value(GRPOLoss(clip_low=0.2, clip_high=0.2, aggregation="seq-mean-token-mean")) == pytest.approx(expected)


def test_dr_grpo_divides_token_sums_by_a_constant():
    # Token sums over max_tokens = 4, mean over the 2 sequences; symmetric clip 0.2.
    expected = ((-1.2 - 1.0) / 4 + 0.8 / 4) / 2
    assert _value(DrGRPOLoss(max_tokens=4)) == pytest.approx(expected)
    assert DrGRPOLoss.advantage_scale == "none"


def test_dapo_is_clip_higher_token_mean_with_uniform_groups_dropped():
    assert _value(DAPOLoss()) == pytest.approx((-1.25 - 1.0 + 0.8) / 3)
    assert DAPOLoss.drop_uniform_groups


def test_gspo_clips_the_length_normalised_sequence_ratio():
    # Sequence 1: s = sqrt(1.25 x 1.0) = 1.11803...; sequence 2: s = 0.8.
    s1 = math.sqrt(1.25)
    loose = GSPOLoss(clip_low=0.3, clip_high=0.3)
    assert _value(loose) == pytest.approx((-s1 + 0.8) / 2)
    # clip 0.1: s1 is cut to 1.1 (A>0); sequence 2's 0.8 is below the floor 0.9 with A<0: -min(-0.8, -0.9) = 0.9.
    tight = GSPOLoss(clip_low=0.1, clip_high=0.1)
    loss, stats = Objective(tight)(_outputs(), _micro())
    assert float(loss) == pytest.approx((-1.1 + 0.9) / 2)
    assert float(stats.clip_fraction) == pytest.approx(3.0)  # both sequences' tokens (a sum over tokens)
    # clip 0.25: floor 0.75 and ceiling 1.25 hold both ratios.
    _, stats = Objective(GSPOLoss(clip_low=0.25, clip_high=0.25))(_outputs(), _micro())
    assert float(stats.clip_fraction) == 0.0


def test_gspo_gradient_equals_finite_differences_of_its_definition():
    torch.manual_seed(0)
    old = torch.randn(3, 5, dtype=torch.float64) - 2
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    advantages = torch.tensor([0.7, -1.3, 0.4], dtype=torch.float64)
    micro = _micro(mask=mask, advantages=advantages, old_logprobs=old, rollout_logprobs=old,
                   total_seqs=torch.tensor(3.0), total_tokens=mask.sum().float())
    loss_fn = GSPOLoss(clip_low=0.05, clip_high=0.08)

    def definition(logprobs: torch.Tensor) -> float:
        total = 0.0
        for row in range(3):
            valid = mask[row]
            ratio = math.exp(float((logprobs[row][valid] - old[row][valid]).mean()))
            a = float(advantages[row])
            total += -min(ratio * a, min(max(ratio, 1 - 0.05), 1 + 0.08) * a)
        return total / 3

    # Points on both sides of the clip range, none on its edges (where the derivative jumps).
    for shift in (0.01, -0.03, 0.2):
        logprobs = (old + shift + 0.01 * torch.randn_like(old)).requires_grad_(True)
        loss, _ = Objective(loss_fn)(_outputs(logprobs), micro)
        assert float(loss) == pytest.approx(definition(logprobs.detach()), abs=1e-12)
        (grad,) = torch.autograd.grad(loss, logprobs)
        numeric = torch.zeros_like(old)
        for index in mask.nonzero().tolist():
            step = torch.zeros_like(old)
            step[tuple(index)] = 1e-6
            base = logprobs.detach()
            numeric[tuple(index)] = (definition(base + step) - definition(base - step)) / 2e-6
        torch.testing.assert_close(grad, numeric, atol=1e-7, rtol=1e-5)
        assert grad[~mask].abs().sum() == 0


def test_corrections_weigh_tokens_and_terms_add():
    # TIS: rollout log-probs one nat below the learner's "old": weights min(e, 2) = 2 on every token.
    rollout = torch.tensor(OLD, dtype=torch.float64) - 1.0
    policy = GRPOLoss(clip_low=0.2, clip_high=0.2)
    plain = _value(policy)
    weighted, _ = Objective(policy, [TruncatedImportance(2.0)])(_outputs(), _micro(rollout_logprobs=rollout))
    assert float(weighted) == pytest.approx(2 * plain)
    # MIS at threshold 2: a ratio of e is outside [1/2, 2] on every token, so all are dropped.
    _, stats = Objective(policy, [MaskedImportance(2.0)])(_outputs(), _micro(rollout_logprobs=rollout))
    assert float(stats.mis_dropped) == 3
    # KL k1 to a reference one nat below the policy: +beta x 1 per token, token-mean.
    reference = torch.tensor(LOGPROBS, dtype=torch.float64) - 1.0
    with_kl, stats = Objective(policy, terms=[KLPenalty(0.1, "k1")])(_outputs(), _micro(ref_logprobs=reference))
    assert float(with_kl) == pytest.approx(plain + 0.1)
    assert float(stats.kl) == pytest.approx(3.0)


def test_the_gap_to_the_rollout_engine_is_summed_over_trained_tokens():
    """The learner-vs-engine diagnostics: |old - rollout| summed and its maximum, and the k3 estimate of
    KL(rollout || learner) summed (the engine sampled the tokens)."""
    old = torch.tensor([[0.0, -1.0, -2.0], [-0.5, 0.0, 0.0]], dtype=torch.float64)
    rollout = torch.tensor([[0.0, -1.5, -1.0], [-0.5, 9.0, 9.0]], dtype=torch.float64)  # 9.0: masked garbage
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    inputs = _micro(mask=mask, old_logprobs=old, rollout_logprobs=rollout, advantages=torch.zeros(2))
    # d = old - rollout over trained tokens: [0, 0.5, -1, 0]; per token exp(d) - d - 1:
    # d=0.5 -> 1.6487213 - 1.5 = 0.1487213; d=-1 -> exp(-1) = 0.3678794; d=0 -> 0
    _, stats = Objective(GRPOLoss())(_outputs(old.clone()), inputs)
    assert float(stats.tokens) == 4
    assert float(stats.gap_abs) == pytest.approx(1.5)
    assert float(stats.gap_max) == pytest.approx(1.0)
    assert float(stats.gap_kl) == pytest.approx(0.1487213 + 0.3678794, abs=1e-7)
    nothing = _micro(mask=torch.zeros(1, 2, dtype=torch.bool), old_logprobs=torch.ones(1, 2, dtype=torch.float64),
                     rollout_logprobs=-torch.ones(1, 2, dtype=torch.float64), advantages=torch.zeros(1))
    _, stats = Objective(GRPOLoss())(_outputs(torch.ones(1, 2, dtype=torch.float64)), nothing)
    assert (float(stats.gap_abs), float(stats.gap_max), float(stats.gap_kl)) == (0.0, 0.0, 0.0)


def test_the_config_selects_the_loss_and_its_own_defaults():
    def objective(*overrides):
        cfg = load_config(None, list(overrides))
        return build_objective(cfg.algo, max_tokens=cfg.rollout.max_tokens), loss_defaults(cfg.algo)

    (grpo, (scale, drop)) = objective()
    assert isinstance(grpo.policy, GRPOLoss) and (grpo.policy.clip_low, grpo.policy.clip_high) == (0.2, 0.28)
    assert grpo.policy.aggregation == "token-mean" and (scale, drop) == ("group", False)
    assert [type(c) for c in grpo.corrections] == [TruncatedImportance] and not grpo.terms
    dr, (scale, _) = objective("algo.loss=dr_grpo")
    assert isinstance(dr.policy, DrGRPOLoss) and scale == "none" and dr.policy.max_tokens == 128
    dapo, (_, drop) = objective("algo.loss=dapo", "algo.drop_uniform_groups=false")
    assert isinstance(dapo.policy, DAPOLoss) and drop is False  # a set value wins over the loss's own
    gspo, _ = objective("algo.loss=gspo", "algo.clip_high=0.001", "algo.kl_beta=0.1")
    assert (gspo.policy.clip_low, gspo.policy.clip_high) == (3e-4, 1e-3)
    assert [type(t) for t in gspo.terms] == [KLPenalty] and gspo.needs_reference
    with pytest.raises(ConfigError, match="algo.loss_agg: only grpo"):
        load_config(None, ["algo.loss=gspo", "algo.loss_agg=token-mean"])
