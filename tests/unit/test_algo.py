"""Unit tests for rlpipe.algo against hand-computed values.

Expected numbers are written out literally; the comments show the arithmetic.
Tests use float64 so that values like exp(log(1.5)) stay within 1e-12 of 1.5.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlpipe.algo import (
    aggregate,
    group_advantages,
    kl_penalty,
    policy_loss,
    masked_importance_weights,
    truncated_importance_weights,
    uniform_groups,
)

NAN = float("nan")


def t(values, dtype=torch.float64, **kw):
    return torch.tensor(values, dtype=dtype, **kw)


def assert_close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        actual, t(expected, dtype=actual.dtype), atol=atol, rtol=0.0
    )


# --------------------------------------------------------------------------- #
# group_advantages / uniform_groups
# --------------------------------------------------------------------------- #

# Group 0: [0, 0, 2, 2] -> mean 1, centred [-1, -1, 1, 1], pop. var 4/4 = 1, std 1.
# Group 1: [3, 3, 3, 7] -> mean 4, centred [-1, -1, -1, 3], pop. var 12/4 = 3, std sqrt(3).
REWARDS = [0.0, 0.0, 2.0, 2.0, 3.0, 3.0, 3.0, 7.0]


def test_group_advantages_scale_group():
    adv = group_advantages(t(REWARDS), group_size=4, scale="group", eps=0.0)
    # group 1: -1/sqrt(3) = -0.5773503, 3/sqrt(3) = 1.7320508
    assert_close(
        adv, [-1.0, -1.0, 1.0, 1.0, -0.5773503, -0.5773503, -0.5773503, 1.7320508]
    )


def test_group_advantages_uses_population_std_and_eps():
    # eps=1 makes the eps contribution visible: group 0 divides by 1 + 1 = 2,
    # group 1 by sqrt(3) + 1 = 2.7320508. With the sample (n-1) std group 0 would
    # have std sqrt(4/3) instead of 1, so this also pins the population std.
    adv = group_advantages(t(REWARDS), group_size=4, scale="group", eps=1.0)
    # -1/2.7320508 = -0.3660254, 3/2.7320508 = 1.0980762
    assert_close(
        adv, [-0.5, -0.5, 0.5, 0.5, -0.3660254, -0.3660254, -0.3660254, 1.0980762]
    )


def test_group_advantages_default_is_group_scale_with_small_eps():
    adv = group_advantages(t(REWARDS), group_size=4)
    # group 0: +-1 / (1 + 1e-6)
    assert_close(adv[:4], [-0.999999, -0.999999, 0.999999, 0.999999], atol=1e-9)


def test_group_advantages_scale_none():
    adv = group_advantages(t(REWARDS), group_size=4, scale="none")
    assert_close(adv, [-1.0, -1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 3.0], atol=1e-12)


def test_group_advantages_scale_batch():
    # Batch of all 8 rewards: mean 20/8 = 2.5; squared deviations
    # 6.25, 6.25, 0.25, 0.25, 0.25, 0.25, 0.25, 20.25 -> sum 34, var 34/8 = 4.25,
    # std sqrt(4.25) = 2.0615528. Centred values are still per group.
    # 1/2.0615528 = 0.4850713, 3/2.0615528 = 1.4552138
    adv = group_advantages(t(REWARDS), group_size=4, scale="batch", eps=0.0)
    assert_close(
        adv,
        [-0.4850713, -0.4850713, 0.4850713, 0.4850713,
         -0.4850713, -0.4850713, -0.4850713, 1.4552138],
    )


def test_group_advantages_nan_excluded_and_zero():
    # Group 0: [4, nan, 2, nan] -> valid [4, 2], mean 3 (it would be 1.5 if NaN
    # counted as 0), centred [1, -1], pop. std 1.
    # Group 1: [nan, 5, nan, nan] -> one valid sample -> all 0.
    # Group 2: all NaN -> all 0.
    rewards = t([4.0, NAN, 2.0, NAN, NAN, 5.0, NAN, NAN, NAN, NAN, NAN, NAN])
    for scale, g0 in [
        ("group", [1.0, 0.0, -1.0, 0.0]),
        ("none", [1.0, 0.0, -1.0, 0.0]),
        # valid rewards in batch [4, 2, 5]: mean 11/3, var ((1/3)^2 + (5/3)^2 +
        # (4/3)^2)/3 = 42/27, std 1.2472191 -> 1/1.2472191 = 0.8017837
        ("batch", [0.8017837, 0.0, -0.8017837, 0.0]),
    ]:
        adv = group_advantages(rewards, group_size=4, scale=scale, eps=0.0)
        assert not torch.isnan(adv).any(), scale
        assert_close(adv, g0 + [0.0] * 8)


def test_group_advantages_single_valid_and_uniform_groups_are_exactly_zero():
    # [0.1]*3 has a float mean != 0.1; with eps=0 an un-guarded implementation
    # would divide rounding noise by a rounding-noise std.
    rewards = t([0.1, 0.1, 0.1, 7.0, NAN, NAN])
    adv = group_advantages(rewards, group_size=3, scale="group", eps=0.0)
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    adv = group_advantages(t([1.0, 1.0]), group_size=2, scale="batch", eps=0.0)
    assert adv.tolist() == [0.0, 0.0]


def test_group_advantages_int_rewards_and_float32():
    adv = group_advantages(torch.tensor([0, 0, 2, 2]), group_size=4, eps=0.0)
    assert adv.is_floating_point()
    assert_close(adv, [-1.0, -1.0, 1.0, 1.0])
    adv32 = group_advantages(t(REWARDS, dtype=torch.float32), group_size=4, eps=0.0)
    assert adv32.dtype == torch.float32


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="'zscore'"):
        group_advantages(t(REWARDS), group_size=4, scale="zscore")
    with pytest.raises(ValueError, match="multiple"):
        group_advantages(t(REWARDS), group_size=3)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(t(REWARDS), group_size=0)
    with pytest.raises(ValueError, match="inf"):
        group_advantages(t([1.0, float("inf")]), group_size=2)


def test_uniform_groups():
    rewards = t(
        [
            1.0, 1.0, 1.0, 1.0,  # all equal -> True
            0.0, 1.0, 0.0, 0.0,  # differ -> False
            2.0, NAN, 2.0, 2.0,  # valid ones equal -> True
            NAN, NAN, 3.0, NAN,  # one valid -> True
            NAN, NAN, NAN, NAN,  # none valid -> True
            1.0, NAN, 2.0, NAN,  # valid ones differ -> False
        ]
    )
    got = uniform_groups(rewards, group_size=4)
    assert got.dtype == torch.bool
    assert got.tolist() == [True, False, True, True, True, False]


# --------------------------------------------------------------------------- #
# policy_loss
# --------------------------------------------------------------------------- #


def _ratios_to_logprobs(ratios):
    # old_logprobs = 0, so ratio = exp(logprobs) -> logprobs = log(ratio)
    lp = torch.log(t(ratios)).requires_grad_(True)
    return lp, torch.zeros_like(lp)


def test_policy_loss_clipping_values_grads_and_clip_fraction():
    # clip_low 0.2 -> floor 0.8; clip_high 0.28 -> ceiling 1.28.
    # seq 0, A = +2, ratios [1.5, 1.1, 0.5, 1.0]:
    #   1.5: min(3.0, 1.28*2=2.56) = 2.56 clipped     -> loss -2.56, grad 0
    #   1.1: min(2.2, 2.2) not clipped                -> loss -2.2, grad -r*A = -2.2
    #   0.5: min(1.0, 0.8*2=1.6) = 1.0 (unclipped: a positive-A ratio is never
    #        clipped from below)                      -> loss -1.0, grad -1.0
    #   1.0: -> loss -2.0, grad -2.0
    # seq 1, A = -1, ratios [0.5, 0.9, 1.5, 3.0(masked)]:
    #   0.5: min(-0.5, 0.8*-1=-0.8) = -0.8 clipped    -> loss 0.8, grad 0
    #   0.9: min(-0.9, -0.9) not clipped              -> loss 0.9, grad -r*A = 0.9
    #   1.5: min(-1.5, 1.28*-1=-1.28) = -1.5 unclipped -> loss 1.5, grad 1.5
    #   3.0: masked -> loss 0, grad 0
    # clipped valid tokens: 2 of 7 -> clip_fraction 2/7 = 0.2857143;
    # high (A>0): 1/7 = 0.1428571, low (A<0): 1/7.
    lp, old = _ratios_to_logprobs([[1.5, 1.1, 0.5, 1.0], [0.5, 0.9, 1.5, 3.0]])
    adv = t([2.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    loss, stats = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert loss.shape == (2, 4)
    assert_close(loss, [[-2.56, -2.2, -1.0, -2.0], [0.8, 0.9, 1.5, 0.0]])
    loss.sum().backward()
    assert_close(lp.grad, [[0.0, -2.2, -1.0, -2.0], [0.0, 0.9, 1.5, 0.0]])
    assert stats["clip_fraction"].is_floating_point()
    assert stats["clip_fraction"].item() == pytest.approx(2 / 7)
    assert stats["clip_fraction_high"].item() == pytest.approx(1 / 7)
    assert stats["clip_fraction_low"].item() == pytest.approx(1 / 7)
    # ratio mean over the 7 valid tokens: (1.5+1.1+0.5+1.0+0.5+0.9+1.5)/7 = 7/7 = 1
    assert stats["ratio_mean"].item() == pytest.approx(1.0)
    assert stats["ratio_max"].item() == pytest.approx(1.5)  # 3.0 is masked
    assert not stats["clip_fraction"].requires_grad


def test_policy_loss_clip_higher_is_asymmetric():
    # Same 0.25 deviation from 1 on both sides.
    # seq 0: A = +1, ratio 1.25; seq 1: A = -1, ratio 0.75.
    lp, old = _ratios_to_logprobs([[1.25], [0.75]])
    adv = t([1.0, -1.0])
    mask = torch.ones(2, 1, dtype=torch.bool)

    # clip-higher (0.2, 0.28): ceiling 1.28 > 1.25 -> positive-A token unclipped
    # (loss -1.25, grad -1.25); floor 0.8 > 0.75 -> negative-A token clipped
    # (loss -(0.8*-1) = 0.8, grad 0).
    loss, stats = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert_close(loss, [[-1.25], [0.8]])
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert_close(grad, [[-1.25], [0.0]])
    assert stats["clip_fraction"].item() == pytest.approx(0.5)

    # symmetric (0.2, 0.2): ceiling 1.2 < 1.25 -> now both are clipped:
    # loss -(1.2*1) = -1.2 and 0.8, both gradients 0.
    loss, stats = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert_close(loss, [[-1.2], [0.8]])
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert_close(grad, [[0.0], [0.0]])
    assert stats["clip_fraction"].item() == pytest.approx(1.0)


def test_policy_loss_token_weights_scale_and_are_detached():
    # ratio 1 everywhere, A = 2 -> unweighted loss -2 per token.
    lp, old = _ratios_to_logprobs([[1.0, 1.0, 1.0]])
    weights = t([[0.5, 1.0, 2.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    loss, _ = policy_loss(
        lp, old, t([2.0]), mask, clip_low=0.2, clip_high=0.2, token_weights=weights
    )
    # [-2*0.5, -2*1.0, masked]
    assert_close(loss, [[-1.0, -2.0, 0.0]])
    loss.sum().backward()
    assert weights.grad is None
    # d/dlp of -w*r*A = -w*A at r=1
    assert_close(lp.grad, [[-1.0, -2.0, 0.0]])


def test_policy_loss_masked_garbage_does_not_leak():
    lp = t([[0.0, float("inf")]], requires_grad=True)
    old = t([[0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0]])  # numeric mask accepted
    loss, stats = policy_loss(lp, old, t([1.0]), mask, clip_low=0.2, clip_high=0.2)
    assert loss.tolist() == [[-1.0, 0.0]]
    assert stats["clip_fraction"].item() == 0.0


def test_policy_loss_errors():
    lp, old = _ratios_to_logprobs([[1.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, old, t([1.0, 2.0]), mask, clip_low=0.2, clip_high=0.2)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(lp, old, t([1.0]), mask, clip_low=-0.1, clip_high=0.2)
    with pytest.raises(ValueError, match="clip_high"):
        policy_loss(lp, old, t([1.0]), mask, clip_low=0.2, clip_high=-0.1)


# --------------------------------------------------------------------------- #
# kl_penalty
# --------------------------------------------------------------------------- #


def test_kl_penalty_estimators():
    # pair 0: logp -1.0, ref -1.5 -> d = 0.5
    #   k1 = 0.5; k2 = 0.5*0.25 = 0.125; k3 = exp(-0.5) + 0.5 - 1 = 0.1065307
    # pair 1: logp -2.0, ref -1.0 -> d = -1
    #   k1 = -1; k2 = 0.5; k3 = exp(1) - 1 - 1 = 0.7182818
    # pair 2: identical -> 0 for all
    logp = t([-1.0, -2.0, -0.3])
    ref = t([-1.5, -1.0, -0.3])
    assert_close(kl_penalty(logp, ref, "k1"), [0.5, -1.0, 0.0])
    assert_close(kl_penalty(logp, ref, "k2"), [0.125, 0.5, 0.0])
    assert_close(kl_penalty(logp, ref, "k3"), [0.1065307, 0.7182818, 0.0])
    with pytest.raises(ValueError, match="'k4'"):
        kl_penalty(logp, ref, "k4")


# --------------------------------------------------------------------------- #
# aggregate
# --------------------------------------------------------------------------- #

# Ragged batch of 4 sequences, T = 4:
#   s0 [1, 2, 3, 4] mask 1111 -> sum 10, 4 tokens, mean 2.5
#   s1 [5, 6, 7, 8] mask 1100 -> sum 11, 2 tokens, mean 5.5
#   s2 [2, 4, 6, 8] mask 1000 -> sum  2, 1 token,  mean 2
#   s3 [9, 9, 9, 9] mask 0000 -> sum  0, 0 tokens, contributes 0
# 7 valid tokens, 4 sequences.
PER_TOKEN = [[1, 2, 3, 4], [5, 6, 7, 8], [2, 4, 6, 8], [9, 9, 9, 9]]
MASK = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
AGG_CASES = [
    # (mode, kwargs, expected value, expected d/d(per_token) for valid tokens)
    # token-mean: 23/7 = 3.2857143; grad 1/7 per valid token
    ("token-mean", {}, 23 / 7, [1 / 7, 1 / 7, 1 / 7, 0]),
    # seq-mean-token-mean: (2.5 + 5.5 + 2 + 0)/4 = 2.5; grad 1/(n_i * 4)
    ("seq-mean-token-mean", {}, 2.5, [1 / 16, 1 / 8, 1 / 4, 0]),
    # sum-norm, max_tokens 4: (10 + 11 + 2 + 0)/4/4 = 23/16 = 1.4375; grad 1/16
    ("seq-mean-token-sum-norm", {"max_tokens": 4}, 1.4375, [1 / 16] * 3 + [0]),
]


def _expected_grad(per_seq_grad):
    mask = t(MASK)
    return mask * t(per_seq_grad).unsqueeze(-1)


@pytest.mark.parametrize("mode,kwargs,expected,per_seq_grad", AGG_CASES)
def test_aggregate_modes_on_ragged_mask(mode, kwargs, expected, per_seq_grad):
    x = t(PER_TOKEN, requires_grad=True)
    out = aggregate(x, torch.tensor(MASK, dtype=torch.bool), mode, **kwargs)
    assert out.dim() == 0
    assert out.item() == pytest.approx(expected)
    out.backward()
    assert_close(x.grad, _expected_grad(per_seq_grad).tolist())


@pytest.mark.parametrize("mode,kwargs,expected,per_seq_grad", AGG_CASES)
def test_aggregate_micro_batches_sum_to_full_batch(mode, kwargs, expected, per_seq_grad):
    # Full batch.
    x_full = t(PER_TOKEN, requires_grad=True)
    mask = torch.tensor(MASK, dtype=torch.bool)
    full = aggregate(x_full, mask, mode, **kwargs)
    full.backward()

    # Two micro-batches [s0, s1] and [s2, s3] with mini-batch totals:
    # total_tokens 7, total_seqs 4. Gradients accumulate into one leaf.
    x = t(PER_TOKEN, requires_grad=True)
    parts = []
    for rows in (slice(0, 2), slice(2, 4)):
        part = aggregate(
            x[rows], mask[rows], mode, total_tokens=7, total_seqs=4, **kwargs
        )
        part.backward()
        parts.append(part.item())
    # e.g. token-mean: 21/7 + 2/7 = 23/7; seq-mean-token-mean: (2.5+5.5)/4 + 2/4
    assert sum(parts) == pytest.approx(expected)
    assert sum(parts) == pytest.approx(full.item())
    torch.testing.assert_close(x.grad, x_full.grad)


def test_aggregate_without_totals_uses_own_counts():
    # Micro-batch [s2, s3] alone: 1 valid token, 2 sequences.
    x = t(PER_TOKEN[2:])
    mask = torch.tensor(MASK[2:])
    assert aggregate(x, mask, "token-mean").item() == pytest.approx(2.0)  # 2/1
    assert aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx(1.0)  # (2+0)/2
    # (2/4 + 0)/2 = 0.25
    assert aggregate(
        x, mask, "seq-mean-token-sum-norm", max_tokens=4
    ).item() == pytest.approx(0.25)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregate_nothing_valid_is_zero_not_nan(mode):
    # Padding holds NaN; nothing valid -> 0, and NaN must not leak.
    x = t([[NAN, NAN], [NAN, NAN]], requires_grad=True)
    mask = torch.zeros(2, 2, dtype=torch.bool)
    out = aggregate(x, mask, mode, max_tokens=2)
    assert out.item() == 0.0
    out.backward()
    assert x.grad.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert aggregate(x, mask, mode, max_tokens=2, total_tokens=0, total_seqs=0).item() == 0.0


def test_aggregate_errors():
    x = t(PER_TOKEN)
    mask = torch.tensor(MASK)
    with pytest.raises(ValueError, match="'seq-sum'"):
        aggregate(x, mask, "seq-sum")
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(x, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="total_tokens"):
        aggregate(x, mask, "token-mean", total_tokens=-1)
    with pytest.raises(ValueError, match="mask shape"):
        aggregate(x, mask[:, :2], "token-mean")


# --------------------------------------------------------------------------- #
# truncated_importance_weights / masked_importance_weights
# --------------------------------------------------------------------------- #


def test_truncated_importance_weights():
    # learner/rollout ratios 1, 2, 5, 0.5 with cap 3 -> 1, 2, 3, 0.5
    learner = t([[0.0, math.log(2.0), math.log(5.0), math.log(0.5)]], requires_grad=True)
    rollout = torch.zeros_like(learner)
    w = truncated_importance_weights(learner, rollout, cap=3.0)
    assert_close(w, [[1.0, 2.0, 3.0, 0.5]])
    assert not w.requires_grad
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="cap"):
            truncated_importance_weights(learner, rollout, cap=bad)


def test_masked_importance_weights_drop_tokens_past_the_threshold():
    # learner/rollout ratios 1, 2.5, 0.3, 1.9 with threshold 2 -> keep, drop, drop, keep
    learner = t([[0.0, math.log(2.5), math.log(0.3), math.log(1.9)]], requires_grad=True)
    rollout = torch.zeros_like(learner)
    mask = torch.ones(1, 4, dtype=torch.bool)
    kept = masked_importance_weights(learner, rollout, mask, threshold=2.0)
    assert_close(kept, [[1.0, 0.0, 0.0, 1.0]])
    assert not kept.requires_grad
    for bad in (1.0, 0.5):
        with pytest.raises(ValueError, match="threshold"):
            masked_importance_weights(learner, rollout, mask, threshold=bad)
    with pytest.raises(ValueError, match="level"):
        masked_importance_weights(learner, rollout, mask, threshold=2.0, level="batch")


def test_masked_importance_weights_judge_whole_sequences_by_their_geometric_mean():
    # Row 0: log-ratios 0.5, 0.5, (padding 9) -> mean 0.5 < log 2 -> kept whole.
    # Row 1: log-ratios 1.0, 0.6 -> mean 0.8 > log 2 = 0.693 -> dropped whole, although 0.6 alone would pass.
    learner = t([[0.5, 0.5, 9.0], [1.0, 0.6, 0.0]])
    rollout = torch.zeros_like(learner)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    mask[1, 2] = False
    kept = masked_importance_weights(learner, rollout, mask, threshold=2.0, level="sequence")
    assert_close(kept, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    token_level = masked_importance_weights(learner, rollout, mask, threshold=2.0, level="token")
    assert_close(token_level[1, :2], [0.0, 1.0])
